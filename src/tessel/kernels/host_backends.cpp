// The two host backends: "cpu" runs the fast kernels, "reference" the plain oracle kernels.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "tessel/core/check.h"
#include "tessel/kernels/activations.h"
#include "tessel/kernels/attention.h"
#include "tessel/kernels/backend.h"
#include "tessel/kernels/embedding.h"
#include "tessel/kernels/layernorm.h"
#include "tessel/kernels/linear.h"
#include "tessel/kernels/linear_bf16.h"
#include "tessel/kernels/rmsnorm.h"
#include "tessel/kernels/rope.h"
#include "tessel/tensor/allocator.h"

namespace tessel::kernels {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::embedding:
      return "embedding";
    case Op::layernorm:
      return "layernorm";
    case Op::rmsnorm:
      return "rmsnorm";
    case Op::linear:
      return "linear";
    case Op::linear_bf16:
      return "linear_bf16";
    case Op::attention:
      return "attention";
    case Op::rope:
      return "rope";
    case Op::gelu:
      return "gelu";
    case Op::swiglu:
      return "swiglu";
    case Op::residual:
      return "residual";
    case Op::cross_entropy:
      return "cross_entropy";
    case Op::vocab_parallel_ce:
      return "vocab_parallel_ce";
    case Op::adamw:
      return "adamw";
    case Op::grad_norm:
      return "grad_norm";
  }
  return "?";
}

namespace {

// Zeroing a gradient buffer of hundreds of MB is bandwidth-bound; one thread does not saturate it.
void parallel_memset_zero(void* dst, size_t bytes) {
  constexpr size_t kChunk = size_t(1) << 20;
  if (bytes < 4 * kChunk) {
    std::memset(dst, 0, bytes);
    return;
  }
  auto* d = static_cast<char*>(dst);
  const int64_t chunks = int64_t((bytes + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t off = size_t(c) * kChunk;
    std::memset(d + off, 0, std::min(kChunk, bytes - off));
  }
}

class HostStream final : public Stream {
 public:
  void synchronize() override {}
};

// One kernel namespace (ref:: or cpu::) as a table of function pointers, so one HostBackend class
// serves both.
struct KernelTable {
  decltype(&cpu::embedding_forward) embedding_forward;
  decltype(&cpu::embedding_backward) embedding_backward;
  decltype(&cpu::layernorm_forward) layernorm_forward;
  decltype(&cpu::layernorm_backward) layernorm_backward;
  decltype(&cpu::rmsnorm_forward) rmsnorm_forward;
  decltype(&cpu::rmsnorm_backward) rmsnorm_backward;
  decltype(&cpu::linear_forward) linear_forward;
  decltype(&cpu::linear_backward_input) linear_backward_input;
  decltype(&cpu::linear_backward_weight) linear_backward_weight;
  decltype(&cpu::to_bf16) to_bf16;
  decltype(&cpu::linear_forward_bf16) linear_forward_bf16;
  decltype(&cpu::linear_backward_input_bf16) linear_backward_input_bf16;
  decltype(&cpu::linear_backward_weight_bf16) linear_backward_weight_bf16;
  decltype(&cpu::attention_forward) attention_forward;
  decltype(&cpu::attention_backward) attention_backward;
  decltype(&cpu::rope_forward) rope_forward;
  decltype(&cpu::rope_backward) rope_backward;
  decltype(&cpu::gelu_forward) gelu_forward;
  decltype(&cpu::gelu_backward) gelu_backward;
  decltype(&cpu::swiglu_forward) swiglu_forward;
  decltype(&cpu::swiglu_backward) swiglu_backward;
  decltype(&cpu::residual_forward) residual_forward;
  decltype(&cpu::residual_backward) residual_backward;
  decltype(&cpu::cross_entropy) cross_entropy;
  decltype(&cpu::vp_ce_local_max) vp_ce_local_max;
  decltype(&cpu::vp_ce_local_sums) vp_ce_local_sums;
  decltype(&cpu::vp_ce_finish) vp_ce_finish;
  decltype(&cpu::adamw_update) adamw_update;
  decltype(&cpu::sum_of_squares) sum_of_squares;
  decltype(&cpu::scale) scale;
};

constexpr KernelTable kCpuKernels = {
    &cpu::embedding_forward,
    &cpu::embedding_backward,
    &cpu::layernorm_forward,
    &cpu::layernorm_backward,
    &cpu::rmsnorm_forward,
    &cpu::rmsnorm_backward,
    &cpu::linear_forward,
    &cpu::linear_backward_input,
    &cpu::linear_backward_weight,
    &cpu::to_bf16,
    &cpu::linear_forward_bf16,
    &cpu::linear_backward_input_bf16,
    &cpu::linear_backward_weight_bf16,
    &cpu::attention_forward,
    &cpu::attention_backward,
    &cpu::rope_forward,
    &cpu::rope_backward,
    &cpu::gelu_forward,
    &cpu::gelu_backward,
    &cpu::swiglu_forward,
    &cpu::swiglu_backward,
    &cpu::residual_forward,
    &cpu::residual_backward,
    &cpu::cross_entropy,
    &cpu::vp_ce_local_max,
    &cpu::vp_ce_local_sums,
    &cpu::vp_ce_finish,
    &cpu::adamw_update,
    &cpu::sum_of_squares,
    &cpu::scale,
};

constexpr KernelTable kRefKernels = {
    &ref::embedding_forward,
    &ref::embedding_backward,
    &ref::layernorm_forward,
    &ref::layernorm_backward,
    &ref::rmsnorm_forward,
    &ref::rmsnorm_backward,
    &ref::linear_forward,
    &ref::linear_backward_input,
    &ref::linear_backward_weight,
    &ref::to_bf16,
    &ref::linear_forward_bf16,
    &ref::linear_backward_input_bf16,
    &ref::linear_backward_weight_bf16,
    &ref::attention_forward,
    &ref::attention_backward,
    &ref::rope_forward,
    &ref::rope_backward,
    &ref::gelu_forward,
    &ref::gelu_backward,
    &ref::swiglu_forward,
    &ref::swiglu_backward,
    &ref::residual_forward,
    &ref::residual_backward,
    &ref::cross_entropy,
    &ref::vp_ce_local_max,
    &ref::vp_ce_local_sums,
    &ref::vp_ce_finish,
    &ref::adamw_update,
    &ref::sum_of_squares,
    &ref::scale,
};

// Host memory from the caching allocator; ops run synchronously on the calling thread.
class HostBackend final : public Backend {
 public:
  HostBackend(std::string_view name, const KernelTable& k) : name_(name), k_(k) {}

  std::string_view name() const override { return name_; }
  DeviceKind device() const override { return DeviceKind::cpu; }
  bool supports(Op) const override { return true; }
  void* allocate(size_t bytes) override { return HostAllocator::instance().allocate(bytes); }
  void deallocate(void* p) override { HostAllocator::instance().deallocate(p); }
  void copy_from_host(void* d, const void* s, size_t n) override { std::memcpy(d, s, n); }
  void copy_to_host(void* d, const void* s, size_t n) override { std::memcpy(d, s, n); }
  void memset_zero(void* d, size_t n) override { parallel_memset_zero(d, n); }
  Stream& stream() override { return stream_; }
  void synchronize() override {}

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C, int vs, int vr) override {
    k_.embedding_forward(out, tokens, wte, wpe, B, T, C, vs, vr);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C, int vs, int vr) override {
    k_.embedding_backward(dwte, dwpe, dout, tokens, B, T, C, vs, vr);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                         const float* b, int N, int C, float eps) override {
    k_.layernorm_forward(out, mean, rstd, inp, w, b, N, C, eps);
  }
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                          const float* w, const float* mean, const float* rstd, int N,
                          int C) override {
    k_.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int N, int C,
                       float eps) override {
    k_.rmsnorm_forward(out, rstd, inp, w, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                        const float* rstd, int N, int C) override {
    k_.rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C);
  }
  void linear_forward(float* out, const float* inp, const float* w, const float* b, int N, int IC,
                      int OC) override {
    k_.linear_forward(out, inp, w, b, N, IC, OC);
  }
  void linear_backward_input(float* dinp, const float* dout, const float* w, int N, int IC,
                             int OC) override {
    k_.linear_backward_input(dinp, dout, w, N, IC, OC);
  }
  void linear_backward_weight(float* dw, float* db, const float* dout, const float* inp, int N,
                              int IC, int OC) override {
    k_.linear_backward_weight(dw, db, dout, inp, N, IC, OC);
  }
  void to_bf16(bf16* dst, const float* src, int64_t n) override { k_.to_bf16(dst, src, n); }
  void linear_forward_bf16(float* out, const float* inp, const bf16* w, const float* b, int N,
                           int IC, int OC) override {
    k_.linear_forward_bf16(out, inp, w, b, N, IC, OC);
  }
  void linear_backward_input_bf16(float* dinp, const float* dout, const bf16* w, int N, int IC,
                                  int OC) override {
    k_.linear_backward_input_bf16(dinp, dout, w, N, IC, OC);
  }
  void linear_backward_weight_bf16(float* dw, float* db, const float* dout, const float* inp, int N,
                                   int IC, int OC) override {
    k_.linear_backward_weight_bf16(dw, db, dout, inp, N, IC, OC);
  }
  void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                         int B, int T, int Hq, int Hkv, int D, int64_t qs, int64_t kvs) override {
    k_.attention_forward(out, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                          const float* q, const float* k, const float* v, int B, int T, int Hq,
                          int Hkv, int D, int64_t qs, int64_t kvs) override {
    k_.attention_backward(dq, dk, dv, dout, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
  }
  void rope_forward(float* x, int B, int T, int H, int D, int64_t s, float th) override {
    k_.rope_forward(x, B, T, H, D, s, th);
  }
  void rope_backward(float* dx, int B, int T, int H, int D, int64_t s, float th) override {
    k_.rope_backward(dx, B, T, H, D, s, th);
  }
  void gelu_forward(float* out, const float* inp, int64_t n) override {
    k_.gelu_forward(out, inp, n);
  }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    k_.gelu_backward(dinp, inp, dout, n);
  }
  void swiglu_forward(float* out, const float* g, const float* u, int64_t n) override {
    k_.swiglu_forward(out, g, u, n);
  }
  void swiglu_backward(float* dg, float* du, const float* dout, const float* g, const float* u,
                       int64_t n) override {
    k_.swiglu_backward(dg, du, dout, g, u, n);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n) override {
    k_.residual_forward(out, a, b, n);
  }
  void residual_backward(float* da, float* db, const float* dout, int64_t n) override {
    k_.residual_backward(da, db, dout, n);
  }
  CrossEntropyResult cross_entropy(float* dl, float* losses, const float* logits,
                                   const int32_t* targets, int N, int V, int Vp, int ignore,
                                   float gs) override {
    return k_.cross_entropy(dl, losses, logits, targets, N, V, Vp, ignore, gs);
  }
  void vp_ce_local_max(float* row_max, const float* logits, const int32_t* targets, int N, int V,
                       int vs, int rows, int ignore) override {
    k_.vp_ce_local_max(row_max, logits, targets, N, V, vs, rows, ignore);
  }
  void vp_ce_local_sums(float* sums, const float* logits, const float* row_max,
                        const int32_t* targets, int N, int V, int vs, int rows,
                        int ignore) override {
    k_.vp_ce_local_sums(sums, logits, row_max, targets, N, V, vs, rows, ignore);
  }
  CrossEntropyResult vp_ce_finish(float* dl, float* losses, const float* logits,
                                  const float* row_max, const float* sums, const int32_t* targets,
                                  int N, int V, int vs, int rows, int ignore, float gs) override {
    return k_.vp_ce_finish(dl, losses, logits, row_max, sums, targets, N, V, vs, rows, ignore, gs);
  }
  void adamw_update(float* p, float* g, float* m, float* v, int64_t n,
                    const AdamWConfig& cfg) override {
    k_.adamw_update(p, g, m, v, n, cfg);
  }
  double sum_of_squares(const float* x, int64_t n) override { return k_.sum_of_squares(x, n); }
  void scale(float* x, int64_t n, float f) override { k_.scale(x, n, f); }

 private:
  std::string_view name_;
  const KernelTable& k_;
  HostStream stream_;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, BackendFactory, std::less<>> factories;
  Registry() {
    factories["cpu"] = [] { return std::make_unique<HostBackend>("cpu", kCpuKernels); };
    factories["reference"] = [] { return std::make_unique<HostBackend>("reference", kRefKernels); };
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

std::unique_ptr<Backend> make_backend(std::string_view name) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.factories.find(name);
  if (it == r.factories.end()) {
    std::string known;
    for (auto& [n, f] : r.factories) known += (known.empty() ? "" : ", ") + n;
    TESSEL_THROW(ConfigError, "unknown backend '{}' (known: {})", name, known);
  }
  return it->second();
}

std::vector<std::string> backend_names() {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  std::vector<std::string> names;
  for (auto& [n, f] : r.factories) names.push_back(n);
  return names;
}

void register_backend(std::string name, BackendFactory factory) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  r.factories[std::move(name)] = std::move(factory);
}

}  // namespace tessel::kernels
