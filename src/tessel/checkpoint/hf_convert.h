// Conversion between tessel checkpoints and Hugging Face safetensors models (GPT-2 and LLaMA).
//
// The tessel side is a store checkpoint (store/checkpoint_store.h) of the *parameter naming
// convention*:
//   - manifest meta: {"model": ModelConfig as JSON (config/model_json.h), "step": int, ...};
//   - one tensor per parameter, named by ModelSpec (model/model_spec.h: Hugging Face names with
//     GPT-2's "transformer." prefix), of ModelSpec's shape: Linear weights [out, in], embedding
//     and untied head with padded_vocab() rows (rows >= vocab_size are padding), f32;
//   - optimizer state, if any, as "<name>/adam_m", "<name>/adam_v" (layout::state_name); it stays
//     within tessel: export skips it, import writes parameters only.
// The pieces may be split over any number of rank files; export reads only the boxes it needs.
//
// The Hugging Face side is a directory holding config.json and model.safetensors (import also
// reads sharded models: model.safetensors.index.json and the files it names), loadable by
// transformers' GPT2LMHeadModel / LlamaForCausalLM.from_pretrained. What changes on the way:
//   - GPT-2's c_attn, attn.c_proj, c_fc and mlp.c_proj weights are Conv1D, stored [in, out]: they
//     are transposed both ways. c_attn's [q | k | v] column blocks with heads contiguous are
//     exactly tessel's [q; k; v] row blocks, so a transpose is all it takes.
//   - LLaMA weights are copied as they are. Hugging Face's LLaMA checkpoints are already permuted
//     for the "rotate_half" RoPE (its conversion script permutes Meta's interleaved q/k rows),
//     and tessel's RoPE is rotate_half too (kernels/rope.h), with the same GQA head grouping
//     (query head h uses kv head h / (Hq / Hkv), as HF's repeat_kv): no permutation either way.
//   - Vocabulary padding rows are dropped on export and zero-filled on import; config.json's
//     vocab_size is the real vocabulary (tessel's padding never leaves tessel).
//   - A tied head has no lm_head.weight (as transformers' save_pretrained writes it). Import also
//     accepts an lm_head.weight beside tie_word_embeddings when it equals the embedding.
//   - Names: export writes transformers' current names (GPT-2 with the "transformer." prefix,
//     which is ModelSpec's naming); import accepts GPT-2 names with or without that prefix (the
//     hub's original gpt2 files have none) and ignores the non-parameter buffers older exports
//     saved (GPT-2 "attn.bias" / "attn.masked_bias" masks, LLaMA "rotary_emb.inv_freq").
//   - dtype: import reads F32, BF16 and F16 and writes f32 (exact); export writes f32 by default,
//     or bf16 / f16 (rounded to nearest even).
// Round trips are bit-exact: tessel -> HF (f32) -> tessel gives every parameter back bit for bit
// (padding rows as zeros, which training keeps them), and HF -> tessel -> HF (in the source's
// dtype) gives every tensor's bytes back; config.json keeps the source's extra fields (token
// ids, ...) because import stores the source config under meta "hf_config" and export starts
// from it.
// Both directions stream: each tensor is converted a block of rows (16 MiB of f32) at a time
// straight into the file being written, so memory stays bounded whatever the model's size
// (bench/convert_rss.py measures the peak on a llama2-7b-shaped checkpoint).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "tessel/model/model_config.h"
#include "tessel/tensor/dtype.h"

namespace tessel::checkpoint {

struct HfExportOptions {
  DType dtype = DType::f32;  // of the safetensors files: f32, bf16 or f16
  // Largest shard (bytes of tensor data), as transformers' max_shard_size ("5GB" = 5e9): a model
  // that fits is one model.safetensors, a larger one model-0000k-of-0000n.safetensors files and
  // model.safetensors.index.json (its weight_map names each tensor's file).
  uint64_t max_shard_bytes = 5'000'000'000;
};

struct HfExportResult {
  std::string checkpoint;  // the checkpoint exported (the newest one of a training run's dir)
  model::ModelConfig model;
  std::string architecture;  // "GPT2LMHeadModel" / "LlamaForCausalLM"
  size_t tensors = 0;        // written
  size_t skipped = 0;        // checkpoint tensors that are not parameters (optimizer state, ...)
  uint64_t bytes = 0;        // size of the safetensors files together
  size_t shards = 1;         // safetensors files written
};

// Writes OUT_DIR/model.safetensors (or its shards and index, see max_shard_bytes) and
// OUT_DIR/config.json (each atomically; OUT_DIR is created; model files of an earlier export of
// another sharding are removed once the new ones are complete) from the parameters of the tessel
// checkpoint CHECKPOINT_DIR, or of the newest checkpoint of a training run when CHECKPOINT_DIR is
// its checkpoint.dir (checkpoint/sharded_checkpoint.h). Throws CorruptDataError when the checkpoint
// has no model description (meta "model") or lacks a parameter or holds one of the wrong shape or a
// non-float dtype (naming it), UnsupportedError for a model transformers cannot represent (GPT-2
// without biases) or an export dtype other than f32/bf16/f16, and the store's errors (IoError,
// CorruptDataError) for an unreadable or damaged checkpoint.
HfExportResult export_hf(const std::string& checkpoint_dir, const std::string& out_dir,
                         const HfExportOptions& options = {});

struct HfImportOptions {
  // The model to import as, instead of the one config.json describes; config.json may then be
  // absent. When both exist they must agree on every architecture field (ConfigError listing
  // the differences, e.g. the vocabulary).
  std::optional<model::ModelConfig> model;
  // Model name in the checkpoint when no override is given (default: config.json's
  // "_name_or_path", else the directory's name).
  std::string name;
};

struct HfImportResult {
  model::ModelConfig model;
  std::string architecture;   // "GPT2LMHeadModel" / "LlamaForCausalLM"
  size_t tensors = 0;         // parameters written
  size_t ignored = 0;         // non-parameter buffers skipped (masks, inv_freq, a tied lm_head)
  std::string source_dtypes;  // of the Hugging Face weights, e.g. "bf16" or "f32,f16"
};

// Reads the Hugging Face model in HF_DIR (a directory, or a .safetensors file whose directory
// holds config.json) and writes the tessel checkpoint OUT_CHECKPOINT_DIR (one rank file; an
// existing checkpoint there is replaced atomically) with meta {"model", "step": 0,
// "source": {"format": "huggingface", ...}, "hf_config"}. Throws
//   IoError            no model.safetensors / index in HF_DIR, no config.json and no override;
//   CorruptDataError   malformed config.json or index, damaged safetensors (the reader's checks);
//   UnsupportedError   an architecture other than GPT-2 / LLaMA or an option tessel lacks
//                      (activation, rope_scaling, attention bias, ...), naming the field;
//   ConfigError        a missing, unexpected or ambiguous tensor, a wrong shape ("tensor
//                      'transformer.h.3.mlp.c_fc.weight' has shape [..] but gpt2 model 'x'
//                      (n_embd 768, ...) expects [..]"), a non-float tensor, an embedding whose
//                      rows differ from vocab_size, an override that disagrees with config.json.
HfImportResult import_hf(const std::string& hf_dir, const std::string& out_checkpoint_dir,
                         const HfImportOptions& options = {});

// The weight_map of a sharded model's model.safetensors.index.json, given as `text` (`what` names
// the file in messages): tensor name -> shard file name, each a plain name of a file beside the
// index. Throws CorruptDataError for malformed JSON, a missing weight_map or a bad file name.
std::map<std::string, std::string> hf_index_weight_map(const std::string& text,
                                                       const std::string& what);

// model_config_from_hf and hf_config_from_model (config.json <-> ModelConfig) are in
// config/hf_model_config.h.

}  // namespace tessel::checkpoint
