// Decoder: inference-only forward of a whole GPT-2 or LLaMA model with a KV cache, for text
// generation (`tessel generate`).
//
// The computation is the Transformer's forward (transformer.h) row by row: the same parameters in
// the same flat ModelSpec layout, the same kernels through the Backend for the embedding, norms,
// linears, activations and residual adds. Two parts are the decoder's own, on host memory:
//   - attention of new query rows over the cache (a row at position p attends to positions
//     0..p). The training attention kernel cannot serve it: it attends within one [T] block that
//     starts at position 0 and keeps the [Hq, T, T] probabilities for backward (2 GiB for a 7B
//     model at 4096 tokens), where decoding needs one query against keys computed in earlier
//     calls;
//   - RoPE at an absolute position: the Backend's rope rotates token t of a block by angle t, so
//     it only fits a block that starts at position 0. The decoder rotates with a [max_len, D/2]
//     cos/sin table in double, the reference kernel's arithmetic.
// Hence the decoder needs a backend whose memory the host can read (DeviceKind::cpu).
//
// Why not a Transformer built with B = 1: it allocates a gradient buffer as large as the
// parameters and, for T = max_len, activations for backward (probabilities of every layer);
// the decoder holds the parameters once, the cache, and scratch for one prefill chunk.
//
// Memory: parameters (num_params floats, padded vocabulary included), the KV cache
// 2 n_layer n_kv_head max_len head_dim floats ([n_kv_head, max_len, head_dim] for K and for V per
// layer), and scratch for prefill_chunk rows.
//
// Cost: prefill of n tokens is one pass of n rows (in chunks); step() is one row: the weight
// GEMVs plus attention over the `position()` cached keys -- the prefix is never recomputed. Only
// the last row goes through the head.
//
// Context limit: positions run from 0 to max_len - 1. A prompt longer than max_len, or a step
// at position max_len, throws InvalidArgumentError naming both numbers; callers that generate
// stop at max_len() themselves (the CLI does, with a notice).
// Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "tessel/kernels/backend.h"
#include "tessel/model/model_config.h"
#include "tessel/model/model_spec.h"
#include "tessel/tensor/tensor.h"

namespace tessel::model {

struct DecoderOptions {
  // Positions the KV cache holds, in [1, max_seq_len]; 0 means max_seq_len. A generator that
  // knows it needs fewer (prompt + new tokens) saves the rest of the cache's memory.
  int max_len = 0;
  // Rows of one prefill pass (>= 1): bounds the scratch memory, not the prompt length.
  int prefill_chunk = 256;
};

class Decoder {
 public:
  // Validates the config; throws ConfigError for an invalid one or for options out of range,
  // UnsupportedError for a backend that lacks an op the family needs or whose memory is not host
  // memory. Parameters start at zero: fill them with load() (or write params()). The backend must
  // outlive the decoder.
  Decoder(const ModelConfig& config, kernels::Backend& backend, DecoderOptions options = {});
  // The same on a backend made by name (kernels::make_backend: "cpu", "reference") and owned by
  // the decoder; also throws ConfigError for an unknown name.
  Decoder(const ModelConfig& config, std::string_view backend_name, DecoderOptions options = {});
  ~Decoder() = default;
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  const ModelConfig& config() const { return config_; }
  const ModelSpec& spec() const { return spec_; }
  int max_len() const { return max_len_; }
  // Tokens in the cache: the position the next step() writes.
  int position() const { return position_; }

  int64_t num_params() const { return num_params_; }
  // Flat [num_params] view of the parameters in ModelSpec order: the layout of a whole-model
  // Transformer's params(), so one can be copied into the other.
  Tensor params() const;
  // One parameter; throws InvalidArgumentError for a name the model lacks.
  Tensor param(std::string_view name) const;
  // Fills every parameter: read(p, out) writes p.numel() floats of parameter p (tessel's layout,
  // model_spec.h) to the host buffer `out`. Resets the cache.
  using ParamReader = std::function<void(const ParamSpec& p, float* out)>;
  void load(const ParamReader& read);

  // Empties the cache (position 0).
  void reset();
  // Resets the cache, runs `tokens` (1 to max_len() ids in [0, vocab_size)) from position 0 and
  // returns the logits of the last one over the real vocabulary (vocab_size floats). Throws
  // InvalidArgumentError for an empty prompt, a prompt longer than max_len() or an id out of
  // range (before anything runs). The span is valid until the next call.
  std::span<const float> prefill(std::span<const int32_t> tokens);
  // Runs one token at position(), appends its keys and values, and returns its logits
  // (vocab_size floats; valid until the next call). Throws InvalidArgumentError when the cache is
  // full (position() == max_len()) or for an id out of range.
  std::span<const float> step(int32_t token);

 private:
  struct BackendFree {
    kernels::Backend* backend;
    void operator()(void* ptr) const { backend->deallocate(ptr); }
  };
  using Owned = std::unique_ptr<void, BackendFree>;
  // The constructors' shared part.
  void build(const DecoderOptions& options);
  float* allocate_floats(int64_t n);
  // Throws InvalidArgumentError for an id out of range (`first`: the position of tokens[0]).
  void check_tokens(std::span<const int32_t> tokens, int64_t first) const;
  // Runs n rows at positions position_ .. position_ + n - 1 through every block, appending their
  // keys and values to the cache; leaves the block output in x_.
  void forward_rows(const int32_t* tokens, int n);
  void block(int l, int n);
  // Rotates n rows of H heads (row stride `stride`) at positions position_ + i.
  void rope(float* x, int n, int H, int64_t stride) const;
  // Appends n rows of k and v (row strides k_stride, v_stride) to layer l's cache.
  void append_kv(int l, const float* k, const float* v, int n, int64_t k_stride, int64_t v_stride);
  // atty_[n, Hq D] = attention of n query rows (row stride q_stride) over layer l's cache.
  void attend(int l, const float* q, int n, int64_t q_stride);
  std::span<const float> head(int row);
  float* p(int64_t off) const { return off < 0 ? nullptr : params_ + off; }

  ModelConfig config_;
  std::unique_ptr<kernels::Backend> own_backend_;  // when made by name; before backend_
  kernels::Backend& backend_;
  ModelSpec spec_;
  int max_len_ = 0;
  int chunk_ = 0;
  int position_ = 0;

  std::vector<int64_t> offsets_;  // per spec_ entry, in floats
  int64_t num_params_ = 0;
  std::vector<std::vector<int64_t>> layer_off_;  // [layer][LayerParam], -1 when absent
  int64_t wte_off_ = -1, wpe_off_ = -1, lnf_w_off_ = -1, lnf_b_off_ = -1, head_off_ = -1;

  std::vector<Owned> owned_;
  float* params_ = nullptr;
  float* cache_ = nullptr;  // per layer: K [Hkv, max_len, D] then V [Hkv, max_len, D]
  // Scratch for chunk_ rows.
  int32_t* tokens_ = nullptr;
  float* x_ = nullptr;     // [chunk, C] residual stream
  float* ln_ = nullptr;    // [chunk, C] norm output
  float* mean_ = nullptr;  // [chunk] norm statistics (unused beyond the kernel call)
  float* rstd_ = nullptr;
  float* qkv_ = nullptr;   // [chunk, (Hq + 2 Hkv) D]
  float* atty_ = nullptr;  // [chunk, Hq D]
  float* proj_ = nullptr;  // [chunk, C]
  float* fc_ = nullptr;    // [chunk, F] each
  float* up_ = nullptr;
  float* act_ = nullptr;
  float* lnf_ = nullptr;                     // [C] final norm of the last row
  float* logits_ = nullptr;                  // [Vp]
  std::vector<double> rope_cos_, rope_sin_;  // [max_len, D/2] (llama)
  std::vector<float> logits_host_;           // [vocab_size]
};

}  // namespace tessel::model
