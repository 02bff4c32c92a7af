// The op harness (op_harness.h) on every registered backend but the reference, case by case; its
// gradient mode on the reference; and checks that it can fail: backends that get one op slightly
// wrong, drop a bias, overwrite instead of accumulating, or accept what the contract rejects are
// reported, and a backend that lacks an op is skipped for it.
#include "tessel/kernels/op_harness.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace tessel::kernels {
namespace {

using harness::CaseResult;
using harness::ForwardingBackend;
using harness::op_cases;
using harness::OpCase;
using harness::Outputs;
using harness::Status;
using ::testing::HasSubstr;

// Every registered backend but the oracle itself. gtest evaluates this when it registers the
// tests (in InitGoogleTest), after static initialisation, so a backend registered at start-up
// ("cuda") is covered without another test.
std::vector<std::string> backends_under_test() {
  std::vector<std::string> names = backend_names();
  std::erase(names, std::string("reference"));
  return names;
}

std::string identifier(std::string s) {
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

const OpCase& case_named(const std::string& name) {
  for (const OpCase& c : op_cases())
    if (c.name == name) return c;
  throw std::out_of_range("no case " + name);
}

// ---- every backend x every case -----------------------------------------------------------------

class OpHarness : public ::testing::TestWithParam<std::tuple<std::string, size_t>> {};

TEST_P(OpHarness, MatchesReference) {
  const auto& [name, index] = GetParam();
  const OpCase& c = op_cases()[index];
  auto backend = make_backend(name);
  auto reference = make_backend("reference");
  const CaseResult r = harness::run_case(c, *backend, *reference);
  if (r.status == Status::skipped) GTEST_SKIP() << r.message;
  EXPECT_TRUE(r.passed()) << c.shape << "\n" << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Backends, OpHarness,
                         ::testing::Combine(::testing::ValuesIn(backends_under_test()),
                                            ::testing::Range<size_t>(0, op_cases().size())),
                         [](const auto& info) {
                           return identifier(std::get<0>(info.param)) + "_" +
                                  op_cases()[std::get<1>(info.param)].name;
                         });

// ---- gradient mode ------------------------------------------------------------------------------

std::vector<size_t> gradient_cases() {
  std::vector<size_t> idx;
  for (size_t i = 0; i < op_cases().size(); ++i)
    if (op_cases()[i].grad) idx.push_back(i);
  return idx;
}

class OpHarnessGradients : public ::testing::TestWithParam<size_t> {};

TEST_P(OpHarnessGradients, ReferenceBackwardMatchesFiniteDifferences) {
  const OpCase& c = op_cases()[GetParam()];
  auto reference = make_backend("reference");
  const CaseResult r = harness::check_gradients(c, *reference);
  EXPECT_TRUE(r.passed()) << c.shape << "\n" << r.summary();
  EXPECT_FALSE(r.comparisons.empty());
}

INSTANTIATE_TEST_SUITE_P(Reference, OpHarnessGradients, ::testing::ValuesIn(gradient_cases()),
                         [](const auto& info) { return op_cases()[info.param].name; });

// ---- the table ----------------------------------------------------------------------------------

constexpr Op kAllOps[] = {
    Op::embedding, Op::layernorm, Op::rmsnorm,  Op::linear,        Op::attention,         Op::rope,
    Op::gelu,      Op::swiglu,    Op::residual, Op::cross_entropy, Op::vocab_parallel_ce, Op::adamw,
    Op::grad_norm};

bool has_backward(Op op) {
  return op != Op::adamw && op != Op::grad_norm;
}

TEST(OpHarnessTable, CoversEveryOpForwardBackwardEmptyAndGradients) {
  std::set<std::string> names;
  for (const OpCase& c : op_cases()) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate case " << c.name;
    EXPECT_EQ(identifier(c.name), c.name) << "not a test name";
    EXPECT_EQ(c.bounds == nullptr, c.expect_invalid_argument) << c.name;
  }
  for (Op op : kAllOps) {
    SCOPED_TRACE(std::string(op_name(op)));
    auto count = [&](auto pred) {
      return std::count_if(op_cases().begin(), op_cases().end(),
                           [&](const OpCase& c) { return c.op == op && pred(c); });
    };
    EXPECT_GE(count([](const OpCase& c) { return c.pass == harness::Pass::forward; }), 1);
    EXPECT_GE(count([](const OpCase& c) { return c.empty && !c.expect_invalid_argument; }), 1);
    if (has_backward(op)) {
      EXPECT_GE(count([](const OpCase& c) { return c.pass == harness::Pass::backward; }), 1);
      EXPECT_GE(count([](const OpCase& c) { return c.grad.has_value(); }), 1);
    }
  }
}

// Runs every case's ops on "cpu" and records which Backend ops were called: every op of the
// interface must be.
class RecordingBackend final : public ForwardingBackend {
 public:
  RecordingBackend() : ForwardingBackend(make_backend("cpu")) {}
  std::set<std::string> called;

  void embedding_forward(float* o, const int32_t* t, const float* wte, const float* wpe, int B,
                         int T, int C, int vs, int vr) override {
    called.insert("embedding_forward");
    ForwardingBackend::embedding_forward(o, t, wte, wpe, B, T, C, vs, vr);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* d, const int32_t* t, int B, int T,
                          int C, int vs, int vr) override {
    called.insert("embedding_backward");
    ForwardingBackend::embedding_backward(dwte, dwpe, d, t, B, T, C, vs, vr);
  }
  void layernorm_forward(float* o, float* m, float* r, const float* x, const float* w,
                         const float* b, int N, int C, float eps) override {
    called.insert("layernorm_forward");
    ForwardingBackend::layernorm_forward(o, m, r, x, w, b, N, C, eps);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* d, const float* x,
                          const float* w, const float* m, const float* r, int N, int C) override {
    called.insert("layernorm_backward");
    ForwardingBackend::layernorm_backward(dx, dw, db, d, x, w, m, r, N, C);
  }
  void rmsnorm_forward(float* o, float* r, const float* x, const float* w, int N, int C,
                       float eps) override {
    called.insert("rmsnorm_forward");
    ForwardingBackend::rmsnorm_forward(o, r, x, w, N, C, eps);
  }
  void rmsnorm_backward(float* dx, float* dw, const float* d, const float* x, const float* w,
                        const float* r, int N, int C) override {
    called.insert("rmsnorm_backward");
    ForwardingBackend::rmsnorm_backward(dx, dw, d, x, w, r, N, C);
  }
  void linear_forward(float* o, const float* x, const float* w, const float* b, int N, int IC,
                      int OC) override {
    called.insert("linear_forward");
    ForwardingBackend::linear_forward(o, x, w, b, N, IC, OC);
  }
  void linear_backward_input(float* dx, const float* d, const float* w, int N, int IC,
                             int OC) override {
    called.insert("linear_backward_input");
    ForwardingBackend::linear_backward_input(dx, d, w, N, IC, OC);
  }
  void linear_backward_weight(float* dw, float* db, const float* d, const float* x, int N, int IC,
                              int OC) override {
    called.insert("linear_backward_weight");
    ForwardingBackend::linear_backward_weight(dw, db, d, x, N, IC, OC);
  }
  void attention_forward(float* o, float* p, const float* q, const float* k, const float* v, int B,
                         int T, int Hq, int Hkv, int D, int64_t qs, int64_t kvs) override {
    called.insert("attention_forward");
    ForwardingBackend::attention_forward(o, p, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* d, const float* p,
                          const float* q, const float* k, const float* v, int B, int T, int Hq,
                          int Hkv, int D, int64_t qs, int64_t kvs) override {
    called.insert("attention_backward");
    ForwardingBackend::attention_backward(dq, dk, dv, d, p, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
  }
  void rope_forward(float* x, int B, int T, int H, int D, int64_t s, float th) override {
    called.insert("rope_forward");
    ForwardingBackend::rope_forward(x, B, T, H, D, s, th);
  }
  void rope_backward(float* x, int B, int T, int H, int D, int64_t s, float th) override {
    called.insert("rope_backward");
    ForwardingBackend::rope_backward(x, B, T, H, D, s, th);
  }
  void gelu_forward(float* o, const float* x, int64_t n) override {
    called.insert("gelu_forward");
    ForwardingBackend::gelu_forward(o, x, n);
  }
  void gelu_backward(float* dx, const float* x, const float* d, int64_t n) override {
    called.insert("gelu_backward");
    ForwardingBackend::gelu_backward(dx, x, d, n);
  }
  void swiglu_forward(float* o, const float* g, const float* u, int64_t n) override {
    called.insert("swiglu_forward");
    ForwardingBackend::swiglu_forward(o, g, u, n);
  }
  void swiglu_backward(float* dg, float* du, const float* d, const float* g, const float* u,
                       int64_t n) override {
    called.insert("swiglu_backward");
    ForwardingBackend::swiglu_backward(dg, du, d, g, u, n);
  }
  void residual_forward(float* o, const float* a, const float* b, int64_t n) override {
    called.insert("residual_forward");
    ForwardingBackend::residual_forward(o, a, b, n);
  }
  void residual_backward(float* da, float* db, const float* d, int64_t n) override {
    called.insert("residual_backward");
    ForwardingBackend::residual_backward(da, db, d, n);
  }
  CrossEntropyResult cross_entropy(float* dl, float* l, const float* x, const int32_t* t, int N,
                                   int V, int Vp, int ig, float gs) override {
    called.insert("cross_entropy");
    return ForwardingBackend::cross_entropy(dl, l, x, t, N, V, Vp, ig, gs);
  }
  void vp_ce_local_max(float* m, const float* x, const int32_t* t, int N, int V, int vs, int rows,
                       int ig) override {
    called.insert("vp_ce_local_max");
    ForwardingBackend::vp_ce_local_max(m, x, t, N, V, vs, rows, ig);
  }
  void vp_ce_local_sums(float* s, const float* x, const float* m, const int32_t* t, int N, int V,
                        int vs, int rows, int ig) override {
    called.insert("vp_ce_local_sums");
    ForwardingBackend::vp_ce_local_sums(s, x, m, t, N, V, vs, rows, ig);
  }
  CrossEntropyResult vp_ce_finish(float* dl, float* l, const float* x, const float* m,
                                  const float* s, const int32_t* t, int N, int V, int vs, int rows,
                                  int ig, float gs) override {
    called.insert("vp_ce_finish");
    return ForwardingBackend::vp_ce_finish(dl, l, x, m, s, t, N, V, vs, rows, ig, gs);
  }
  void adamw_update(float* p, float* g, float* m, float* v, int64_t n,
                    const AdamWConfig& cfg) override {
    called.insert("adamw_update");
    ForwardingBackend::adamw_update(p, g, m, v, n, cfg);
  }
  double sum_of_squares(const float* x, int64_t n) override {
    called.insert("sum_of_squares");
    return ForwardingBackend::sum_of_squares(x, n);
  }
  void scale(float* x, int64_t n, float f) override {
    called.insert("scale");
    ForwardingBackend::scale(x, n, f);
  }
};

TEST(OpHarnessTable, CasesCallEveryOpOfTheBackendInterface) {
  RecordingBackend backend;
  for (const OpCase& c : op_cases()) {
    if (c.expect_invalid_argument) continue;
    const harness::Tensors in = c.make_inputs(harness::kDefaultSeed);
    c.run(backend, in);
  }
  const std::set<std::string> all = {"embedding_forward",      "embedding_backward",
                                     "layernorm_forward",      "layernorm_backward",
                                     "rmsnorm_forward",        "rmsnorm_backward",
                                     "linear_forward",         "linear_backward_input",
                                     "linear_backward_weight", "attention_forward",
                                     "attention_backward",     "rope_forward",
                                     "rope_backward",          "gelu_forward",
                                     "gelu_backward",          "swiglu_forward",
                                     "swiglu_backward",        "residual_forward",
                                     "residual_backward",      "cross_entropy",
                                     "vp_ce_local_max",        "vp_ce_local_sums",
                                     "vp_ce_finish",           "adamw_update",
                                     "sum_of_squares",         "scale"};
  EXPECT_EQ(backend.called, all);
}

// ---- skipping -----------------------------------------------------------------------------------

// "cpu" without rope: the harness must skip rope's cases, naming the op, and never call it.
class CpuWithoutRope final : public ForwardingBackend {
 public:
  CpuWithoutRope() : ForwardingBackend(make_backend("cpu")) {}
  std::string_view name() const override { return "cpu-without-rope"; }
  bool supports(Op op) const override { return op != Op::rope && ForwardingBackend::supports(op); }
  void rope_forward(float*, int, int, int, int, int64_t, float) override {
    ADD_FAILURE() << "rope_forward called on a backend that does not support rope";
  }
  void rope_backward(float*, int, int, int, int, int64_t, float) override {
    ADD_FAILURE() << "rope_backward called on a backend that does not support rope";
  }
};

TEST(OpHarness, SkipsTheCasesOfAnOpTheBackendLacks) {
  CpuWithoutRope backend;
  auto reference = make_backend("reference");
  int skipped = 0;
  for (const OpCase& c : op_cases()) {
    if (c.op != Op::rope) continue;
    const CaseResult r = harness::run_case(c, backend, *reference);
    EXPECT_EQ(r.status, Status::skipped) << c.name;
    EXPECT_THAT(r.message, HasSubstr("does not support op 'rope'")) << c.name;
    EXPECT_TRUE(r.comparisons.empty());
    ++skipped;
    if (c.grad) {
      EXPECT_EQ(harness::check_gradients(c, backend).status, Status::skipped) << c.name;
    }
  }
  EXPECT_GE(skipped, 2);
  // The backend's other ops still run and pass.
  const CaseResult r = harness::run_case(case_named("gelu_fwd_n33"), backend, *reference);
  EXPECT_TRUE(r.passed()) << r.summary();
  EXPECT_EQ(r.comparisons.size(), 1u);
}

// ---- mutations: the harness reports a wrong backend ---------------------------------------------

// Reads or writes one float of a backend's memory.
float read(Backend& b, const float* p) {
  float x;
  b.copy_to_host(&x, p, sizeof x);
  return x;
}

void write(Backend& b, float* p, float x) {
  b.copy_from_host(p, &x, sizeof x);
}

class CpuDroppingLinearBias final : public ForwardingBackend {
 public:
  CpuDroppingLinearBias() : ForwardingBackend(make_backend("cpu")) {}
  void linear_forward(float* out, const float* inp, const float* w, const float*, int N, int IC,
                      int OC) override {
    ForwardingBackend::linear_forward(out, inp, w, nullptr, N, IC, OC);
  }
};

TEST(OpHarnessMutations, ADroppedLinearBiasIsReported) {
  CpuDroppingLinearBias backend;
  auto reference = make_backend("reference");
  int failed = 0;
  for (const OpCase& c : op_cases()) {
    if (c.op != Op::linear || c.name.find("linear_fwd") != 0) continue;
    const CaseResult r = harness::run_case(c, backend, *reference);
    const bool biased = c.name.find("_nobias") == std::string::npos;
    if (biased && !c.empty) {
      EXPECT_EQ(r.status, Status::failed) << r.summary();
      EXPECT_THAT(r.message, HasSubstr("'out' beyond its bound"));
      ++failed;
    } else {
      EXPECT_TRUE(r.passed()) << r.summary();  // nothing to drop
    }
  }
  EXPECT_GE(failed, 4);
}

// Residual is one float add: every backend gets the same bits, and one ulp off is an error.
class CpuResidualOneUlpOff final : public ForwardingBackend {
 public:
  CpuResidualOneUlpOff() : ForwardingBackend(make_backend("cpu")) {}
  void residual_forward(float* out, const float* a, const float* b, int64_t n) override {
    ForwardingBackend::residual_forward(out, a, b, n);
    if (n > 0) write(*this, out + n - 1, std::nextafter(read(*this, out + n - 1), INFINITY));
  }
};

TEST(OpHarnessMutations, OneUlpOffAnExactOpIsReported) {
  CpuResidualOneUlpOff backend;
  auto reference = make_backend("reference");
  int failed = 0;
  for (const OpCase& c : op_cases()) {
    if (c.op != Op::residual || c.pass != harness::Pass::forward) continue;
    const CaseResult r = harness::run_case(c, backend, *reference);
    if (c.empty) {
      EXPECT_TRUE(r.passed()) << r.summary();
      continue;
    }
    ++failed;
    ASSERT_EQ(r.status, Status::failed) << r.summary();
    ASSERT_EQ(r.comparisons.size(), 1u);
    const harness::Comparison& out = r.comparisons[0];
    EXPECT_EQ(out.beyond, 1u);
    EXPECT_EQ(out.worst_index, out.count - 1);
    EXPECT_EQ(out.bound, 0.0);
    EXPECT_EQ(float(out.actual), std::nextafter(float(out.expected), INFINITY));
  }
  EXPECT_GE(failed, 4);
}

// Sets one element of linear_forward's output to a given value: the test puts it a few ulps past
// the harness's bound for that element (failure), or inside it (pass).
class CpuLinearWithOneValue final : public ForwardingBackend {
 public:
  CpuLinearWithOneValue() : ForwardingBackend(make_backend("cpu")) {}
  size_t index = 0;
  float value = 0;
  void linear_forward(float* out, const float* inp, const float* w, const float* b, int N, int IC,
                      int OC) override {
    ForwardingBackend::linear_forward(out, inp, w, b, N, IC, OC);
    write(*this, out + index, value);
  }
};

TEST(OpHarnessMutations, AnErrorFourUlpsBeyondTheBoundIsReported) {
  const OpCase& c = case_named("linear_fwd_N7_IC129_OC3_bias");
  const harness::Tensors in = c.make_inputs(harness::kDefaultSeed);
  auto reference = make_backend("reference");
  const Outputs expected = c.run(*reference, in);
  const Outputs bounds = c.bounds(in, expected);
  CpuLinearWithOneValue backend;
  for (size_t index : {size_t(0), size_t(10)}) {
    const float r = float(harness::find(expected, "out")[index]);
    const double bound = harness::find(bounds, "out")[index];
    ASSERT_GT(bound, 0.0);
    for (double direction : {1.0, -1.0}) {
      // The first float past r + direction * bound, then three more ulps.
      const float away = direction > 0 ? INFINITY : -INFINITY;
      float beyond = float(double(r) + direction * bound);
      while (std::fabs(double(beyond) - r) <= bound) beyond = std::nextafter(beyond, away);
      for (int k = 0; k < 3; ++k) beyond = std::nextafter(beyond, away);
      backend.index = index;
      backend.value = beyond;
      const CaseResult bad = harness::run_case(c, backend, *reference);
      EXPECT_EQ(bad.status, Status::failed) << bad.summary();
      ASSERT_EQ(bad.comparisons.size(), 1u);
      EXPECT_EQ(bad.comparisons[0].worst_index, index);
      EXPECT_GT(bad.comparisons[0].worst_ratio, 1.0);
      EXPECT_LT(bad.comparisons[0].worst_ratio, 1.01) << "four ulps past a bound of many ulps";
      // Inside the bound (half way) the same backend passes.
      backend.value = float(double(r) + direction * bound / 2);
      const CaseResult good = harness::run_case(c, backend, *reference);
      EXPECT_TRUE(good.passed()) << good.summary();
    }
  }
}

// A backward that overwrites its gradients instead of adding into them.
class CpuOverwritingRmsnormGradients final : public ForwardingBackend {
 public:
  CpuOverwritingRmsnormGradients() : ForwardingBackend(make_backend("cpu")) {}
  void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                        const float* rstd, int N, int C) override {
    memset_zero(dinp, size_t(N) * C * sizeof(float));
    memset_zero(dw, size_t(C) * sizeof(float));
    ForwardingBackend::rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C);
  }
};

TEST(OpHarnessMutations, ABackwardThatOverwritesIsReported) {
  CpuOverwritingRmsnormGradients backend;
  auto reference = make_backend("reference");
  int failed = 0;
  for (const OpCase& c : op_cases()) {
    if (c.op != Op::rmsnorm || c.pass != harness::Pass::backward) continue;
    const CaseResult r = harness::run_case(c, backend, *reference);
    // With N = 0 dweight keeps its values in the reference, and is zeroed here: also an error.
    EXPECT_EQ(r.status, Status::failed) << r.summary();
    ++failed;
  }
  EXPECT_GE(failed, 4);
}

// A backend that throws, and one that accepts heads the contract rejects.
class CpuThrowingInScale final : public ForwardingBackend {
 public:
  CpuThrowingInScale() : ForwardingBackend(make_backend("cpu")) {}
  void scale(float*, int64_t, float) override { throw std::runtime_error("device lost"); }
};

class CpuAcceptingBadHeads final : public ForwardingBackend {
 public:
  CpuAcceptingBadHeads() : ForwardingBackend(make_backend("cpu")) {}
  void attention_forward(float* o, float* p, const float* q, const float* k, const float* v, int B,
                         int T, int Hq, int Hkv, int D, int64_t qs, int64_t kvs) override {
    if (Hkv <= 0 || Hq % Hkv != 0) return;
    ForwardingBackend::attention_forward(o, p, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
  }
};

TEST(OpHarnessMutations, AThrowingBackendAndABrokenContractAreReported) {
  auto reference = make_backend("reference");
  CpuThrowingInScale throwing;
  const CaseResult thrown = harness::run_case(case_named("scale_fwd_n7"), throwing, *reference);
  EXPECT_EQ(thrown.status, Status::failed);
  EXPECT_THAT(thrown.message, HasSubstr("device lost"));

  CpuAcceptingBadHeads lax;
  const CaseResult lax_result =
      harness::run_case(case_named("attention_fwd_rejects_Hq3_Hkv2"), lax, *reference);
  EXPECT_EQ(lax_result.status, Status::failed);
  EXPECT_THAT(lax_result.message, HasSubstr("accepted arguments the op's contract rejects"));
  auto cpu = make_backend("cpu");
  EXPECT_TRUE(
      harness::run_case(case_named("attention_fwd_rejects_Hq3_Hkv2"), *cpu, *reference).passed());
}

// ---- mutations: the gradient mode reports a wrong backward --------------------------------------

// The reference with gelu's gradient off by a relative 2^-10 (0.1%).
class ReferenceWithScaledGeluGradient final : public ForwardingBackend {
 public:
  ReferenceWithScaledGeluGradient() : ForwardingBackend(make_backend("reference")) {}
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    ForwardingBackend::gelu_backward(dinp, inp, dout, n);
    for (int64_t i = 0; i < n; ++i) write(*this, dinp + i, read(*this, dinp + i) * (1 + 0x1p-10f));
  }
};

// The reference without the bias gradient.
class ReferenceDroppingDbias final : public ForwardingBackend {
 public:
  ReferenceDroppingDbias() : ForwardingBackend(make_backend("reference")) {}
  void linear_backward_weight(float* dw, float*, const float* dout, const float* inp, int N, int IC,
                              int OC) override {
    ForwardingBackend::linear_backward_weight(dw, nullptr, dout, inp, N, IC, OC);
  }
};

TEST(OpHarnessMutations, TheGradientModeReportsAWrongBackward) {
  ReferenceWithScaledGeluGradient gelu;
  const CaseResult g = harness::check_gradients(case_named("gelu_bwd_n41"), gelu);
  EXPECT_EQ(g.status, Status::failed) << g.summary();

  ReferenceDroppingDbias linear;
  const CaseResult l =
      harness::check_gradients(case_named("linear_bwd_weight_N3_IC5_OC4_bias"), linear);
  EXPECT_EQ(l.status, Status::failed) << l.summary();
  ASSERT_EQ(l.comparisons.size(), 2u);
  EXPECT_EQ(l.comparisons[0].beyond, 0u) << "dweight is right";
  EXPECT_GT(l.comparisons[1].beyond, 0u) << "dbias is missing";
}

}  // namespace
}  // namespace tessel::kernels
