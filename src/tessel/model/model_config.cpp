#include "tessel/model/model_config.h"

#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include "tessel/core/check.h"

namespace tessel::model {

std::string_view family_name(Family f) {
  switch (f) {
    case Family::gpt2:
      return "gpt2";
    case Family::llama:
      return "llama";
  }
  return "?";
}

Family parse_family(std::string_view name) {
  if (name == "gpt2") return Family::gpt2;
  if (name == "llama") return Family::llama;
  TESSEL_THROW(ConfigError, "unknown model family '{}' (known: gpt2, llama)", name);
}

int ModelConfig::padded_vocab() const {
  return (vocab_size + 127) / 128 * 128;
}

int ModelConfig::head_dim() const {
  return n_head > 0 ? n_embd / n_head : 0;
}

int64_t ModelConfig::num_params() const {
  const int64_t C = n_embd, F = ffn_hidden, Vp = padded_vocab(), L = n_layer;
  const int64_t kv = int64_t(n_kv_head) * head_dim();
  int64_t total = Vp * C;  // token embedding
  int64_t per_layer = 0;
  if (family == Family::gpt2) {
    const int64_t b = bias ? 1 : 0;
    total += int64_t(max_seq_len) * C;   // learned positions
    per_layer += 2 * (C + b * C);        // ln_1, ln_2
    per_layer += 3 * C * C + b * 3 * C;  // c_attn
    per_layer += C * C + b * C;          // attn.c_proj
    per_layer += F * C + b * F;          // c_fc
    per_layer += C * F + b * C;          // mlp.c_proj
    total += C + b * C;                  // ln_f
  } else {
    per_layer += 2 * C;                       // input / post-attention RMSNorm
    per_layer += C * C + 2 * kv * C + C * C;  // q, k, v, o
    per_layer += 3 * F * C;                   // gate, up, down
    total += C;                               // final norm
  }
  total += L * per_layer;
  if (!tie_embeddings) total += Vp * C;  // separate head
  return total;
}

void ModelConfig::validate() const {
  const std::string_view n = name.empty() ? std::string_view("<unnamed>") : name;
  auto positive = [&](int value, const char* field) {
    TESSEL_CHECK(value > 0, ConfigError, "model '{}': {} is {}; it must be a positive integer", n,
                 field, value);
  };
  positive(n_layer, "n_layer");
  positive(n_embd, "n_embd");
  positive(n_head, "n_head");
  positive(n_kv_head, "n_kv_head");
  positive(ffn_hidden, "ffn_hidden");
  positive(vocab_size, "vocab_size");
  positive(max_seq_len, "max_seq_len");
  TESSEL_CHECK(vocab_size <= std::numeric_limits<int>::max() - 127, ConfigError,
               "model '{}': vocab_size {} is too large; it must fit a 32-bit token id", n,
               vocab_size);
  TESSEL_CHECK(std::isfinite(norm_eps) && norm_eps > 0, ConfigError,
               "model '{}': norm_eps is {}; set a small positive value such as 1e-5", n, norm_eps);
  TESSEL_CHECK(n_embd % n_head == 0, ConfigError,
               "model '{}': n_embd {} is not divisible by n_head {}; choose n_head dividing n_embd",
               n, n_embd, n_head);
  TESSEL_CHECK(n_head % n_kv_head == 0, ConfigError,
               "model '{}': n_head {} is not divisible by n_kv_head {}; choose n_kv_head dividing "
               "n_head",
               n, n_head, n_kv_head);
  if (family == Family::gpt2) {
    TESSEL_CHECK(n_kv_head == n_head, ConfigError,
                 "model '{}': gpt2 uses a fused QKV projection, so n_kv_head ({}) must equal "
                 "n_head ({}); use the llama family for grouped-query attention",
                 n, n_kv_head, n_head);
  } else {
    TESSEL_CHECK(!bias, ConfigError,
                 "model '{}': the llama family has no biases; set bias to false", n);
    TESSEL_CHECK(head_dim() % 2 == 0, ConfigError,
                 "model '{}': head_dim {} (n_embd / n_head) must be even for rotary embeddings; "
                 "change n_embd or n_head",
                 n, head_dim());
    TESSEL_CHECK(std::isfinite(rope_theta) && rope_theta > 0, ConfigError,
                 "model '{}': rope_theta is {}; set a positive base such as 10000", n, rope_theta);
  }
}

namespace {

ModelConfig gpt2(std::string name, int L, int C, int H, int V, int seq) {
  ModelConfig c;
  c.name = std::move(name);
  c.family = Family::gpt2;
  c.n_layer = L;
  c.n_embd = C;
  c.n_head = H;
  c.n_kv_head = H;
  c.ffn_hidden = 4 * C;
  c.vocab_size = V;
  c.max_seq_len = seq;
  c.norm_eps = 1e-5f;
  c.tie_embeddings = true;
  c.bias = true;
  return c;
}

ModelConfig llama(std::string name, int L, int C, int H, int KV, int F, int V, int seq,
                  float theta) {
  ModelConfig c;
  c.name = std::move(name);
  c.family = Family::llama;
  c.n_layer = L;
  c.n_embd = C;
  c.n_head = H;
  c.n_kv_head = KV;
  c.ffn_hidden = F;
  c.vocab_size = V;
  c.max_seq_len = seq;
  c.norm_eps = 1e-5f;
  c.rope_theta = theta;
  c.tie_embeddings = false;
  c.bias = false;
  return c;
}

// Byte-level tokenizer: 256 bytes + end-of-text.
constexpr int kByteVocab = 257;
constexpr int kGpt2Vocab = 50257;

const std::map<std::string, std::function<ModelConfig()>, std::less<>>& presets() {
  static const std::map<std::string, std::function<ModelConfig()>, std::less<>> table = {
      {"gpt2-tiny", [] { return gpt2("gpt2-tiny", 6, 32, 4, kByteVocab, 64); }},
      {"llama-tiny", [] { return llama("llama-tiny", 6, 32, 4, 2, 64, kByteVocab, 64, 1e4f); }},
      {"gpt2-124m", [] { return gpt2("gpt2-124m", 12, 768, 12, kGpt2Vocab, 1024); }},
      {"gpt2-350m", [] { return gpt2("gpt2-350m", 24, 1024, 16, kGpt2Vocab, 1024); }},
      {"gpt2-1.5b", [] { return gpt2("gpt2-1.5b", 48, 1600, 25, kGpt2Vocab, 1024); }},
      {"gpt3-175b", [] { return gpt2("gpt3-175b", 96, 12288, 96, kGpt2Vocab, 2048); }},
      {"llama2-7b", [] { return llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 1e4f); }},
      {"llama3-8b", [] { return llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 5e5f); }},
  };
  return table;
}

}  // namespace

ModelConfig ModelConfig::family_defaults(Family family) {
  ModelConfig c;
  c.family = family;
  c.norm_eps = 1e-5f;
  c.rope_theta = 1e4f;
  c.tie_embeddings = family == Family::gpt2;
  c.bias = family == Family::gpt2;
  return c;
}

int ModelConfig::default_ffn_hidden(Family family, int n_embd) {
  if (family == Family::gpt2) return 4 * n_embd;
  const int hidden = (2 * 4 * n_embd + 2) / 3;  // 2/3 of 4C, rounded up
  return (hidden + 255) / 256 * 256;
}

ModelConfig ModelConfig::preset(std::string_view name) {
  const auto& table = presets();
  auto it = table.find(name);
  if (it == table.end()) {
    std::string known;
    for (const auto& p : preset_names()) known += (known.empty() ? "" : ", ") + p;
    TESSEL_THROW(ConfigError, "unknown model preset '{}' (known: {})", name, known);
  }
  ModelConfig c = it->second();
  c.validate();
  return c;
}

std::vector<std::string> ModelConfig::preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, make] : presets()) names.push_back(name);
  return names;
}

}  // namespace tessel::model
