#include "tessel/model/decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tessel/core/check.h"

namespace tessel::model {

using kernels::Op;

namespace {


// Below this many multiply-adds an attention call runs on the calling thread: a parallel region
// costs more than it saves (a step of a tiny model).
constexpr int64_t kParallelAttentionMin = int64_t(1) << 15;

// out[D] = softmax(scale q · K[0, len)^T) · V[0, len) for one query head over one kv head's cache
// rows (consecutive, D floats apart); `scores` holds len floats of scratch.
void attend_one(float* out, const float* q, const float* K, const float* V, int len, int D,
                float scale, float* scores) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < len; ++j) {
    const float* kj = K + int64_t(j) * D;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < D; ++d) dot += q[d] * kj[d];
    scores[j] = dot * scale;
    mx = std::max(mx, scores[j]);
  }
  float sum = 0.0f;
  for (int j = 0; j < len; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  const float inv = 1.0f / sum;
  std::fill_n(out, D, 0.0f);
  for (int j = 0; j < len; ++j) {
    const float pj = scores[j] * inv;
    const float* vj = V + int64_t(j) * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) out[d] += pj * vj[d];
  }
}

}  // namespace

Decoder::Decoder(const ModelConfig& config, kernels::Backend& backend, DecoderOptions options)
    : config_(config), backend_(backend) {
  build(options);
}

Decoder::Decoder(const ModelConfig& config, std::string_view backend_name, DecoderOptions options)
    : config_(config), own_backend_(kernels::make_backend(backend_name)), backend_(*own_backend_) {
  build(options);
}

void Decoder::build(const DecoderOptions& options) {
  config_.validate();
  max_len_ = options.max_len == 0 ? config_.max_seq_len : options.max_len;
  TESSEL_CHECK(max_len_ >= 1 && max_len_ <= config_.max_seq_len, ConfigError,
               "decoder max_len {} must be in [1, max_seq_len = {}] for model '{}'",
               options.max_len, config_.max_seq_len, config_.name);
  TESSEL_CHECK(options.prefill_chunk >= 1, ConfigError,
               "decoder prefill_chunk is {}; it must be at least 1", options.prefill_chunk);
  chunk_ = std::min(options.prefill_chunk, max_len_);
  TESSEL_CHECK(backend_.device() == kernels::DeviceKind::cpu, UnsupportedError,
               "the decoder's attention over the KV cache runs on host memory; backend '{}' is "
               "not a host backend: use the cpu backend",
               backend_.name());
  const bool gpt2 = config_.family == Family::gpt2;
  std::vector<Op> needed = {Op::embedding, Op::linear, Op::residual};
  if (gpt2) {
    needed.insert(needed.end(), {Op::layernorm, Op::gelu});
  } else {
    needed.insert(needed.end(), {Op::rmsnorm, Op::swiglu});
  }
  for (Op op : needed) {
    TESSEL_CHECK(backend_.supports(op), UnsupportedError,
                 "backend '{}' does not support op '{}', which the {} family needs; use the cpu "
                 "backend",
                 backend_.name(), kernels::op_name(op), family_name(config_.family));
  }

  spec_ = ModelSpec::from(config_);
  for (const ParamSpec& ps : spec_) {
    offsets_.push_back(num_params_);
    num_params_ += ps.numel();
  }
  {
    ParamOffsets o = param_offsets(spec_, 0, config_.n_layer, offsets_);
    layer_off_ = std::move(o.layer);
    wte_off_ = o.wte, wpe_off_ = o.wpe, lnf_w_off_ = o.lnf_w, lnf_b_off_ = o.lnf_b;
    head_off_ = o.head;
  }

  const int64_t C = config_.n_embd, D = config_.head_dim(), F = config_.ffn_hidden;
  const int64_t Hq = config_.n_head, Hkv = config_.n_kv_head, rows = chunk_;
  params_ = allocate_floats(std::max<int64_t>(num_params_, 1));
  backend_.memset_zero(params_, size_t(num_params_) * sizeof(float));
  const int64_t cache_floats = 2 * int64_t(config_.n_layer) * Hkv * max_len_ * D;
  cache_ = allocate_floats(cache_floats);
  // Touched now, so that generation does not pay the page faults token by token.
  backend_.memset_zero(cache_, size_t(cache_floats) * sizeof(float));
  tokens_ = static_cast<int32_t*>(backend_.allocate(size_t(rows) * sizeof(int32_t)));
  owned_.emplace_back(tokens_, BackendFree{&backend_});
  x_ = allocate_floats(rows * C);
  ln_ = allocate_floats(rows * C);
  mean_ = allocate_floats(rows);
  rstd_ = allocate_floats(rows);
  qkv_ = allocate_floats(rows * (Hq + 2 * Hkv) * D);
  atty_ = allocate_floats(rows * Hq * D);
  proj_ = allocate_floats(rows * C);
  fc_ = allocate_floats(rows * F);
  if (!gpt2) up_ = allocate_floats(rows * F);
  act_ = allocate_floats(rows * F);
  lnf_ = allocate_floats(C);
  logits_ = allocate_floats(config_.padded_vocab());
  logits_host_.resize(size_t(config_.vocab_size));

  if (!gpt2) {
    // The reference rope kernel's angles: theta^(-2i/D) and t times it, in double.
    const int half = int(D / 2);
    rope_cos_.resize(size_t(max_len_) * size_t(half));
    rope_sin_.resize(size_t(max_len_) * size_t(half));
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(double(config_.rope_theta), -2.0 * i / double(D));
      for (int t = 0; t < max_len_; ++t) {
        const double angle = t * inv_freq;
        rope_cos_[size_t(t) * half + size_t(i)] = std::cos(angle);
        rope_sin_[size_t(t) * half + size_t(i)] = std::sin(angle);
      }
    }
  }
}

float* Decoder::allocate_floats(int64_t n) {
  owned_.reserve(owned_.size() + 1);  // so that emplace_back cannot throw after the allocation
  void* ptr = backend_.allocate(size_t(std::max<int64_t>(n, 1)) * sizeof(float));
  owned_.emplace_back(ptr, BackendFree{&backend_});
  return static_cast<float*>(ptr);
}

Tensor Decoder::params() const {
  return Tensor::wrap(params_, Shape{num_params_});
}

Tensor Decoder::param(std::string_view name) const {
  const ParamSpec& ps = spec_.at(name);
  return Tensor::wrap(params_ + offsets_[size_t(spec_.index_of(ps.name))], ps.shape);
}

void Decoder::load(const ParamReader& read) {
  std::vector<float> staging;
  for (size_t i = 0; i < spec_.size(); ++i) {
    const ParamSpec& ps = spec_[i];
    staging.assign(size_t(ps.numel()), 0.0f);
    read(ps, staging.data());
    backend_.copy_from_host(params_ + offsets_[i], staging.data(), staging.size() * sizeof(float));
  }
  reset();
}

void Decoder::reset() {
  position_ = 0;
}

void Decoder::check_tokens(std::span<const int32_t> tokens, int64_t first) const {
  for (size_t i = 0; i < tokens.size(); ++i) {
    TESSEL_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab_size, InvalidArgumentError,
                 "token id {} at position {} is outside the vocabulary [0, {}) of model '{}'",
                 tokens[i], first + int64_t(i), config_.vocab_size, config_.name);
  }
}

std::span<const float> Decoder::prefill(std::span<const int32_t> tokens) {
  TESSEL_CHECK(!tokens.empty(), InvalidArgumentError,
               "prefill needs at least one token; the prompt is empty");
  TESSEL_CHECK(tokens.size() <= size_t(max_len_), InvalidArgumentError,
               "the prompt has {} tokens but the context holds {} (max_seq_len {} of model '{}'); "
               "shorten the prompt",
               tokens.size(), max_len_, config_.max_seq_len, config_.name);
  check_tokens(tokens, 0);
  reset();
  const int n = int(tokens.size());
  int last = 0;
  for (int begin = 0; begin < n; begin += chunk_) {
    last = std::min(chunk_, n - begin);
    forward_rows(tokens.data() + begin, last);
  }
  return head(last - 1);
}

std::span<const float> Decoder::step(int32_t token) {
  TESSEL_CHECK(position_ < max_len_, InvalidArgumentError,
               "the context is full: {} tokens of at most {} (max_seq_len {} of model '{}'); no "
               "further token fits",
               position_, max_len_, config_.max_seq_len, config_.name);
  check_tokens(std::span<const int32_t>(&token, 1), position_);
  forward_rows(&token, 1);
  return head(0);
}

void Decoder::forward_rows(const int32_t* tokens, int n) {
  const int C = config_.n_embd, Vp = config_.padded_vocab();
  backend_.copy_from_host(tokens_, tokens, size_t(n) * sizeof(int32_t));
  // The embedding kernel adds position row t to token t of its block; offsetting the table makes
  // the block start at position_.
  const float* wpe = wpe_off_ < 0 ? nullptr : p(wpe_off_) + int64_t(position_) * C;
  backend_.embedding_forward(x_, tokens_, p(wte_off_), wpe, 1, n, C, 0, Vp);
  for (int l = 0; l < config_.n_layer; ++l) block(l, n);
  position_ += n;
}

// The blocks of Transformer::gpt2_block_forward / llama_block_forward on n rows, the residual
// stream updated in place.
void Decoder::block(int l, int n) {
  const int C = config_.n_embd, F = config_.ffn_hidden, D = config_.head_dim();
  const int Hq = config_.n_head, Hkv = config_.n_kv_head;
  const int64_t nc = int64_t(n) * C, nf = int64_t(n) * F;
  const std::vector<int64_t>& o = layer_off_[size_t(l)];
  auto w = [&](LayerParam k) { return p(o[size_t(k)]); };
  using LP = LayerParam;
  if (config_.family == Family::gpt2) {
    backend_.layernorm_forward(ln_, mean_, rstd_, x_, w(LP::norm1_weight), w(LP::norm1_bias), n, C,
                               config_.norm_eps);
    backend_.linear_forward(qkv_, ln_, w(LP::qkv_weight), w(LP::qkv_bias), n, C, 3 * C);
    append_kv(l, qkv_ + C, qkv_ + 2 * C, n, 3 * C, 3 * C);
    attend(l, qkv_, n, 3 * C);
    backend_.linear_forward(proj_, atty_, w(LP::attn_out_weight), w(LP::attn_out_bias), n, C, C);
    backend_.residual_forward(x_, x_, proj_, nc);
    backend_.layernorm_forward(ln_, mean_, rstd_, x_, w(LP::norm2_weight), w(LP::norm2_bias), n, C,
                               config_.norm_eps);
    backend_.linear_forward(fc_, ln_, w(LP::mlp_in_weight), w(LP::mlp_in_bias), n, C, F);
    backend_.gelu_forward(act_, fc_, nf);
    backend_.linear_forward(proj_, act_, w(LP::mlp_out_weight), w(LP::mlp_out_bias), n, F, C);
    backend_.residual_forward(x_, x_, proj_, nc);
    return;
  }
  const int QD = Hq * D, KD = Hkv * D;
  float* q = qkv_;
  float* k = q + int64_t(n) * QD;
  float* v = k + int64_t(n) * KD;
  backend_.rmsnorm_forward(ln_, rstd_, x_, w(LP::norm1_weight), n, C, config_.norm_eps);
  backend_.linear_forward(q, ln_, w(LP::q_weight), nullptr, n, C, QD);
  backend_.linear_forward(k, ln_, w(LP::k_weight), nullptr, n, C, KD);
  backend_.linear_forward(v, ln_, w(LP::v_weight), nullptr, n, C, KD);
  rope(q, n, Hq, QD);
  rope(k, n, Hkv, KD);
  append_kv(l, k, v, n, KD, KD);
  attend(l, q, n, QD);
  backend_.linear_forward(proj_, atty_, w(LP::attn_out_weight), nullptr, n, QD, C);
  backend_.residual_forward(x_, x_, proj_, nc);
  backend_.rmsnorm_forward(ln_, rstd_, x_, w(LP::norm2_weight), n, C, config_.norm_eps);
  backend_.linear_forward(fc_, ln_, w(LP::mlp_in_weight), nullptr, n, C, F);
  backend_.linear_forward(up_, ln_, w(LP::mlp_up_weight), nullptr, n, C, F);
  backend_.swiglu_forward(act_, fc_, up_, nf);
  backend_.linear_forward(proj_, act_, w(LP::mlp_out_weight), nullptr, n, F, C);
  backend_.residual_forward(x_, x_, proj_, nc);
}

void Decoder::rope(float* x, int n, int H, int64_t stride) const {
  const int D = config_.head_dim(), half = D / 2;
  for (int i = 0; i < n; ++i) {
    const double* c = rope_cos_.data() + size_t(position_ + i) * size_t(half);
    const double* s = rope_sin_.data() + size_t(position_ + i) * size_t(half);
    float* row = x + int64_t(i) * stride;
    for (int h = 0; h < H; ++h) {
      float* x1 = row + int64_t(h) * D;
      float* x2 = x1 + half;
      for (int j = 0; j < half; ++j) {
        const double a = x1[j], b = x2[j];
        x1[j] = float(a * c[j] - b * s[j]);
        x2[j] = float(b * c[j] + a * s[j]);
      }
    }
  }
}

void Decoder::append_kv(int l, const float* k, const float* v, int n, int64_t k_stride,
                        int64_t v_stride) {
  const int D = config_.head_dim(), Hkv = config_.n_kv_head;
  const int64_t head_floats = int64_t(max_len_) * D;
  float* K = cache_ + int64_t(l) * 2 * Hkv * head_floats;
  float* V = K + Hkv * head_floats;
  for (int i = 0; i < n; ++i) {
    const int64_t t = position_ + i;
    for (int g = 0; g < Hkv; ++g) {
      std::copy_n(k + i * k_stride + int64_t(g) * D, D, K + g * head_floats + t * D);
      std::copy_n(v + i * v_stride + int64_t(g) * D, D, V + g * head_floats + t * D);
    }
  }
}

void Decoder::attend(int l, const float* q, int n, int64_t q_stride) {
  const int D = config_.head_dim(), Hq = config_.n_head, Hkv = config_.n_kv_head;
  const int group = Hq / Hkv;
  const int64_t head_floats = int64_t(max_len_) * D;
  const float* K = cache_ + int64_t(l) * 2 * Hkv * head_floats;
  const float* V = K + Hkv * head_floats;
  const float scale = float(1.0 / std::sqrt(double(D)));
  const int first = position_;
  const int64_t work = int64_t(n) * Hq * (first + n) * D;
#pragma omp parallel if (work > kParallelAttentionMin)
  {
    std::vector<float> scores(size_t(first + n));
#pragma omp for collapse(2) schedule(static)
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < Hq; ++h) {
        // Query head h uses kv head h / (Hq / Hkv), as the training attention does.
        const int64_t g = h / group;
        attend_one(atty_ + int64_t(i) * Hq * D + int64_t(h) * D, q + i * q_stride + int64_t(h) * D,
                   K + g * head_floats, V + g * head_floats, first + i + 1, D, scale,
                   scores.data());
      }
    }
  }
}

std::span<const float> Decoder::head(int row) {
  const int C = config_.n_embd, Vp = config_.padded_vocab();
  const float* x = x_ + int64_t(row) * C;
  if (config_.family == Family::gpt2) {
    backend_.layernorm_forward(lnf_, mean_, rstd_, x, p(lnf_w_off_), p(lnf_b_off_), 1, C,
                               config_.norm_eps);
  } else {
    backend_.rmsnorm_forward(lnf_, rstd_, x, p(lnf_w_off_), 1, C, config_.norm_eps);
  }
  backend_.linear_forward(logits_, lnf_, p(head_off_), nullptr, 1, C, Vp);
  backend_.copy_to_host(logits_host_.data(), logits_, logits_host_.size() * sizeof(float));
  return logits_host_;
}

}  // namespace tessel::model
