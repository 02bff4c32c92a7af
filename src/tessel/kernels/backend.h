// Backend: where tensors live and ops run.
//
// The model calls every op through a Backend so that another device (CUDA) plugs in without
// touching model code. Pointers passed to ops are in the backend's memory (from allocate()); on
// the CPU backends that is host memory. Ops are enqueued on the backend's current stream and may
// run asynchronously; synchronize() waits for them. A backend answers supports(op) so that callers
// and the op-by-op comparison harness can skip what it lacks instead of failing.
//
// Backends are made by name through a registry: "cpu" (fast kernels) and "reference" (the plain
// oracle kernels; slow, for tests). The op-by-op comparison harness (op_harness.h, test-only) runs
// every op, forward and backward, at many shapes on each registered backend and on "reference"
// through this interface and compares every output against derived bounds
// (op_harness_test.cpp); a new backend is covered once it is registered.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/kernels/cross_entropy.h"
#include "tessel/kernels/optimizer.h"
#include "tessel/kernels/vocab_parallel_ce.h"
#include "tessel/tensor/dtype.h"

namespace tessel::kernels {

enum class DeviceKind { cpu, cuda };

enum class Op {
  embedding,
  layernorm,
  rmsnorm,
  linear,
  linear_bf16,  // the linear layer with bf16 operands (linear_bf16.h), and to_bf16
  attention,
  rope,
  gelu,
  swiglu,
  residual,
  cross_entropy,
  vocab_parallel_ce,  // the three vp_ce_* steps (tensor-parallel head)
  adamw,
  grad_norm,
};
std::string_view op_name(Op op);

// An ordered queue of work on a device. On CPU backends ops run synchronously on the caller's
// thread (with OpenMP inside), so a stream is a no-op handle.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual void synchronize() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;
  virtual DeviceKind device() const = 0;
  virtual bool supports(Op op) const = 0;

  // Device memory. allocate throws std::bad_alloc when out of memory.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void memset_zero(void* dst, size_t bytes) = 0;

  virtual Stream& stream() = 0;
  virtual void synchronize() = 0;

  // Ops: same meaning and contracts as the kernel headers (embedding.h, layernorm.h, ...).
  virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte,
                                 const float* wpe, int B, int T, int C, int vocab_start,
                                 int vocab_rows) = 0;
  virtual void embedding_backward(float* dwte, float* dwpe, const float* dout,
                                  const int32_t* tokens, int B, int T, int C, int vocab_start,
                                  int vocab_rows) = 0;
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                 const float* weight, const float* bias, int N, int C,
                                 float eps) = 0;
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                  const float* inp, const float* weight, const float* mean,
                                  const float* rstd, int N, int C) = 0;
  virtual void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight,
                               int N, int C, float eps) = 0;
  virtual void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                                const float* weight, const float* rstd, int N, int C) = 0;
  virtual void linear_forward(float* out, const float* inp, const float* weight, const float* bias,
                              int N, int IC, int OC) = 0;
  virtual void linear_backward_input(float* dinp, const float* dout, const float* weight, int N,
                                     int IC, int OC) = 0;
  virtual void linear_backward_weight(float* dweight, float* dbias, const float* dout,
                                      const float* inp, int N, int IC, int OC) = 0;
  virtual void to_bf16(bf16* dst, const float* src, int64_t n) = 0;
  virtual void linear_forward_bf16(float* out, const float* inp, const bf16* weight,
                                   const float* bias, int N, int IC, int OC) = 0;
  virtual void linear_backward_input_bf16(float* dinp, const float* dout, const bf16* weight, int N,
                                          int IC, int OC) = 0;
  virtual void linear_backward_weight_bf16(float* dweight, float* dbias, const float* dout,
                                           const float* inp, int N, int IC, int OC) = 0;
  virtual void attention_forward(float* out, float* probs, const float* q, const float* k,
                                 const float* v, int B, int T, int Hq, int Hkv, int D,
                                 int64_t q_stride, int64_t kv_stride) = 0;
  virtual void attention_backward(float* dq, float* dk, float* dv, const float* dout,
                                  const float* probs, const float* q, const float* k,
                                  const float* v, int B, int T, int Hq, int Hkv, int D,
                                  int64_t q_stride, int64_t kv_stride) = 0;
  virtual void rope_forward(float* x, int B, int T, int H, int D, int64_t stride, float theta) = 0;
  virtual void rope_backward(float* dx, int B, int T, int H, int D, int64_t stride,
                             float theta) = 0;
  virtual void gelu_forward(float* out, const float* inp, int64_t n) = 0;
  virtual void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) = 0;
  virtual void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) = 0;
  virtual void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                               const float* up, int64_t n) = 0;
  virtual void residual_forward(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual void residual_backward(float* da, float* db, const float* dout, int64_t n) = 0;
  virtual CrossEntropyResult cross_entropy(float* dlogits, float* losses, const float* logits,
                                           const int32_t* targets, int N, int V, int Vp,
                                           int ignore_index, float grad_scale) = 0;
  virtual void vp_ce_local_max(float* row_max, const float* logits, const int32_t* targets, int N,
                               int V, int vocab_start, int rows, int ignore_index) = 0;
  virtual void vp_ce_local_sums(float* sums, const float* logits, const float* row_max,
                                const int32_t* targets, int N, int V, int vocab_start, int rows,
                                int ignore_index) = 0;
  virtual CrossEntropyResult vp_ce_finish(float* dlogits, float* losses, const float* logits,
                                          const float* row_max, const float* sums,
                                          const int32_t* targets, int N, int V, int vocab_start,
                                          int rows, int ignore_index, float grad_scale) = 0;
  virtual void adamw_update(float* param, float* grad, float* m, float* v, int64_t n,
                            const AdamWConfig& cfg) = 0;
  virtual double sum_of_squares(const float* x, int64_t n) = 0;
  virtual void scale(float* x, int64_t n, float factor) = 0;
};

using BackendFactory = std::function<std::unique_ptr<Backend>()>;

// Makes a backend by name; throws ConfigError listing the known names for an unknown one.
std::unique_ptr<Backend> make_backend(std::string_view name);
std::vector<std::string> backend_names();
// Adds a backend to the registry (a CUDA build registers "cuda" at start-up).
void register_backend(std::string name, BackendFactory factory);

}  // namespace tessel::kernels
