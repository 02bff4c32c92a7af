// The two host backends: "cpu" runs the fast kernels, "reference" the plain oracle kernels.
// Both keep tensors in host memory from the caching allocator and run ops synchronously.
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
#include "tessel/kernels/rmsnorm.h"
#include "tessel/kernels/rope.h"
#include "tessel/tensor/allocator.h"

namespace tessel::kernels {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::embedding: return "embedding";
    case Op::layernorm: return "layernorm";
    case Op::rmsnorm: return "rmsnorm";
    case Op::linear: return "linear";
    case Op::attention: return "attention";
    case Op::rope: return "rope";
    case Op::gelu: return "gelu";
    case Op::swiglu: return "swiglu";
    case Op::residual: return "residual";
    case Op::cross_entropy: return "cross_entropy";
    case Op::adamw: return "adamw";
    case Op::grad_norm: return "grad_norm";
  }
  return "?";
}

namespace {

class HostStream final : public Stream {
 public:
  void synchronize() override {}
};

// Implements the Backend ops by forwarding to one kernel namespace (ref:: or cpu::), which is
// passed as a tag type holding the function pointers' home.
#define TESSEL_HOST_BACKEND(ClassName, ns, backend_name)                                        \
  class ClassName final : public Backend {                                                      \
   public:                                                                                      \
    std::string_view name() const override { return backend_name; }                            \
    DeviceKind device() const override { return DeviceKind::cpu; }                             \
    bool supports(Op) const override { return true; }                                           \
    void* allocate(size_t bytes) override { return HostAllocator::instance().allocate(bytes); } \
    void deallocate(void* p) override { HostAllocator::instance().deallocate(p); }             \
    void copy_from_host(void* d, const void* s, size_t n) override { std::memcpy(d, s, n); }    \
    void copy_to_host(void* d, const void* s, size_t n) override { std::memcpy(d, s, n); }      \
    void memset_zero(void* d, size_t n) override { std::memset(d, 0, n); }                      \
    Stream& stream() override { return stream_; }                                               \
    void synchronize() override {}                                                              \
    void embedding_forward(float* out, const int32_t* tokens, const float* wte,                 \
                           const float* wpe, int B, int T, int C, int vs, int vr) override {    \
      ns::embedding_forward(out, tokens, wte, wpe, B, T, C, vs, vr);                            \
    }                                                                                           \
    void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, \
                            int B, int T, int C, int vs, int vr) override {                     \
      ns::embedding_backward(dwte, dwpe, dout, tokens, B, T, C, vs, vr);                        \
    }                                                                                           \
    void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,              \
                           const float* w, const float* b, int N, int C, float eps) override {  \
      ns::layernorm_forward(out, mean, rstd, inp, w, b, N, C, eps);                             \
    }                                                                                           \
    void layernorm_backward(float* dinp, float* dw, float* db, const float* dout,               \
                            const float* inp, const float* w, const float* mean,                \
                            const float* rstd, int N, int C) override {                         \
      ns::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);                     \
    }                                                                                           \
    void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int N,      \
                         int C, float eps) override {                                           \
      ns::rmsnorm_forward(out, rstd, inp, w, N, C, eps);                                        \
    }                                                                                           \
    void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp,          \
                          const float* w, const float* rstd, int N, int C) override {           \
      ns::rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C);                                 \
    }                                                                                           \
    void linear_forward(float* out, const float* inp, const float* w, const float* b, int N,    \
                        int IC, int OC) override {                                              \
      ns::linear_forward(out, inp, w, b, N, IC, OC);                                            \
    }                                                                                           \
    void linear_backward_input(float* dinp, const float* dout, const float* w, int N, int IC,   \
                               int OC) override {                                               \
      ns::linear_backward_input(dinp, dout, w, N, IC, OC);                                      \
    }                                                                                           \
    void linear_backward_weight(float* dw, float* db, const float* dout, const float* inp,      \
                                int N, int IC, int OC) override {                               \
      ns::linear_backward_weight(dw, db, dout, inp, N, IC, OC);                                 \
    }                                                                                           \
    void attention_forward(float* out, float* probs, const float* q, const float* k,            \
                           const float* v, int B, int T, int Hq, int Hkv, int D, int64_t qs,    \
                           int64_t kvs) override {                                              \
      ns::attention_forward(out, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs);                    \
    }                                                                                           \
    void attention_backward(float* dq, float* dk, float* dv, const float* dout,                 \
                            const float* probs, const float* q, const float* k, const float* v, \
                            int B, int T, int Hq, int Hkv, int D, int64_t qs,                   \
                            int64_t kvs) override {                                             \
      ns::attention_backward(dq, dk, dv, dout, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs);      \
    }                                                                                           \
    void rope_forward(float* x, int B, int T, int H, int D, int64_t s, float th) override {     \
      ns::rope_forward(x, B, T, H, D, s, th);                                                   \
    }                                                                                           \
    void rope_backward(float* dx, int B, int T, int H, int D, int64_t s, float th) override {   \
      ns::rope_backward(dx, B, T, H, D, s, th);                                                 \
    }                                                                                           \
    void gelu_forward(float* out, const float* inp, int64_t n) override {                       \
      ns::gelu_forward(out, inp, n);                                                            \
    }                                                                                           \
    void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {  \
      ns::gelu_backward(dinp, inp, dout, n);                                                    \
    }                                                                                           \
    void swiglu_forward(float* out, const float* g, const float* u, int64_t n) override {       \
      ns::swiglu_forward(out, g, u, n);                                                         \
    }                                                                                           \
    void swiglu_backward(float* dg, float* du, const float* dout, const float* g,               \
                         const float* u, int64_t n) override {                                  \
      ns::swiglu_backward(dg, du, dout, g, u, n);                                               \
    }                                                                                           \
    void residual_forward(float* out, const float* a, const float* b, int64_t n) override {     \
      ns::residual_forward(out, a, b, n);                                                       \
    }                                                                                           \
    void residual_backward(float* da, float* db, const float* dout, int64_t n) override {       \
      ns::residual_backward(da, db, dout, n);                                                   \
    }                                                                                           \
    CrossEntropyResult cross_entropy(float* dl, float* losses, const float* logits,             \
                                     const int32_t* targets, int N, int V, int Vp, int ignore,  \
                                     float gs) override {                                       \
      return ns::cross_entropy(dl, losses, logits, targets, N, V, Vp, ignore, gs);              \
    }                                                                                           \
    void adamw_update(float* p, const float* g, float* m, float* v, int64_t n,                  \
                      const AdamWConfig& cfg) override {                                        \
      ns::adamw_update(p, g, m, v, n, cfg);                                                     \
    }                                                                                           \
    double sum_of_squares(const float* x, int64_t n) override {                                 \
      return ns::sum_of_squares(x, n);                                                          \
    }                                                                                           \
    void scale(float* x, int64_t n, float f) override { ns::scale(x, n, f); }                   \
                                                                                                \
   private:                                                                                     \
    HostStream stream_;                                                                         \
  };

TESSEL_HOST_BACKEND(CpuBackend, cpu, "cpu")
TESSEL_HOST_BACKEND(ReferenceBackend, ref, "reference")

struct Registry {
  std::mutex mu;
  std::map<std::string, BackendFactory, std::less<>> factories;
  Registry() {
    factories["cpu"] = [] { return std::make_unique<CpuBackend>(); };
    factories["reference"] = [] { return std::make_unique<ReferenceBackend>(); };
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
