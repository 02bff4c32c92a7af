// bench_step: times tessel's training step, the way runtime/trainer.cpp takes it.
//
// One step = forward_backward (grad_scale 1/(B*T)), the global gradient norm (sum of squares) and
// its clip factor, AdamW per parameter view (weight decay on the views that ask for it) with the
// clip factor applied and the gradient zeroed as AdamW reads it, so that no separate scale or
// zero_grad pass is needed. Warm-up steps first, then timed steps; each phase is timed separately,
// and every backend op is timed through a forwarding backend (one clock read per op call: ~20 µs
// per step, far below the noise) so that the report says where the time goes.
//
// With --gemm-peak it also measures, after the steps, the SGEMM rate of every GEMM provider on
// the model's own GEMM shapes (forward NT, backward-input NN and backward-weight TN of every
// linear layer, called exactly as kernels/cpu/linear.cpp calls them): the best of those is the
// peak that tessel's effective matmul rate is compared with. Peak RSS is read before that, so
// the GEMM buffers do not count.
//
// Human-readable lines go to stderr; stdout gets one JSON object (scripts/bench combines them).
#include <sys/resource.h>
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/kernels/gemm.h"
#include "tessel/kernels/gemm_bf16.h"
#include "tessel/model/model_config.h"
#include "tessel/model/transformer.h"

namespace {

using Clock = std::chrono::steady_clock;
using tessel::kernels::Backend;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// CPU time of the whole process (all threads), in milliseconds: a cross-check of the wall time
// when other work shares the machine (spinning OpenMP threads count too).
double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) * 1e-6;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
}

// Forwards every call to `inner`, adding its wall time to a per-op total. The CPU backends run
// ops synchronously, so the time around a call is the op's time.
class TimedBackend final : public Backend {
 public:
  explicit TimedBackend(Backend& inner) : in_(inner) {}

  struct OpTotals {
    double ms = 0;     // accumulated wall time
    double flops = 0;  // accumulated matmul FLOPs (linear ops only)
  };
  std::map<std::string, OpTotals> totals;  // op label -> totals over the timed steps
  bool enabled = false;

  std::string_view name() const override { return in_.name(); }
  tessel::kernels::DeviceKind device() const override { return in_.device(); }
  bool supports(tessel::kernels::Op op) const override { return in_.supports(op); }
  void* allocate(size_t bytes) override { return in_.allocate(bytes); }
  void deallocate(void* p) override { in_.deallocate(p); }
  void copy_from_host(void* d, const void* s, size_t n) override {
    timed("copy", [&] { in_.copy_from_host(d, s, n); });
  }
  void copy_to_host(void* d, const void* s, size_t n) override {
    timed("copy", [&] { in_.copy_to_host(d, s, n); });
  }
  void memset_zero(void* d, size_t n) override {
    timed(n >= kBigMemset ? "memset_zero(grads)" : "memset_zero(scratch)",
          [&] { in_.memset_zero(d, n); });
  }
  tessel::kernels::Stream& stream() override { return in_.stream(); }
  void synchronize() override { in_.synchronize(); }

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C, int vs, int vr) override {
    timed("embedding_fwd", [&] { in_.embedding_forward(out, tokens, wte, wpe, B, T, C, vs, vr); });
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C, int vs, int vr) override {
    timed("embedding_bwd",
          [&] { in_.embedding_backward(dwte, dwpe, dout, tokens, B, T, C, vs, vr); });
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                         const float* b, int N, int C, float eps) override {
    timed("layernorm_fwd", [&] { in_.layernorm_forward(out, mean, rstd, inp, w, b, N, C, eps); });
  }
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                          const float* w, const float* mean, const float* rstd, int N,
                          int C) override {
    timed("layernorm_bwd",
          [&] { in_.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C); });
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int N, int C,
                       float eps) override {
    timed("rmsnorm_fwd", [&] { in_.rmsnorm_forward(out, rstd, inp, w, N, C, eps); });
  }
  void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                        const float* rstd, int N, int C) override {
    timed("rmsnorm_bwd", [&] { in_.rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C); });
  }
  void linear_forward(float* out, const float* inp, const float* w, const float* b, int N, int IC,
                      int OC) override {
    timed(
        linear_label("linear_fwd", IC, OC), [&] { in_.linear_forward(out, inp, w, b, N, IC, OC); },
        2.0 * N * IC * OC);
  }
  void linear_backward_input(float* dinp, const float* dout, const float* w, int N, int IC,
                             int OC) override {
    timed(
        linear_label("linear_bwd_input", IC, OC),
        [&] { in_.linear_backward_input(dinp, dout, w, N, IC, OC); }, 2.0 * N * IC * OC);
  }
  void linear_backward_weight(float* dw, float* db, const float* dout, const float* inp, int N,
                              int IC, int OC) override {
    timed(
        linear_label("linear_bwd_weight", IC, OC),
        [&] { in_.linear_backward_weight(dw, db, dout, inp, N, IC, OC); }, 2.0 * N * IC * OC);
  }
  void to_bf16(tessel::bf16* dst, const float* src, int64_t n) override {
    timed("to_bf16", [&] { in_.to_bf16(dst, src, n); });
  }
  void linear_forward_bf16(float* out, const float* inp, const tessel::bf16* w, const float* b,
                           int N, int IC, int OC) override {
    timed(
        linear_label("linear_fwd_bf16", IC, OC),
        [&] { in_.linear_forward_bf16(out, inp, w, b, N, IC, OC); }, 2.0 * N * IC * OC);
  }
  void linear_backward_input_bf16(float* dinp, const float* dout, const tessel::bf16* w, int N,
                                  int IC, int OC) override {
    timed(
        linear_label("linear_bwd_input_bf16", IC, OC),
        [&] { in_.linear_backward_input_bf16(dinp, dout, w, N, IC, OC); }, 2.0 * N * IC * OC);
  }
  void linear_backward_weight_bf16(float* dw, float* db, const float* dout, const float* inp, int N,
                                   int IC, int OC) override {
    timed(
        linear_label("linear_bwd_weight_bf16", IC, OC),
        [&] { in_.linear_backward_weight_bf16(dw, db, dout, inp, N, IC, OC); }, 2.0 * N * IC * OC);
  }
  void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                         int B, int T, int Hq, int Hkv, int D, int64_t qs, int64_t kvs) override {
    timed("attention_fwd",
          [&] { in_.attention_forward(out, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs); });
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                          const float* q, const float* k, const float* v, int B, int T, int Hq,
                          int Hkv, int D, int64_t qs, int64_t kvs) override {
    timed("attention_bwd", [&] {
      in_.attention_backward(dq, dk, dv, dout, probs, q, k, v, B, T, Hq, Hkv, D, qs, kvs);
    });
  }
  void rope_forward(float* x, int B, int T, int H, int D, int64_t s, float theta) override {
    timed("rope_fwd", [&] { in_.rope_forward(x, B, T, H, D, s, theta); });
  }
  void rope_backward(float* dx, int B, int T, int H, int D, int64_t s, float theta) override {
    timed("rope_bwd", [&] { in_.rope_backward(dx, B, T, H, D, s, theta); });
  }
  void gelu_forward(float* out, const float* inp, int64_t n) override {
    timed("gelu_fwd", [&] { in_.gelu_forward(out, inp, n); });
  }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    timed("gelu_bwd", [&] { in_.gelu_backward(dinp, inp, dout, n); });
  }
  void swiglu_forward(float* out, const float* g, const float* u, int64_t n) override {
    timed("swiglu_fwd", [&] { in_.swiglu_forward(out, g, u, n); });
  }
  void swiglu_backward(float* dg, float* du, const float* dout, const float* g, const float* u,
                       int64_t n) override {
    timed("swiglu_bwd", [&] { in_.swiglu_backward(dg, du, dout, g, u, n); });
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n) override {
    timed("residual_fwd", [&] { in_.residual_forward(out, a, b, n); });
  }
  void residual_backward(float* da, float* db, const float* dout, int64_t n) override {
    timed("residual_bwd", [&] { in_.residual_backward(da, db, dout, n); });
  }
  tessel::kernels::CrossEntropyResult cross_entropy(float* dlogits, float* losses,
                                                    const float* logits, const int32_t* targets,
                                                    int N, int V, int Vp, int ignore_index,
                                                    float grad_scale) override {
    tessel::kernels::CrossEntropyResult r;
    timed("cross_entropy", [&] {
      r = in_.cross_entropy(dlogits, losses, logits, targets, N, V, Vp, ignore_index, grad_scale);
    });
    return r;
  }
  void vp_ce_local_max(float* row_max, const float* logits, const int32_t* targets, int N, int V,
                       int vocab_start, int rows, int ignore_index) override {
    timed("vp_ce", [&] {
      in_.vp_ce_local_max(row_max, logits, targets, N, V, vocab_start, rows, ignore_index);
    });
  }
  void vp_ce_local_sums(float* sums, const float* logits, const float* row_max,
                        const int32_t* targets, int N, int V, int vocab_start, int rows,
                        int ignore_index) override {
    timed("vp_ce", [&] {
      in_.vp_ce_local_sums(sums, logits, row_max, targets, N, V, vocab_start, rows, ignore_index);
    });
  }
  tessel::kernels::CrossEntropyResult vp_ce_finish(float* dlogits, float* losses,
                                                   const float* logits, const float* row_max,
                                                   const float* sums, const int32_t* targets, int N,
                                                   int V, int vocab_start, int rows,
                                                   int ignore_index, float grad_scale) override {
    tessel::kernels::CrossEntropyResult r;
    timed("vp_ce", [&] {
      r = in_.vp_ce_finish(dlogits, losses, logits, row_max, sums, targets, N, V, vocab_start, rows,
                           ignore_index, grad_scale);
    });
    return r;
  }
  void adamw_update(float* p, float* g, float* m, float* v, int64_t n,
                    const tessel::kernels::AdamWConfig& cfg) override {
    timed("adamw_update", [&] { in_.adamw_update(p, g, m, v, n, cfg); });
  }
  double sum_of_squares(const float* x, int64_t n) override {
    double r = 0;
    timed("sum_of_squares", [&] { r = in_.sum_of_squares(x, n); });
    return r;
  }
  void scale(float* x, int64_t n, float f) override {
    timed("scale", [&] { in_.scale(x, n, f); });
  }

 private:
  // Memsets at least this big are whole parameter-sized buffers (zero_grad), smaller ones the
  // backward scratch.
  static constexpr size_t kBigMemset = size_t(64) << 20;

  // "linear_fwd 768x2304" (in x out features): one line per layer shape; the GEMM inside
  // linear_fwd also covers the bias prefill, linear_bwd_weight the bias gradient.
  static std::string linear_label(const char* op, int IC, int OC) {
    return std::string(op) + " " + std::to_string(IC) + "x" + std::to_string(OC);
  }

  template <typename F>
  void timed(const std::string& op, F&& f, double flops = 0) {
    if (!enabled) {
      f();
      return;
    }
    const auto t0 = Clock::now();
    f();
    OpTotals& t = totals[op];
    t.ms += ms_since(t0);
    t.flops += flops;
  }

  Backend& in_;
};

struct GemmShape {
  const char* what;
  bool ta, tb;
  int M, N, K;
  float beta;
};

// Every GEMM one training step issues, in the forms kernels/cpu/linear.cpp uses.
std::vector<GemmShape> model_gemm_shapes(const tessel::model::ModelConfig& c, int rows) {
  const int C = c.n_embd, F = c.ffn_hidden, Vp = c.padded_vocab();
  struct Lin {
    const char* name;
    int IC, OC;
    bool bias;
  };
  const Lin lins[] = {{"c_attn", C, 3 * C, true},
                      {"attn.c_proj", C, C, true},
                      {"c_fc", C, F, true},
                      {"mlp.c_proj", F, C, true},
                      {"lm_head", C, Vp, false}};
  std::vector<GemmShape> out;
  for (const Lin& l : lins) {
    out.push_back({l.name, false, true, rows, l.OC, l.IC, l.bias ? 1.0f : 0.0f});  // forward
    out.push_back({l.name, false, false, rows, l.IC, l.OC, 1.0f});                 // d input
    out.push_back({l.name, true, false, l.OC, l.IC, rows, 1.0f});                  // d weight
  }
  return out;
}

struct GemmPeak {
  double gflops = 0;
  // gemm_bf16's rate over the faster fp32 provider's, geometric mean over the shapes.
  double bf16_vs_fp32 = 0;
  std::string provider, shape;
  nlohmann::ordered_json table = nlohmann::ordered_json::array();
};

// Best-of-repeats GFLOP/s of every (provider, shape); each shape runs >= 3 times and >= 60 ms.
GemmPeak measure_gemm_peak(const tessel::model::ModelConfig& cfg, int rows) {
  namespace k = tessel::kernels;
  const std::string original = k::gemm_provider();
  const auto shapes = model_gemm_shapes(cfg, rows);
  size_t a_max = 0, b_max = 0, c_max = 0;
  for (const auto& s : shapes) {
    a_max = std::max(a_max, size_t(s.M) * size_t(s.K));
    b_max = std::max(b_max, size_t(s.K) * size_t(s.N));
    c_max = std::max(c_max, size_t(s.M) * size_t(s.N));
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<float> A(a_max), B(b_max), Cm(c_max, 0.0f);
  for (float& x : A) x = nd(rng);
  for (float& x : B) x = nd(rng);
  // The same operands in bf16 for gemm_bf16 (kernels/gemm_bf16.h), float accumulation and output.
  std::vector<tessel::bf16> A16(a_max), B16(b_max);
  for (size_t i = 0; i < a_max; ++i) A16[i] = tessel::f32_to_bf16(A[i]);
  for (size_t i = 0; i < b_max; ++i) B16[i] = tessel::f32_to_bf16(B[i]);
  // Best-of-repeats GFLOP/s of one call; >= 3 runs and >= 60 ms after a warm-up (packing
  // buffers, thread start).
  auto best_gflops = [](double flop, const auto& run) {
    run();
    double best = 1e30, spent = 0;
    for (int rep = 0; rep < 3 || spent < 60.0; ++rep) {
      const auto t0 = Clock::now();
      run();
      const double ms = ms_since(t0);
      best = std::min(best, ms);
      spent += ms;
      if (rep >= 1000) break;
    }
    return flop / (best * 1e6);
  };
  double log_bf16_ratio = 0;

  GemmPeak peak;
  std::fprintf(stderr, "  sgemm on the model's shapes (best of repeats, GFLOP/s):\n");
  std::fprintf(stderr, "    %-12s %-3s %6s %6s %6s", "layer", "op", "M", "N", "K");
  for (const auto& p : k::gemm_providers()) std::fprintf(stderr, " %9s", p.c_str());
  std::fprintf(stderr, " %9s\n", k::gemm_bf16_native() ? "bf16" : "bf16(fb)");
  for (const auto& s : shapes) {
    const int lda = s.ta ? s.M : s.K, ldb = s.tb ? s.K : s.N, ldc = s.N;
    const double flop = 2.0 * s.M * s.N * double(s.K);
    const char* form = s.ta ? "TN" : (s.tb ? "NT" : "NN");
    std::fprintf(stderr, "    %-12s %-3s %6d %6d %6d", s.what, form, s.M, s.N, s.K);
    nlohmann::ordered_json row = {
        {"layer", s.what}, {"form", form}, {"M", s.M}, {"N", s.N}, {"K", s.K}};
    double best_fp32 = 0;
    for (const auto& p : k::gemm_providers()) {
      k::set_gemm_provider(p);
      const double gf = best_gflops(flop, [&] {
        k::sgemm(s.ta, s.tb, s.M, s.N, s.K, 1.0f, A.data(), lda, B.data(), ldb, s.beta, Cm.data(),
                 ldc);
      });
      best_fp32 = std::max(best_fp32, gf);
      std::fprintf(stderr, " %9.1f", gf);
      row[p] = gf;
      if (gf > peak.gflops) {
        peak.gflops = gf;
        peak.provider = p;
        peak.shape = std::string(s.what) + " " + form + " " + std::to_string(s.M) + "x" +
                     std::to_string(s.N) + "x" + std::to_string(s.K);
      }
    }
    const double bf = best_gflops(flop, [&] {
      k::gemm_bf16(s.ta, s.tb, s.M, s.N, s.K, 1.0f, A16.data(), lda, B16.data(), ldb, s.beta,
                   Cm.data(), ldc);
    });
    std::fprintf(stderr, " %9.1f\n", bf);
    row["bf16"] = bf;
    log_bf16_ratio += std::log(bf / best_fp32);
    peak.table.push_back(row);
  }
  peak.bf16_vs_fp32 = std::exp(log_bf16_ratio / double(shapes.size()));
  k::set_gemm_provider(original);
  return peak;
}

// Matmul FLOPs of one training step: 6 per (token, weight-matrix element) for every linear layer
// and the LM head (forward 2, backward 4), plus attention's QK^T and PV over the full T x T
// (forward 4 B T^2 C per layer, backward twice that) -- the usual 6N + 12 L C T per token.
// The head counts the real vocabulary, not the padding.
double step_matmul_flops(const tessel::model::ModelConfig& c, int B, int T) {
  const double N = double(B) * T, C = c.n_embd, F = c.ffn_hidden, L = c.n_layer;
  const double block_weights = 3 * C * C + C * C + 2 * C * F;
  const double head_weights = C * c.vocab_size;
  const double linear = 6.0 * N * (L * block_weights + head_weights);
  const double attention = 12.0 * L * double(B) * T * T * C;
  return linear + attention;
}

tessel::model::ModelConfig bench_config(const std::string& name) {
  using tessel::model::ModelConfig;
  if (name == "gpt2-small-bench") {
    // The small configuration: L=4, C=256, 4 heads, GPT-2 vocabulary and positions.
    ModelConfig c = ModelConfig::preset("gpt2-124m");
    c.name = name;
    c.n_layer = 4;
    c.n_embd = 256;
    c.n_head = c.n_kv_head = 4;
    c.ffn_hidden = 4 * 256;
    c.validate();
    return c;
  }
  return ModelConfig::preset(name);
}

struct BenchArgs {
  std::string model = "gpt2-124m";
  std::string backend_name = "cpu";
  int B = 4, T = 64, warmup = 3, steps = 10;
  bool gemm_peak = false;
  std::string precision = "fp32";  // or bf16: the linear layers on bf16 operands (autocast)
  uint64_t seed = 1234;
};

void add_options(CLI::App& app, BenchArgs& a) {
  app.add_option("--model", a.model, "model preset, or gpt2-small-bench (L=4, C=256, 4 heads)");
  app.add_option("--backend", a.backend_name, "kernel backend");
  app.add_option("--batch", a.B, "B")->check(CLI::PositiveNumber);
  app.add_option("--seq", a.T, "T")->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", a.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--seed", a.seed, "init and token seed");
  app.add_flag("--gemm-peak", a.gemm_peak, "also measure SGEMM on the model's shapes");
  app.add_option("--precision", a.precision, "fp32, or bf16: linear layers on bf16 operands")
      ->check(CLI::IsMember({"fp32", "bf16"}));
}

// Random tokens and targets for every step.
struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch random_batch(const tessel::model::ModelConfig& cfg, int N, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed)};
  std::uniform_int_distribution<int32_t> tok(0, cfg.vocab_size - 1);
  Batch b{std::vector<int32_t>(static_cast<size_t>(N)),
          std::vector<int32_t>(static_cast<size_t>(N))};
  for (auto& t : b.tokens) t = tok(rng);
  for (auto& t : b.targets) t = tok(rng);
  return b;
}

// The optimizer's state and settings, as the trainer's.
struct Adam {
  int64_t P = 0;  // parameters
  float* m = nullptr;
  float* v = nullptr;
  tessel::kernels::AdamWConfig opt;
  float weight_decay = 0.1f, max_norm = 1.0f;
};

// Adam moments: allocated and touched once, like the trainer's.
Adam make_adam(Backend& backend, int64_t P) {
  Adam a;
  a.P = P;
  a.m = static_cast<float*>(backend.allocate(size_t(P) * sizeof(float)));
  a.v = static_cast<float*>(backend.allocate(size_t(P) * sizeof(float)));
  backend.memset_zero(a.m, size_t(P) * sizeof(float));
  backend.memset_zero(a.v, size_t(P) * sizeof(float));
  a.opt.lr = 3e-4f;
  a.opt.beta1 = 0.9f;
  a.opt.beta2 = 0.95f;
  a.opt.eps = 1e-8f;
  return a;
}

enum Phase { kForward, kBackward, kGradNorm, kAdam, kNumPhases };
constexpr const char* kPhaseNames[kNumPhases] = {"forward", "backward", "grad_norm", "adamw"};

struct StepResult {
  std::array<double, kNumPhases> phase_ms{};
  double total_ms = 0, cpu_ms = 0, loss = 0, norm = 0;
  float clip_factor = 1;
};

// Training step `s` (0-based), each phase timed.
StepResult train_step(int s, tessel::model::Transformer& net, TimedBackend& backend,
                      const Batch& batch, Adam& adam, float grad_scale) {
  namespace k = tessel::kernels;
  float* params = net.params().data<float>();
  float* grads = net.grads().data<float>();
  StepResult r;
  const auto t_step = Clock::now();
  const double cpu0 = process_cpu_ms();
  // No zero_grad pass: the gradients start at zero and AdamW zeroes each one as it reads it
  // (AdamWConfig::zero_grad), as the trainer does.
  auto t0 = Clock::now();
  // Mixed precision: the weights' bf16 copy, once a step as the trainer makes it (a no-op in fp32;
  // timed with the forward).
  net.refresh_compute_weights();
  const auto fwd = net.forward_stage(batch.tokens.data(), batch.targets.data(), grad_scale);
  backend.synchronize();
  r.phase_ms[kForward] = ms_since(t0);

  t0 = Clock::now();
  net.backward_stage();
  backend.synchronize();
  r.phase_ms[kBackward] = ms_since(t0);

  t0 = Clock::now();
  r.norm = std::sqrt(backend.sum_of_squares(grads, adam.P));
  r.clip_factor = k::clip_factor(r.norm, adam.max_norm);
  backend.synchronize();
  r.phase_ms[kGradNorm] = ms_since(t0);

  // The clip factor is applied inside AdamW as it reads each gradient (AdamWConfig::
  // grad_scale): the same multiply as clip_grad_norm_'s, without a pass of its own.
  t0 = Clock::now();
  adam.opt.step = s + 1;
  adam.opt.grad_scale = r.clip_factor;
  adam.opt.zero_grad = true;
  for (const auto& view : net.param_views()) {
    adam.opt.weight_decay = view.weight_decay ? adam.weight_decay : 0.0f;
    backend.adamw_update(params + view.offset, grads + view.offset, adam.m + view.offset,
                         adam.v + view.offset, view.numel, adam.opt);
  }
  backend.synchronize();
  r.phase_ms[kAdam] = ms_since(t0);
  r.total_ms = ms_since(t_step);
  r.cpu_ms = process_cpu_ms() - cpu0;
  r.loss = fwd.loss_sum / double(std::max<int64_t>(fwd.valid, 1));
  return r;
}

// What the timed steps measured.
struct StepStats {
  std::array<std::vector<double>, kNumPhases> phase_ms;
  std::vector<double> step_ms, cpu_ms, losses, norms;
  int clipped = 0;
};

// The warm-up steps, then the timed ones (ops timed only in those). False when the loss stops
// being finite.
bool run_steps(const BenchArgs& a, tessel::model::Transformer& net, TimedBackend& backend,
               const Batch& batch, Adam& adam, StepStats& stats) {
  const float grad_scale = 1.0f / float(a.B * a.T);
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    const bool timed = s >= a.warmup;
    backend.enabled = timed;
    const StepResult r = train_step(s, net, backend, batch, adam, grad_scale);
    std::fprintf(stderr, "  %s step %2d: %8.1f ms  loss %.4f  grad norm %.3f\n",
                 timed ? "timed " : "warmup", s, r.total_ms, r.loss, r.norm);
    if (!std::isfinite(r.loss)) {
      std::fprintf(stderr, "bench_step: loss became %f at step %d\n", r.loss, s);
      return false;
    }
    if (timed) {
      stats.step_ms.push_back(r.total_ms);
      stats.cpu_ms.push_back(r.cpu_ms);
      for (int p = 0; p < kNumPhases; ++p)
        stats.phase_ms[size_t(p)].push_back(r.phase_ms[size_t(p)]);
      stats.losses.push_back(r.loss);
      stats.norms.push_back(r.norm);
      stats.clipped += r.clip_factor < 1.0f;
    }
  }
  backend.enabled = false;
  return true;
}

double peak_rss_mb() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// The step summary (JSON, and one line on stderr).
nlohmann::ordered_json step_summary(const BenchArgs& a, const tessel::model::ModelConfig& cfg,
                                    const tessel::model::Transformer& net, const StepStats& st) {
  const double rss_mb = peak_rss_mb();
  const double flops = step_matmul_flops(cfg, a.B, a.T);
  const double ms_med = median(st.step_ms);
  nlohmann::ordered_json out = {
      {"side", "tessel"},
      {"model", a.model},
      {"backend", a.backend_name},
      {"gemm_provider", tessel::kernels::gemm_provider()},
      {"params", net.num_params()},
      {"B", a.B},
      {"precision", a.precision},
      {"T", a.T},
      {"steps", a.steps},
      {"ms_median", ms_med},
      {"ms_mean", mean(st.step_ms)},
      {"ms_min", *std::min_element(st.step_ms.begin(), st.step_ms.end())},
      {"cpu_ms_median", median(st.cpu_ms)},
      {"step_gflop", flops / 1e9},
      {"gflops", flops / (ms_med * 1e6)},
      {"peak_rss_mb", rss_mb},
      {"first_loss", st.losses.front()},
      {"last_loss", st.losses.back()},
      {"clipped_steps", st.clipped},
      {"activation_mb", double(net.activation_bytes()) / (1 << 20)},
  };
  std::fprintf(stderr,
               "tessel %s: median %.1f ms/step, mean %.1f, min %.1f, cpu %.1f; %.1f GFLOP/step "
               "-> %.1f GFLOP/s; peak RSS %.0f MB\n",
               a.model.c_str(), ms_med, mean(st.step_ms), out["ms_min"].get<double>(),
               median(st.cpu_ms), flops / 1e9, flops / (ms_med * 1e6), rss_mb);
  return out;
}

nlohmann::ordered_json phase_report(const StepStats& st) {
  std::fprintf(stderr, "  phases (median ms):");
  nlohmann::ordered_json phases;
  for (int p = 0; p < kNumPhases; ++p) {
    const double med = median(st.phase_ms[size_t(p)]);
    phases[kPhaseNames[p]] = med;
    std::fprintf(stderr, " %s %.1f", kPhaseNames[p], med);
  }
  std::fprintf(stderr, "\n");
  return phases;
}

// Per-op totals, averaged per timed step, largest first; GEMM rates for the linear ops.
nlohmann::ordered_json op_report(TimedBackend& backend, int steps, double ms_med) {
  std::vector<std::pair<double, std::string>> ops;
  for (const auto& [op, t] : backend.totals) ops.emplace_back(t.ms / steps, op);
  std::sort(ops.rbegin(), ops.rend());
  nlohmann::ordered_json ops_json;
  std::fprintf(stderr, "  ops (ms per step):\n");
  for (const auto& [ms, op] : ops) {
    const double flops = backend.totals[op].flops;
    ops_json[op] = ms;
    std::fprintf(stderr, "    %-28s %8.2f  (%4.1f%%)", op.c_str(), ms, 100.0 * ms / ms_med);
    if (flops > 0) {
      std::fprintf(stderr, "  %6.1f GFLOP/s", flops / (backend.totals[op].ms * 1e6));
    }
    std::fprintf(stderr, "\n");
  }
  return ops_json;
}

void add_gemm_peak(const tessel::model::ModelConfig& cfg, const BenchArgs& a, double ms_med,
                   nlohmann::ordered_json& out) {
  const double flops = step_matmul_flops(cfg, a.B, a.T);
  const GemmPeak gp = measure_gemm_peak(cfg, a.B * a.T);
  out["gemm_peak_gflops"] = gp.gflops;
  out["gemm_peak_provider"] = gp.provider;
  out["gemm_peak_shape"] = gp.shape;
  out["gemm_bf16_vs_fp32"] = gp.bf16_vs_fp32;
  out["gemm_bf16_native"] = tessel::kernels::gemm_bf16_native();
  out["gemm_table"] = gp.table;
  std::fprintf(stderr, "  sgemm peak %.1f GFLOP/s (%s, %s); tessel's step runs at %.0f%% of it\n",
               gp.gflops, gp.provider.c_str(), gp.shape.c_str(),
               100.0 * flops / (ms_med * 1e6) / gp.gflops);
}

int run(const BenchArgs& a) {
  namespace k = tessel::kernels;
  const tessel::model::ModelConfig cfg = bench_config(a.model);
  if (cfg.family != tessel::model::Family::gpt2) {
    // step_matmul_flops counts GPT-2 blocks (fused QKV, 2-matrix MLP, tied head).
    std::fprintf(stderr, "bench_step: '%s' is not a gpt2-family model; pick a gpt2 preset\n",
                 a.model.c_str());
    return 2;
  }
  auto inner = k::make_backend(a.backend_name);
  TimedBackend backend(*inner);
  tessel::model::Transformer net(cfg, backend, a.B, a.T);
  net.init(a.seed);
  net.set_bf16_matmuls(a.precision == "bf16");
  const Batch batch = random_batch(cfg, a.B * a.T, a.seed);
  Adam adam = make_adam(backend, net.num_params());
  StepStats stats;
  if (!run_steps(a, net, backend, batch, adam, stats)) return 1;

  nlohmann::ordered_json out = step_summary(a, cfg, net, stats);
  const double ms_med = median(stats.step_ms);
  out["phases_ms"] = phase_report(stats);
  out["ops_ms"] = op_report(backend, a.steps, ms_med);
  if (a.gemm_peak) add_gemm_peak(cfg, a, ms_med, out);
  backend.deallocate(adam.m);
  backend.deallocate(adam.v);
  std::printf("%s\n", out.dump().c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Times tessel's training step (see bench/README.md)"};
  BenchArgs args;
  add_options(app, args);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: %s\n", e.what());
    return 1;
  }
}
