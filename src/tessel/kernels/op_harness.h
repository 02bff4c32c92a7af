// The op-by-op comparison harness (in the manner of ggml's test-backend-ops): a table of op
// cases, each run on a backend under test and on the "reference" backend through the Backend
// interface only (device memory from allocate(), copy_from_host / copy_to_host), with every
// output compared element by element against a bound derived from the arithmetic. A backend
// registered later (CUDA) is covered by op_harness_test.cpp without writing a test.
//
// Test-only code: it is compiled into tessel_kernels_tests, not into the tessel_kernels library
// (CMakeLists.txt: TEST_SUPPORT), because its bounds are built from the test helpers in
// tessel/testing (rounding.h, kernel_bounds.h, norm_bounds.h, attention_bounds.h,
// activation_bounds.h, adam_divergence.h), which link GoogleTest and must stay out of library
// code, and because nothing but tests runs it: a new backend registers itself with
// register_backend() in the same binary and the parameterised test picks it up.
//
// Bounds. Each case's bound function gives, per output element, a bound on
// |backend - reference| for a backend that computes the op in float32 with the operations of
// the cpu:: kernels (kernels/README.md, the op headers), in any order, blocking, SIMD lane split
// or FMA contraction, with exp within testing::kFastExpError; plus the reference's own error
// against the exact value. The derivations (beside each bound: in the op family's
// op_harness_cases_<family>.cpp, or in tessel/testing where a per-op test shares the bound) follow
// testing/rounding.h and testing/kernel_bounds.h; none is fitted to a measurement. As in the
// per-op tests, the double arithmetic that evaluates a bound is taken as exact.
//
// Gradient mode (check_gradients): for a backward case, the reference backward against central
// finite differences of the reference forward, with a derived bound on the difference
// (truncation and rounding; see op_harness.cpp).
//
// Skips: a case whose op the backend does not support (Backend::supports) is reported as
// skipped, naming the op, not failed.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/backend.h"

namespace tessel::kernels::harness {

// A case's inputs: named host arrays. A backward case's gradient buffers are inputs too (their
// initial contents: backward accumulates), named like the outputs they become.
struct Tensors {
  std::vector<std::pair<std::string, std::vector<float>>> floats;
  std::vector<std::pair<std::string, std::vector<int32_t>>> ints;

  // Adds or replaces.
  void set(std::string name, std::vector<float> values);
  void set_ints(std::string name, std::vector<int32_t> values);
  bool has(std::string_view name) const;
  // Throw std::out_of_range for an unknown name.
  std::vector<float>& f(std::string_view name);
  const std::vector<float>& f(std::string_view name) const;
  const std::vector<int32_t>& i(std::string_view name) const;
};

// A run's results copied to the host, in double (float tensors convert exactly; loss sums and
// sums of squares are double). Bounds use the same type: the same names and sizes.
struct Output {
  std::string name;
  std::vector<double> values;
};
using Outputs = std::vector<Output>;
// Throws std::out_of_range for an unknown name.
const std::vector<double>& find(const Outputs& outputs, std::string_view name);

enum class Pass { forward, backward };
std::string_view pass_name(Pass pass);

// Gradient mode of a backward case: the loss L = sum_j w_j y_j over the forward's outputs y.
struct GradSpec {
  // The forward on the case's inputs (which include the forward's), and per-element bounds on
  // |y - reference| (the forward case's bound function: each of them also bounds the reference's
  // own error, see check_gradients).
  std::function<Outputs(Backend&, const Tensors&)> forward;
  std::function<Outputs(const Tensors&, const Outputs& y)> forward_bounds;
  // The weights w, named like the forward outputs they multiply (outputs not named are not in
  // the loss); usually the case's upstream gradient dout.
  std::function<Outputs(const Tensors&)> weights;
  // (input perturbed, backward output holding its gradient).
  std::vector<std::pair<std::string, std::string>> params;
  // After the parameters moved to the finite-difference grid: recompute the inputs that depend
  // on them (saved statistics, softmax probabilities) and zero the accumulated gradient buffers.
  std::function<void(Tensors&)> derive;
  // The weighted forward outputs (name, element) whose exact value depends on element `index` of
  // input `param` (a superset is allowed); every other output must not move when it moves.
  // Unset: every weighted output.
  std::function<std::vector<std::pair<std::string, size_t>>(const Tensors&, std::string_view param,
                                                            size_t index)>
      dependents;
  // A bound on |d^3 L / dx^3| over [x - h, x + h] along element `index` of input `param`.
  std::function<double(const Tensors&, std::string_view param, size_t index, double h)>
      third_derivative;
  int samples = 24;  // elements checked per parameter (all when fewer)
};

struct OpCase {
  Op op;
  Pass pass;
  std::string name;   // unique; letters, digits and '_' (a test name)
  std::string shape;  // the dimensions, for messages
  std::function<Tensors(uint64_t seed)> make_inputs;
  std::function<Outputs(Backend&, const Tensors&)> run;
  // Per-element bounds on |backend - reference| from the inputs and the reference's outputs.
  std::function<Outputs(const Tensors&, const Outputs& reference)> bounds;
  // A contract case: run must throw InvalidArgumentError on every backend (nothing compared).
  bool expect_invalid_argument = false;
  bool empty = false;  // a shape with no elements (N = 0, n = 0, ...)
  std::optional<GradSpec> grad;
};

// Every case, built once.
const std::vector<OpCase>& op_cases();

inline constexpr uint64_t kDefaultSeed = 1;

// One compared output (or, in gradient mode, one parameter's gradient).
struct Comparison {
  std::string output;
  size_t count = 0;
  size_t beyond = 0;       // elements whose |diff| exceeds their bound
  double worst_ratio = 0;  // max |diff| / bound (0: all equal; inf: NaN, or diff with bound 0)
  size_t worst_index = 0;
  double actual = 0, expected = 0, bound = 0;  // at the worst element
};

enum class Status { passed, failed, skipped };

struct CaseResult {
  std::string case_name;
  std::string backend;
  Status status = Status::passed;
  std::string message;  // why it was skipped or failed
  std::vector<Comparison> comparisons;

  bool passed() const { return status == Status::passed; }
  // max over the comparisons of max |diff| / bound: the normalised-error summary.
  double worst_ratio() const;
  std::string summary() const;  // one line per comparison
};

// Runs the case on `backend` and on `reference` and compares every output. Skipped when either
// lacks the op. With TESSEL_REPORT_MARGINS=1 prints every comparison's worst |diff| / bound to
// stderr, like testing::within_bounds.
CaseResult run_case(const OpCase& c, Backend& backend, Backend& reference,
                    uint64_t seed = kDefaultSeed);

// Gradient mode: `backend`'s backward against central finite differences of its forward (the
// tests pass the reference backend). Failed when the case has no GradSpec.
CaseResult check_gradients(const OpCase& c, Backend& backend, uint64_t seed = kDefaultSeed);

// Forwards every call to another backend; tests override one op to make a backend that lacks it
// or gets it wrong.
class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  Backend& inner() { return *inner_; }

  std::string_view name() const override { return inner_->name(); }
  DeviceKind device() const override { return inner_->device(); }
  bool supports(Op op) const override { return inner_->supports(op); }
  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void deallocate(void* p) override { inner_->deallocate(p); }
  void copy_from_host(void* d, const void* s, size_t n) override {
    inner_->copy_from_host(d, s, n);
  }
  void copy_to_host(void* d, const void* s, size_t n) override { inner_->copy_to_host(d, s, n); }
  void memset_zero(void* d, size_t n) override { inner_->memset_zero(d, n); }
  Stream& stream() override { return inner_->stream(); }
  void synchronize() override { inner_->synchronize(); }

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C, int vs, int vr) override {
    inner_->embedding_forward(out, tokens, wte, wpe, B, T, C, vs, vr);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C, int vs, int vr) override {
    inner_->embedding_backward(dwte, dwpe, dout, tokens, B, T, C, vs, vr);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                         const float* b, int N, int C, float eps) override {
    inner_->layernorm_forward(out, mean, rstd, inp, w, b, N, C, eps);
  }
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                          const float* w, const float* mean, const float* rstd, int N,
                          int C) override {
    inner_->layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int N, int C,
                       float eps) override {
    inner_->rmsnorm_forward(out, rstd, inp, w, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                        const float* rstd, int N, int C) override {
    inner_->rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C);
  }
  void linear_forward(float* out, const float* inp, const float* w, const float* b, int N, int IC,
                      int OC) override {
    inner_->linear_forward(out, inp, w, b, N, IC, OC);
  }
  void linear_backward_input(float* dinp, const float* dout, const float* w, int N, int IC,
                             int OC) override {
    inner_->linear_backward_input(dinp, dout, w, N, IC, OC);
  }
  void linear_backward_weight(float* dw, float* db, const float* dout, const float* inp, int N,
                              int IC, int OC) override {
    inner_->linear_backward_weight(dw, db, dout, inp, N, IC, OC);
  }
  void to_bf16(bf16* dst, const float* src, int64_t n) override { inner_->to_bf16(dst, src, n); }
  void linear_forward_bf16(float* out, const float* inp, const bf16* w, const float* b, int N,
                           int IC, int OC) override {
    inner_->linear_forward_bf16(out, inp, w, b, N, IC, OC);
  }
  void linear_backward_input_bf16(float* dinp, const float* dout, const bf16* w, int N, int IC,
                                  int OC) override {
    inner_->linear_backward_input_bf16(dinp, dout, w, N, IC, OC);
  }
  void linear_backward_weight_bf16(float* dw, float* db, const float* dout, const float* inp, int N,
                                   int IC, int OC) override {
    inner_->linear_backward_weight_bf16(dw, db, dout, inp, N, IC, OC);
  }
  void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                         int B, int T, int Hq, int Hkv, int D, int64_t qs, int64_t kvs) override {
    inner_->attention_forward(out, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                          const float* q, const float* k, const float* v, int B, int T, int Hq,
                          int Hkv, int D, int64_t qs, int64_t kvs) override {
    inner_->attention_backward(dq, dk, dv, dout, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
  }
  void rope_forward(float* x, int B, int T, int H, int D, int64_t s, float th) override {
    inner_->rope_forward(x, B, T, H, D, s, th);
  }
  void rope_backward(float* dx, int B, int T, int H, int D, int64_t s, float th) override {
    inner_->rope_backward(dx, B, T, H, D, s, th);
  }
  void gelu_forward(float* out, const float* inp, int64_t n) override {
    inner_->gelu_forward(out, inp, n);
  }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    inner_->gelu_backward(dinp, inp, dout, n);
  }
  void swiglu_forward(float* out, const float* g, const float* u, int64_t n) override {
    inner_->swiglu_forward(out, g, u, n);
  }
  void swiglu_backward(float* dg, float* du, const float* dout, const float* g, const float* u,
                       int64_t n) override {
    inner_->swiglu_backward(dg, du, dout, g, u, n);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n) override {
    inner_->residual_forward(out, a, b, n);
  }
  void residual_backward(float* da, float* db, const float* dout, int64_t n) override {
    inner_->residual_backward(da, db, dout, n);
  }
  CrossEntropyResult cross_entropy(float* dl, float* losses, const float* logits,
                                   const int32_t* targets, int N, int V, int Vp, int ignore,
                                   float gs) override {
    return inner_->cross_entropy(dl, losses, logits, targets, N, V, Vp, ignore, gs);
  }
  void vp_ce_local_max(float* row_max, const float* logits, const int32_t* targets, int N, int V,
                       int vs, int rows, int ignore) override {
    inner_->vp_ce_local_max(row_max, logits, targets, N, V, vs, rows, ignore);
  }
  void vp_ce_local_sums(float* sums, const float* logits, const float* row_max,
                        const int32_t* targets, int N, int V, int vs, int rows,
                        int ignore) override {
    inner_->vp_ce_local_sums(sums, logits, row_max, targets, N, V, vs, rows, ignore);
  }
  CrossEntropyResult vp_ce_finish(float* dl, float* losses, const float* logits,
                                  const float* row_max, const float* sums, const int32_t* targets,
                                  int N, int V, int vs, int rows, int ignore, float gs) override {
    return inner_->vp_ce_finish(dl, losses, logits, row_max, sums, targets, N, V, vs, rows, ignore,
                                gs);
  }
  void adamw_update(float* p, float* g, float* m, float* v, int64_t n,
                    const AdamWConfig& cfg) override {
    inner_->adamw_update(p, g, m, v, n, cfg);
  }
  double sum_of_squares(const float* x, int64_t n) override { return inner_->sum_of_squares(x, n); }
  void scale(float* x, int64_t n, float f) override { inner_->scale(x, n, f); }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace tessel::kernels::harness
