// What a Hugging Face config.json says about a model, as tessel's ModelConfig, and back.
//
// GPT-2 (GPT2LMHeadModel) and LLaMA (LlamaForCausalLM) only; options tessel does not implement
// (another activation, rope_scaling, attention biases, ...) are refused by name rather than
// ignored. Used by the conversions (checkpoint/hf_convert.h), by `init_from:` (a config may name
// a Hugging Face directory instead of writing out its model) and by `tessel generate`.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "tessel/model/model_config.h"
#include "tessel/tensor/dtype.h"

namespace tessel::config {

// "GPT2LMHeadModel" / "LlamaForCausalLM".
std::string hf_architecture(model::Family family);

// "gpt2 model 'x' (n_layer 12, n_embd 768, ...)": what error messages say a tensor must fit.
std::string describe_model(const model::ModelConfig& c);

// The ModelConfig a transformers config.json describes. `name` labels it, `what` names the file
// in messages. Throws UnsupportedError for an architecture or option tessel lacks (naming the
// field), CorruptDataError for a missing or mistyped field.
model::ModelConfig model_config_from_hf(const nlohmann::json& config, const std::string& name,
                                        const std::string& what = "config.json");

// The config.json transformers needs to load `model` stored in `dtype` (f32, bf16 or f16; else
// UnsupportedError). Fields of `base` (a source config.json of the same family) that do not
// describe the architecture are kept. Throws UnsupportedError for a model transformers cannot
// represent (GPT-2 without biases).
nlohmann::json hf_config_from_model(const model::ModelConfig& model, DType dtype,
                                    const nlohmann::json& base = nlohmann::json::object());

}  // namespace tessel::config
