// A model's parameters wherever they are: a tessel checkpoint or a Hugging Face model directory.
//
// What fine-tuning (`init_from:`), `tessel eval` and `tessel generate` read. Every read is of a
// box of one parameter in tessel's layout (model/model_spec.h: names, [out, in] Linear weights,
// embedding and untied head with padded_vocab() rows), in f32, whatever the source holds:
//   - a tessel checkpoint (a step directory with manifest.json, or a training run's
//     checkpoint.dir, whose newest checkpoint is read): boxes are read as they are, from any
//     number of rank files, saved under any plan;
//   - a Hugging Face directory (config.json with model.safetensors, or the shards an index
//     names): GPT-2's Conv1D weights are read transposed, vocabulary padding rows are zeros,
//     bf16 / f16 are widened exactly (checkpoint/hf_convert.h says what else differs).
// Nothing is converted ahead: a rank that holds one shard of a 7B model reads only that shard's
// bytes. Safe to read from several threads at once.
#pragma once

#include <memory>
#include <string>

#include <span>
#include <vector>

#include "tessel/layout/state_layout.h"
#include "tessel/model/model_config.h"
#include "tessel/model/model_spec.h"
#include "tessel/tensor/box.h"

namespace tessel::checkpoint {

class ModelWeights {
 public:
  virtual ~ModelWeights() = default;

  // Opens `path` (see above), checking every parameter's presence, shape and dtype before any
  // data is read. Throws IoError for a path that is neither (naming what it looked for),
  // UnsupportedError for a Hugging Face architecture tessel lacks, ConfigError for a Hugging
  // Face model with missing, unexpected or misshapen tensors, CorruptDataError for a damaged or
  // incomplete tessel checkpoint (naming the tensor).
  static std::unique_ptr<ModelWeights> open(const std::string& path);

  const model::ModelConfig& model() const { return model_; }
  const model::ModelSpec& spec() const { return spec_; }
  // "Hugging Face model in 'DIR' (LlamaForCausalLM, bf16)" or "tessel checkpoint 'DIR' (step N)".
  const std::string& describe() const { return describe_; }
  // The resolved path read (a run's checkpoint.dir resolves to its newest step directory).
  const std::string& path() const { return path_; }
  // True for a tessel checkpoint that `tessel train` wrote (it also holds optimizer state).
  virtual bool has_optimizer_state() const = 0;

  // Reads `box` of parameter `p` (one of spec()'s) into `out` (box.volume() floats, dense
  // row-major, tessel's layout). Throws InvalidArgumentError for a box outside the parameter,
  // and the source's read errors (CorruptDataError naming the file on a checksum mismatch).
  virtual void read(const model::ParamSpec& p, const Box& box, float* out) const = 0;
  // The whole parameter.
  void read(const model::ParamSpec& p, float* out) const { read(p, Box::of(p.shape), out); }

 protected:
  ModelWeights(model::ModelConfig model, std::string path, std::string describe);

 private:
  model::ModelConfig model_;
  model::ModelSpec spec_;
  std::string path_;
  std::string describe_;
};

// Fills rank `rank`'s buffers (layout order) for a run starting from `weights` (`init_from:`):
// parameters (and fp32 master copies) from the weights, optimizer moments zero -- a fresh
// optimizer. Reads only the boxes the rank holds. Throws InvalidArgumentError when the layout's
// model differs from the weights' (names aside).
void load_rank_weights(const ModelWeights& weights, const layout::StateLayout& layout, int rank,
                       const std::vector<std::span<float>>& buffers);

}  // namespace tessel::checkpoint
