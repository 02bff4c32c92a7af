// A model's deterministic initial weights (model/init.h) written as a tessel checkpoint of the
// parameter convention (hf_convert.h), streamed: each parameter is generated a block of rows at a
// time while the file is written, so a model of any size is written in bounded memory. What
// `tessel init` writes: a starting point to export (`tessel convert --to hf`), to fine-tune from
// (`init_from:`), or a model of a real size to measure the conversions on.
#pragma once

#include <cstdint>
#include <string>

#include "tessel/model/model_config.h"

namespace tessel::checkpoint {

// Writes the checkpoint OUT_DIR (replaced atomically when it is one) with meta {"model",
// "step": 0, "source": {"format": "init", "seed"}}. Returns the bytes of parameters written.
// Throws ConfigError for an invalid model, IoError when OUT_DIR cannot be written.
uint64_t write_initialised_checkpoint(const model::ModelConfig& model, uint64_t seed,
                                      const std::string& out_dir);

}  // namespace tessel::checkpoint
