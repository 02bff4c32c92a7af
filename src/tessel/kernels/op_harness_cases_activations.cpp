// The op harness's gelu, swiglu and residual cases (op_harness_cases.h). Their bounds are those
// of the per-op tests, derived in testing/activation_bounds.cpp; the gradient mode's here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/activations.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/testing/activation_bounds.h"

namespace tessel::kernels::harness::cases {
namespace {

using testing::kGeluCube;
using testing::kGeluScale;

// A backward that adds its result into a pre-filled buffer p. The backend computes
// a = fl(p + z~), z~ its result before the last rounding (rounded, or the exact product an FMA
// fuses into the add), the reference r = fl(p + z_r). The bound D derived for the two results
// into zeros covers |z~ - z_r| (an FMA only skips a rounding D counts). So
//   |a - r| <= D + u |p + z~| + u |p + z_r| <= D (1 + u) + 2u (|p| + |z_r|),
// with |z_r| <= |r - p| + 2u |r| (r = (p + z_r)(1 + d), |d| <= u), plus 2^-149 for a product that
// underflows.
double accumulated(double D, double p, double r) {
  return D * (1 + u) + 2 * u * (std::fabs(p) + std::fabs(r - p) + 2 * u * std::fabs(r)) +
         kSubnormal;
}

// Bounds on the logistic function's derivatives over an interval whose smallest |y| is y_min:
// sigma' = sigma (1 - sigma) = e^-|y| / (1 + e^-|y|)^2 <= min(1/4, e^-|y|);
// sigma'' = sigma' (1 - 2 sigma), |1 - 2 sigma| <= 1, and its largest value is 1 / (6 sqrt 3);
// sigma''' = sigma' (1 - 6 sigma + 6 sigma^2), |.| <= 1 on [0, 1], largest value 1/8 (at y = 0).
struct SigmoidDerivatives {
  double d1, d2, d3;
  explicit SigmoidDerivatives(double y_min) {
    const double tail = std::exp(-y_min);
    d1 = std::min(0.25, tail);
    d2 = std::min(1 / (6 * std::sqrt(3.0)), tail);
    d3 = std::min(0.125, tail);
  }
};

// The least |y| over [lo, hi].
double least_magnitude(double lo, double hi) {
  return lo <= 0 && hi >= 0 ? 0.0 : std::min(std::fabs(lo), std::fabs(hi));
}

// gelu''' on [x - h, x + h]: gelu = x s(x), s = sigma(2 z(x)), z = a (x + b x^3) increasing, so
// gelu''' = 3 s'' + x s''' with s'' = sigma'' (2z')^2 + sigma' 2z'' and
// s''' = sigma''' (2z')^3 + 3 sigma'' (2z')(2z'') + sigma' 2z''', z' = a (1 + 3b x^2) <= a (1 + 3b
// X^2), |z''| = 6ab|x| <= 6ab X, z''' = 6ab (X = |x| + h), and sigma's derivatives at 2z bounded by
// SigmoidDerivatives over the interval's least |2z|.
double gelu_third_derivative(double x, double h) {
  auto two_z = [](double v) { return 2 * kGeluScale * (v + kGeluCube * v * v * v); };
  const SigmoidDerivatives sd(least_magnitude(two_z(x - h), two_z(x + h)));
  const double X = std::fabs(x) + h;
  const double z1 = 2 * kGeluScale * (1 + 3 * kGeluCube * X * X);  // 2 z'
  const double z2 = 2 * 6 * kGeluScale * kGeluCube * X;            // 2 |z''|
  const double z3 = 2 * 6 * kGeluScale * kGeluCube;                // 2 z'''
  const double s2 = sd.d2 * z1 * z1 + sd.d1 * z2;
  const double s3 = sd.d3 * z1 * z1 * z1 + 3 * sd.d2 * z1 * z2 + sd.d1 * z3;
  return 3 * s2 + X * s3;
}

// silu''' = (g sigma)''' = 3 sigma'' + g sigma''' on [g - h, g + h].
double silu_third_derivative(double g, double h) {
  const SigmoidDerivatives sd(least_magnitude(g - h, g + h));
  return 3 * sd.d2 + (std::fabs(g) + h) * sd.d3;
}

enum class Act { gelu, swiglu, residual };

struct ActCfg {
  Act act;
  int64_t n;
  bool grad;
};

Tensors activation_case_inputs(const ActCfg& a, uint64_t seed) {
  const size_t n = size_t(a.n);
  Tensors in;
  in.set("dout", normal(n, seed + 3));
  if (a.act == Act::gelu) {
    in.set("inp", testing::activation_inputs(a.n, seed));
    in.set("dinp", normal(n, seed + 4));
  } else if (a.act == Act::swiglu) {
    in.set("gate", testing::activation_inputs(a.n, seed));
    in.set("up", normal(n, seed + 1));
    in.set("dgate", normal(n, seed + 4));
    in.set("dup", normal(n, seed + 5));
  } else {
    in.set("a", normal(n, seed));
    in.set("b", normal(n, seed + 1));
    in.set("da", normal(n, seed + 4));
    in.set("db", normal(n, seed + 5));
  }
  return in;
}

Outputs activation_fwd(Backend& b, const Tensors& in, const ActCfg& a) {
  FBuf out(b, nans(size_t(a.n)));
  if (a.act == Act::gelu) {
    FBuf inp(b, in.f("inp"));
    b.gelu_forward(out.get(), inp.get(), a.n);
  } else if (a.act == Act::swiglu) {
    FBuf gate(b, in.f("gate")), up(b, in.f("up"));
    b.swiglu_forward(out.get(), gate.get(), up.get(), a.n);
  } else {
    FBuf x(b, in.f("a")), y(b, in.f("b"));
    b.residual_forward(out.get(), x.get(), y.get(), a.n);
  }
  return {out_of("out", out.host())};
}

Outputs activation_bwd(Backend& b, const Tensors& in, const ActCfg& a) {
  FBuf dout(b, in.f("dout"));
  if (a.act == Act::gelu) {
    FBuf inp(b, in.f("inp")), dinp(b, in.f("dinp"));
    b.gelu_backward(dinp.get(), inp.get(), dout.get(), a.n);
    return {out_of("dinp", dinp.host())};
  }
  if (a.act == Act::swiglu) {
    FBuf gate(b, in.f("gate")), up(b, in.f("up")), dgate(b, in.f("dgate")), dup(b, in.f("dup"));
    b.swiglu_backward(dgate.get(), dup.get(), dout.get(), gate.get(), up.get(), a.n);
    return {out_of("dgate", dgate.host()), out_of("dup", dup.host())};
  }
  FBuf da(b, in.f("da")), db(b, in.f("db"));
  b.residual_backward(da.get(), db.get(), dout.get(), a.n);
  return {out_of("da", da.host()), out_of("db", db.host())};
}

// Residual: out = a + b and da += dout, db += dout are one float add each: the same bits on every
// backend (bound 0). gelu and swiglu: testing/activation_bounds.h; backward adds into the
// pre-filled buffers (accumulated()).
Outputs activation_fwd_bounds(const Tensors& in, const Outputs&, const ActCfg& a) {
  const size_t n = size_t(a.n);
  Output out{"out", std::vector<double>(n, 0.0)};
  if (a.act == Act::gelu) {
    for (size_t i = 0; i < n; ++i) out.values[i] = testing::gelu_out_bound(in.f("inp")[i]);
  } else if (a.act == Act::swiglu) {
    for (size_t i = 0; i < n; ++i)
      out.values[i] = testing::swiglu_bounds(in.f("gate")[i], in.f("up")[i], 0.0f).out;
  }
  return {out};
}

Outputs activation_bwd_bounds(const Tensors& in, const Outputs& ref, const ActCfg& a) {
  const size_t n = size_t(a.n);
  const auto& dout = in.f("dout");
  if (a.act == Act::gelu) {
    Output dinp{"dinp", std::vector<double>(n)};
    const auto& r = find(ref, "dinp");
    for (size_t i = 0; i < n; ++i) {
      dinp.values[i] =
          accumulated(testing::gelu_dinp_bound(in.f("inp")[i], dout[i]), in.f("dinp")[i], r[i]);
    }
    return {dinp};
  }
  if (a.act == Act::swiglu) {
    Output dgate{"dgate", std::vector<double>(n)}, dup{"dup", std::vector<double>(n)};
    const auto& rg = find(ref, "dgate");
    const auto& ru = find(ref, "dup");
    for (size_t i = 0; i < n; ++i) {
      const testing::SwigluBounds b =
          testing::swiglu_bounds(in.f("gate")[i], in.f("up")[i], dout[i]);
      dgate.values[i] = accumulated(b.dgate, in.f("dgate")[i], rg[i]);
      dup.values[i] = accumulated(b.dup, in.f("dup")[i], ru[i]);
    }
    return {dgate, dup};
  }
  return {zeros("da", n), zeros("db", n)};
}

}  // namespace

void add_activations(std::vector<OpCase>& out) {
  // Tiny, odd (vector tails), both saturated tails (n >= 1000), above the cpu kernels' parallel
  // threshold (32768), and n = 0.
  const int64_t sizes[] = {0, 1, 7, 33, 1000, 40001};
  std::vector<ActCfg> cfgs;
  for (Act act : {Act::gelu, Act::swiglu, Act::residual}) {
    for (int64_t n : sizes) cfgs.push_back({act, n, false});
    cfgs.push_back({act, 41, true});
  }
  for (const ActCfg& a : cfgs) {
    const Op op = a.act == Act::gelu ? Op::gelu : a.act == Act::swiglu ? Op::swiglu : Op::residual;
    Label label(op_name(op), "");
    label.dim("n", a.n);
    const PassFns fwd = pass_fns(a, activation_fwd, activation_fwd_bounds);
    std::optional<GradSpec> grad;
    if (a.grad) {
      Params params = {{"a", "da"}, {"b", "db"}};
      if (a.act == Act::gelu) params = {{"inp", "dinp"}};
      if (a.act == Act::swiglu) params = {{"gate", "dgate"}, {"up", "dup"}};
      // L = sum_i w_i f(x_i): d^3 L / dx_i^3 = w_i f'''(x_i); swiglu is linear in up and
      // residual in both.
      grad = gradient(
          fwd, params,
          [](Tensors& in) {
            zero(in, {"dinp", "dgate", "dup", "da", "db"});
          },
          [](const Tensors&, std::string_view, size_t i) {
            return Deps{{"out", i}};
          },
          [a](const Tensors& in, std::string_view param, size_t i, double h) {
            const double w = std::fabs(in.f("dout")[i]);
            if (a.act == Act::gelu) return w * gelu_third_derivative(in.f("inp")[i], h);
            if (a.act == Act::swiglu && param == "gate")
              return w * std::fabs(in.f("up")[i]) * silu_third_derivative(in.f("gate")[i], h);
            return 0.0;
          });
    }
    add_fwd_bwd(out, op, label, a.n == 0, inputs_of(a, activation_case_inputs), fwd,
                pass_fns(a, activation_bwd, activation_bwd_bounds), std::move(grad));
  }
}

}  // namespace tessel::kernels::harness::cases
