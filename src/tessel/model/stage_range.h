// StageRange: the part of a model one pipeline stage builds.
//
// A stage owns the transformer blocks [layer_begin, layer_end) and, when it is the first stage,
// the embeddings, when it is the last, the final norm and the head. The default is the whole
// model. With tied embeddings the last stage also holds a copy of the token embedding for its
// head; the copies' gradients must be summed across the two stages before the optimizer step
// (the pipeline runtime does that).
#pragma once

#include "tessel/model/model_config.h"

namespace tessel::model {

struct StageRange {
  int layer_begin = 0;
  int layer_end = -1;  // -1: through the last layer
  bool has_embedding = true;
  bool has_head = true;

  // The stage of blocks [begin, end) of a pipeline: embeddings iff it starts at layer 0, head
  // iff it ends at the last layer.
  static StageRange layers(const ModelConfig& config, int begin, int end);

  // This range with layer_end resolved; throws ConfigError when the range is outside the model,
  // empty, or claims the embedding/head without starting/ending at the model's ends.
  StageRange resolved(const ModelConfig& config) const;
  int num_layers() const { return layer_end - layer_begin; }  // of a resolved range
  bool is_whole(const ModelConfig& config) const;

  bool operator==(const StageRange&) const = default;
};

}  // namespace tessel::model
