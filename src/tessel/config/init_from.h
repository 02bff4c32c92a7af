// `init_from:` -- the pretrained weights a run starts from (fine-tuning).
//
// A config may name a Hugging Face model directory (config.json + model.safetensors or a sharded
// index) or a tessel checkpoint (a step directory with manifest.json, or a run's checkpoint.dir,
// whose newest checkpoint is meant). The run takes the weights only: its optimizer state, data
// cursor, step and learning-rate schedule start afresh. This header reads what model the source
// holds, so that a config naming one needs no model section; the weights themselves are read by
// each worker, only the boxes it holds (checkpoint/model_weights.h).
#pragma once

#include <string>

#include "tessel/model/model_config.h"

namespace tessel::config {

// The model the weights at `path` are of (see above). Throws ConfigError naming `path` when it is
// neither kind of source, and the format's errors (UnsupportedError for a Hugging Face
// architecture tessel lacks, CorruptDataError for a malformed config.json or manifest).
model::ModelConfig init_from_model(const std::string& path);

// Throws ConfigError listing every architecture field where `wanted` (a config's model section)
// differs from `source` (the model at `path`); names are not compared.
void check_init_from_model(const model::ModelConfig& wanted, const model::ModelConfig& source,
                           const std::string& path);

}  // namespace tessel::config
