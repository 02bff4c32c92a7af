// Internal to the op harness: each op family's cases (op_harness_cases_<family>.cpp), and the
// helpers they share (op_harness_cases.cpp). op_cases() in op_harness.cpp puts them together.
//
// A family's cases run every op of the Backend interface, forward and backward, at several shapes
// (odd sizes, the kernels' parallel thresholds, and empty ones), each with the per-element bound on
// |backend - reference| derived beside it or, where a per-op test (kernels/<op>_test.cpp) uses the
// same bound for cpu:: against ref::, in tessel/testing (norm_bounds.h, attention_bounds.h,
// activation_bounds.h, kernel_bounds.h), and for the small backward cases a gradient mode (the
// forward, the loss weights, the third-derivative bound; see op_harness.cpp). Those bounds hold
// for any backend that does the cpu:: kernels' arithmetic in any order (op_harness.h). Backward
// cases add into pre-filled gradient buffers, so a backend that overwrites instead of
// accumulating fails.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/op_harness.h"
#include "tessel/testing/rounding.h"

namespace tessel::kernels::harness::cases {

void add_embedding(std::vector<OpCase>& out);
void add_layernorm(std::vector<OpCase>& out);
void add_rmsnorm(std::vector<OpCase>& out);
void add_linear(std::vector<OpCase>& out);
void add_linear_bf16(std::vector<OpCase>& out);  // and to_bf16
void add_attention(std::vector<OpCase>& out);
void add_rope(std::vector<OpCase>& out);
void add_activations(std::vector<OpCase>& out);  // gelu, swiglu, residual
void add_cross_entropy(std::vector<OpCase>& out);
void add_vocab_parallel_ce(std::vector<OpCase>& out);
void add_optimizer(std::vector<OpCase>& out);  // adamw_update, sum_of_squares, scale

// ---- shared by the families ---------------------------------------------------------------------

inline constexpr double u = testing::kUnitRoundoff;
inline constexpr double u64 = 0x1p-53;
inline constexpr double kSubnormal = 0x1p-149;  // a product or sum that underflows

// (output name, element): what GradSpec::dependents lists.
using Deps = std::vector<std::pair<std::string, size_t>>;

std::vector<float> normal(size_t n, uint64_t seed, float stddev = 1.0f);
std::vector<float> nans(size_t n);
Output out_of(std::string name, const std::vector<float>& v);
Output zeros(std::string name, size_t n);
// Zeroes the named float inputs that exist (a gradient mode's accumulated buffers).
void zero(Tensors& in, std::initializer_list<const char*> names);

// An array in a backend's memory, filled from and read back to the host. Empty arrays get a
// small block too, so that a null pointer never stands for "absent" (bias, dbias, dwpe).
template <typename T>
class Buffer {
 public:
  Buffer(Backend& b, size_t n) : b_(b), n_(n) {
    p_ = static_cast<T*>(b.allocate(std::max<size_t>(n, 1) * sizeof(T)));
  }
  Buffer(Backend& b, const std::vector<T>& host) : Buffer(b, host.size()) {
    if (n_ > 0) b_.copy_from_host(p_, host.data(), n_ * sizeof(T));
  }
  ~Buffer() { b_.deallocate(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  T* get() const { return p_; }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) throw std::invalid_argument("Buffer::upload: size mismatch");
    if (n_ > 0) b_.copy_from_host(p_, host.data(), n_ * sizeof(T));
  }
  std::vector<T> host() const {
    b_.synchronize();
    std::vector<T> h(n_);
    if (n_ > 0) b_.copy_to_host(h.data(), p_, n_ * sizeof(T));
    return h;
  }

 private:
  Backend& b_;
  size_t n_;
  T* p_;
};
using FBuf = Buffer<float>;
using IBuf = Buffer<int32_t>;

// A case's name (a test name: op_what_dims) and its dimensions for messages.
struct Label {
  std::string op, what, dims, shape;
  Label(std::string_view op, std::string_view what) : op(op), what(what) {}
  Label& dim(const char* key, int64_t v);
  Label& flag(const char* f);
  std::string name() const { return op + "_" + what + dims; }
};

// A case's run and bounds, bound to one configuration of its family.
struct PassFns {
  std::function<Outputs(Backend&, const Tensors&)> run;
  std::function<Outputs(const Tensors&, const Outputs& reference)> bounds;
};

template <typename Cfg>
PassFns pass_fns(const Cfg& cfg, Outputs (*run)(Backend&, const Tensors&, const Cfg&),
                 Outputs (*bounds)(const Tensors&, const Outputs&, const Cfg&)) {
  return {[cfg, run](Backend& b, const Tensors& in) { return run(b, in, cfg); },
          [cfg, bounds](const Tensors& in, const Outputs& ref) { return bounds(in, ref, cfg); }};
}

template <typename Cfg>
std::function<Tensors(uint64_t)> inputs_of(const Cfg& cfg,
                                           Tensors (*inputs)(const Cfg&, uint64_t)) {
  return [cfg, inputs](uint64_t seed) { return inputs(cfg, seed); };
}

OpCase make_case(Op op, Pass pass, const Label& label);
OpCase make_case(Op op, Pass pass, const Label& label, bool empty,
                 std::function<Tensors(uint64_t)> inputs, PassFns fns);

// The gradient mode of a backward case whose forward is `forward`, with the loss weights the
// input "dout" on the forward's output "out" (a case with other weights sets them after).
using Params = std::vector<std::pair<std::string, std::string>>;
GradSpec gradient(const PassFns& forward, Params params, std::function<void(Tensors&)> derive,
                  decltype(GradSpec::dependents) dependents,
                  decltype(GradSpec::third_derivative) third_derivative);
// A third-derivative bound of a loss affine in every parameter.
double affine(const Tensors&, std::string_view, size_t, double);

// A configuration's forward case (label's what "fwd") and backward case ("bwd"), the backward
// with `grad` when given.
void add_fwd_bwd(std::vector<OpCase>& out, Op op, Label label, bool empty,
                 const std::function<Tensors(uint64_t)>& inputs, PassFns fwd, PassFns bwd,
                 std::optional<GradSpec> grad = std::nullopt);

}  // namespace tessel::kernels::harness::cases
