// ModelConfig: the architecture hyper-parameters of a GPT-2 or LLaMA style decoder.
//
// One struct describes both families; `family` selects the block flavour:
//   gpt2:  learned positions, pre-LayerNorm, fused QKV (n_kv_head == n_head), GELU MLP, biases.
//   llama: RoPE, pre-RMSNorm, grouped-query attention, SwiGLU MLP, no biases.
// Named presets cover the tiny test models and the published sizes. validate() checks the
// invariants the model code relies on and throws ConfigError naming the field and the fix.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::model {

enum class Family { gpt2, llama };

// "gpt2" / "llama".
std::string_view family_name(Family f);
// Parses a family name; throws ConfigError listing the known names.
Family parse_family(std::string_view name);

struct ModelConfig {
  std::string name;  // preset name or a user label; used in error messages
  Family family = Family::gpt2;
  int n_layer = 0;
  int n_embd = 0;
  int n_head = 0;
  int n_kv_head = 0;  // == n_head for gpt2; divides n_head for llama (GQA)
  int ffn_hidden = 0;
  int vocab_size = 0;  // real vocabulary; the embedding and head have padded_vocab() rows
  int max_seq_len = 0;
  float norm_eps = 1e-5f;       // LayerNorm (gpt2) or RMSNorm (llama) epsilon
  float rope_theta = 10000.0f;  // llama only
  bool tie_embeddings = true;   // head reuses the token embedding
  bool bias = true;             // biases in linears and LayerNorms (gpt2 only)

  // The vocabulary rounded up to a multiple of 128 (GEMM-friendly; the extra rows are padding
  // that the loss ignores).
  int padded_vocab() const;
  int head_dim() const;
  // Number of parameters with the padded vocabulary, counting a tied embedding once.
  int64_t num_params() const;
  // Throws ConfigError naming the offending field and how to fix it.
  void validate() const;

  // A named preset; throws ConfigError listing the known names for an unknown one.
  static ModelConfig preset(std::string_view name);
  // What a model of `family` has unless told otherwise (no sizes): gpt2 has biases and a tied
  // head; llama has neither (RMSNorm, SwiGLU and RoPE follow from the family itself).
  static ModelConfig family_defaults(Family family);
  // The MLP width a family uses for n_embd C when none is given: gpt2 4C; llama 2/3 of 4C rounded
  // up to a multiple of 256 (Meta's rule: 4096 -> 11008).
  static int default_ffn_hidden(Family family, int n_embd);
  static std::vector<std::string> preset_names();
};

}  // namespace tessel::model
