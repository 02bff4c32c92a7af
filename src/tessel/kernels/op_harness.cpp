// The op-by-op comparison harness: the case table (one builder per op family, each with its
// bounds derived beside it), the comparison and the gradient mode. See op_harness.h.
#include "tessel/kernels/op_harness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tessel/core/error.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"

namespace tessel::kernels::harness {

// ---- containers ---------------------------------------------------------------------------------

namespace {

// Adds or replaces the named entry.
template <typename T>
void set_named(std::vector<std::pair<std::string, std::vector<T>>>& entries, std::string name,
               std::vector<T> values) {
  for (auto& [n, v] : entries) {
    if (n == name) {
      v = std::move(values);
      return;
    }
  }
  entries.emplace_back(std::move(name), std::move(values));
}

}  // namespace

void Tensors::set(std::string name, std::vector<float> values) {
  set_named(floats, std::move(name), std::move(values));
}

void Tensors::set_ints(std::string name, std::vector<int32_t> values) {
  set_named(ints, std::move(name), std::move(values));
}

bool Tensors::has(std::string_view name) const {
  for (const auto& [n, v] : floats)
    if (n == name) return true;
  for (const auto& [n, v] : ints)
    if (n == name) return true;
  return false;
}

std::vector<float>& Tensors::f(std::string_view name) {
  for (auto& [n, v] : floats)
    if (n == name) return v;
  throw std::out_of_range("no float input '" + std::string(name) + "'");
}

const std::vector<float>& Tensors::f(std::string_view name) const {
  return const_cast<Tensors*>(this)->f(name);
}

const std::vector<int32_t>& Tensors::i(std::string_view name) const {
  for (const auto& [n, v] : ints)
    if (n == name) return v;
  throw std::out_of_range("no int input '" + std::string(name) + "'");
}

const std::vector<double>& find(const Outputs& outputs, std::string_view name) {
  for (const Output& o : outputs)
    if (o.name == name) return o.values;
  throw std::out_of_range("no output '" + std::string(name) + "'");
}

std::string_view pass_name(Pass pass) {
  return pass == Pass::forward ? "forward" : "backward";
}

// ---- results ------------------------------------------------------------------------------------

double CaseResult::worst_ratio() const {
  double worst = 0;
  for (const Comparison& c : comparisons) worst = std::max(worst, c.worst_ratio);
  return worst;
}

std::string CaseResult::summary() const {
  std::ostringstream s;
  s << case_name << " on " << backend << ": "
    << (status == Status::passed    ? "passed"
        : status == Status::skipped ? "skipped"
                                    : "FAILED");
  if (!message.empty()) s << " (" << message << ")";
  for (const Comparison& c : comparisons) {
    s << "\n  " << c.output << ": worst |diff|/bound " << c.worst_ratio << " at element "
      << c.worst_index << " (" << c.count << " compared)";
    if (c.count > 0) {
      s.precision(9);
      s << " (" << c.actual << " vs " << c.expected << ", bound " << c.bound << ")";
      s.precision(6);
    }
    if (c.beyond > 0) s << "; " << c.beyond << " elements beyond their bound";
  }
  return s.str();
}

namespace {

using testing::gamma64;
constexpr double u = testing::kUnitRoundoff;

// One element's |diff| / bound: 0 when equal (infinities of one sign included), infinite for a
// NaN on either side, a difference against a zero bound, or a bound that is not a number.
double ratio_of(double actual, double expected, double bound) {
  if (actual == expected) return 0.0;
  if (std::isnan(actual) || std::isnan(expected) || !(bound >= 0)) return INFINITY;
  const double diff = std::fabs(actual - expected);
  return bound > 0 ? diff / bound : INFINITY;
}

void record(Comparison& c, size_t index, double actual, double expected, double bound) {
  const double ratio = ratio_of(actual, expected, bound);
  if (ratio > 1) ++c.beyond;
  if (c.count == 0 || ratio > c.worst_ratio) {
    c.worst_ratio = ratio, c.worst_index = index;
    c.actual = actual, c.expected = expected, c.bound = bound;
  }
  ++c.count;
}

bool report_margins_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("TESSEL_REPORT_MARGINS");
    return env != nullptr && *env == '1';
  }();
  return enabled;
}

// The same line testing::within_bounds prints.
void report_margin(const CaseResult& r, const Comparison& c) {
  if (!report_margins_enabled()) return;
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name =
      test != nullptr ? std::string(test->test_suite_name()) + "." + test->name() : r.case_name;
  std::fprintf(stderr, "margin %-50s %-16s worst |diff|/bound %.3g (element %zu of %zu)\n",
               name.c_str(), c.output.c_str(), c.worst_ratio, c.worst_index, c.count);
}

void fail(CaseResult& r, const std::string& why) {
  r.status = Status::failed;
  if (!r.message.empty()) r.message += "; ";
  r.message += why;
}

bool lacks_op(CaseResult& r, const OpCase& c, Backend& b) {
  if (b.supports(c.op)) return false;
  r.status = Status::skipped;
  r.message = "backend '" + std::string(b.name()) + "' does not support op '" +
              std::string(op_name(c.op)) + "'; case " + c.name + " skipped";
  return true;
}

}  // namespace

// ---- comparison ---------------------------------------------------------------------------------

CaseResult run_case(const OpCase& c, Backend& backend, Backend& reference, uint64_t seed) {
  CaseResult r;
  r.case_name = c.name;
  r.backend = std::string(backend.name());
  if (lacks_op(r, c, backend) || lacks_op(r, c, reference)) return r;
  const Tensors in = c.make_inputs(seed);

  if (c.expect_invalid_argument) {
    for (Backend* b : {&backend, &reference}) {
      const std::string who = "backend '" + std::string(b->name()) + "'";
      try {
        c.run(*b, in);
        fail(r, who + " accepted arguments the op's contract rejects");
      } catch (const InvalidArgumentError&) {
        // The contract: InvalidArgumentError.
      } catch (const std::exception& e) {
        fail(r, who + " threw another exception than InvalidArgumentError: " + e.what());
      }
    }
    return r;
  }

  Outputs expected, actual, bounds;
  try {
    expected = c.run(reference, in);
  } catch (const std::exception& e) {
    fail(r, std::string("the reference threw: ") + e.what());
    return r;
  }
  try {
    actual = c.run(backend, in);
  } catch (const std::exception& e) {
    fail(r, std::string("threw: ") + e.what());
    return r;
  }
  try {
    bounds = c.bounds(in, expected);
  } catch (const std::exception& e) {
    fail(r, std::string("no bound: ") + e.what());
    return r;
  }
  if (actual.size() != expected.size()) fail(r, "another number of outputs than the reference's");
  for (const Output& e : expected) {
    Comparison cmp;
    cmp.output = e.name;
    const std::vector<double>* a = nullptr;
    const std::vector<double>* b = nullptr;
    for (const Output& o : actual)
      if (o.name == e.name) a = &o.values;
    for (const Output& o : bounds)
      if (o.name == e.name) b = &o.values;
    if (a == nullptr || a->size() != e.values.size()) {
      fail(r, "output '" + e.name + "' missing or of another size");
      continue;
    }
    if (b == nullptr || b->size() != e.values.size()) {
      fail(r, "no bound for output '" + e.name + "'");
      continue;
    }
    for (size_t i = 0; i < e.values.size(); ++i) record(cmp, i, (*a)[i], e.values[i], (*b)[i]);
    report_margin(r, cmp);
    if (cmp.beyond > 0) fail(r, "'" + e.name + "' beyond its bound");
    r.comparisons.push_back(std::move(cmp));
  }
  return r;
}

// ---- gradient mode ------------------------------------------------------------------------------
//
// For element x of input p, the backward's gradient g (the backward case run with its gradient
// buffers zeroed) against the central difference
//   D = sum_j w_j (y+_j - y-_j) / (2h),  y+- = the forward at x +- h,
// of L = sum_j w_j y_j. Inputs p are first moved to the grid of multiples of 2^-12 (with
// |x| < 2^10), so x +- h is exact for every power of two 2^-12 <= h <= 2^-3. With Y the exact
// forward:
//  * |g - L'(x)| <= the backward case's bound at that element, plus u |g| + 2^-149: every bound
//    in the table bounds |backend - reference| by the sum of both sides' errors against the
//    exact value, so it bounds the reference's error; u |g| + 2^-149 covers the cases whose
//    bound is 0 because every float implementation rounds the exact result once (residual,
//    embedding).
//  * |D - (L(x+h) - L(x-h)) / 2h| <= sum_j |w_j| (e+_j + e-_j) / 2h, e+- the forward case's bound
//    at x +- h plus u |y| + 2^-149 (the same argument), over the outputs j whose exact value
//    depends on x (GradSpec::dependents). Every other output is computed from the same inputs
//    in the same way at x +- h, so y+_j = y-_j exactly (checked) and adds nothing. Forming D in
//    double (differences, products, sum) adds gamma64(J + 2) sum_j |w_j| (|y+_j| + |y-_j|) / 2h.
//  * Truncation: by Taylor's theorem with the Lagrange remainder at both ends,
//    (L(x+h) - L(x-h)) / 2h - L'(x) = h^2/12 (L'''(a) + L'''(b)) with a, b within h of x, so it
//    is at most h^2/6 M3, M3 = GradSpec::third_derivative's bound on |L'''| over [x-h, x+h]
//    (0 where L is affine in x: linear, embedding, residual, rope, the norms' weight and bias,
//    attention's v, swiglu's up).
// h balances the rounding term R/h against the truncation h^2 M3 / 6: h = (3 R / M3)^(1/3),
// rounded to a power of two in [2^-12, 2^-3] (2^-3 when M3 = 0); the bound holds for any h.

namespace {

constexpr double kGrid = 0x1p-12;
constexpr double kMaxStep = 0x1p-3;

double choose_step(double rounding, double m3) {
  if (m3 <= 0 || rounding <= 0) return kMaxStep;
  int e;
  std::frexp(std::cbrt(3 * rounding / m3), &e);  // cbrt(.) = f 2^e with 0.5 <= f < 1
  return std::clamp(std::ldexp(1.0, e - 1), kGrid, kMaxStep);
}

// Bounds on |y - Y| for the forward's outputs y (a bound function may give more outputs).
Outputs forward_errors(const GradSpec& g, const Tensors& in, const Outputs& y) {
  const Outputs bounds = g.forward_bounds(in, y);
  Outputs e;
  for (const Output& o : y) {
    const std::vector<double>& b = find(bounds, o.name);
    if (b.size() != o.values.size()) throw std::logic_error("bound of another size: " + o.name);
    Output err{o.name, b};
    for (size_t j = 0; j < b.size(); ++j) err.values[j] += u * std::fabs(o.values[j]) + 0x1p-149;
    e.push_back(std::move(err));
  }
  return e;
}

}  // namespace

CaseResult check_gradients(const OpCase& c, Backend& backend, uint64_t seed) {
  CaseResult r;
  r.case_name = c.name;
  r.backend = std::string(backend.name());
  if (!c.grad) {
    fail(r, "the case has no gradient mode");
    return r;
  }
  if (lacks_op(r, c, backend)) return r;
  const GradSpec& g = *c.grad;
  Tensors in = c.make_inputs(seed);
  try {
    for (const auto& [param, grad_name] : g.params) {
      for (float& x : in.f(param)) {
        x = float(std::nearbyint(double(x) / kGrid) * kGrid);
        if (!(std::fabs(x) < 1024)) throw std::domain_error(param + " is too large for the grid");
      }
    }
    g.derive(in);
    const Outputs grads = c.run(backend, in);
    const Outputs grad_bounds = c.bounds(in, grads);
    const Outputs w = g.weights(in);
    const Outputs y0 = g.forward(backend, in);
    const Outputs e0 = forward_errors(g, in, y0);

    for (const auto& [param, grad_name] : g.params) {
      Comparison cmp;
      cmp.output = grad_name + " vs finite differences";
      const std::vector<double>& grad = find(grads, grad_name);
      const std::vector<double>& gb = find(grad_bounds, grad_name);
      std::vector<float>& x = in.f(param);
      std::vector<size_t> indices(x.size());
      std::iota(indices.begin(), indices.end(), size_t(0));
      std::mt19937_64 rng(seed * 7919 + grad_name.size());
      std::shuffle(indices.begin(), indices.end(), rng);
      indices.resize(std::min(indices.size(), size_t(g.samples)));
      std::sort(indices.begin(), indices.end());
      for (size_t i : indices) {
        // The weighted outputs that depend on x[i].
        std::vector<std::pair<std::string, size_t>> deps;
        if (g.dependents) {
          deps = g.dependents(in, param, i);
        } else {
          for (const Output& o : w)
            for (size_t j = 0; j < o.values.size(); ++j) deps.emplace_back(o.name, j);
        }
        double rounding0 = 0;
        for (const auto& [name, j] : deps)
          rounding0 += std::fabs(find(w, name)[j]) * find(e0, name)[j];
        const double h = choose_step(rounding0, g.third_derivative(in, param, i, kMaxStep));
        const double m3 = g.third_derivative(in, param, i, h);
        const float x0 = x[i];
        x[i] = float(double(x0) + h);
        const Outputs yp = g.forward(backend, in);
        const Outputs ep = forward_errors(g, in, yp);
        x[i] = float(double(x0) - h);
        const Outputs ym = g.forward(backend, in);
        const Outputs em = forward_errors(g, in, ym);
        x[i] = x0;
        double fd = 0, rounding = 0, magnitude = 0;
        std::set<std::pair<std::string, size_t>> dep_set(deps.begin(), deps.end());
        for (const auto& [name, j] : deps) {
          const double wj = find(w, name)[j], p = find(yp, name)[j], m = find(ym, name)[j];
          fd += wj * (p - m);
          rounding += std::fabs(wj) * (find(ep, name)[j] + find(em, name)[j]);
          magnitude += std::fabs(wj) * (std::fabs(p) + std::fabs(m));
        }
        for (const Output& o : w) {
          const std::vector<double>& p = find(yp, o.name);
          const std::vector<double>& m = find(ym, o.name);
          for (size_t j = 0; j < o.values.size(); ++j) {
            if (o.values[j] != 0 && !(p[j] == m[j]) && dep_set.count({o.name, j}) == 0) {
              fail(r, o.name + "[" + std::to_string(j) + "] moved with " + param + "[" +
                          std::to_string(i) + "], which it is declared not to depend on");
            }
          }
        }
        fd /= 2 * h;
        const double bound = (rounding + gamma64(int64_t(deps.size()) + 2) * magnitude) / (2 * h) +
                             h * h / 6 * m3 + gb[i] + u * std::fabs(grad[i]) + 0x1p-149;
        record(cmp, i, grad[i], fd, bound);
      }
      report_margin(r, cmp);
      if (cmp.beyond > 0) fail(r, grad_name + " differs from the finite differences");
      r.comparisons.push_back(std::move(cmp));
    }
  } catch (const std::exception& e) {
    fail(r, std::string("threw: ") + e.what());
  }
  return r;
}

// ---- the table ----------------------------------------------------------------------------------

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = [] {
    std::vector<OpCase> all;
    cases::add_embedding(all);
    cases::add_layernorm(all);
    cases::add_rmsnorm(all);
    cases::add_linear(all);
    cases::add_linear_bf16(all);
    cases::add_attention(all);
    cases::add_rope(all);
    cases::add_activations(all);
    cases::add_cross_entropy(all);
    cases::add_vocab_parallel_ce(all);
    cases::add_optimizer(all);
    return all;
  }();
  return cases;
}

}  // namespace tessel::kernels::harness
