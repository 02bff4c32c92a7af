// ModelConfig <-> JSON, for checkpoints and (later) plans sent between processes.
#pragma once

#include <nlohmann/json.hpp>

#include "tessel/model/model_config.h"

namespace tessel::config {

nlohmann::json to_json(const model::ModelConfig& c);
// Throws CorruptDataError naming the missing or mistyped field.
model::ModelConfig model_config_from_json(const nlohmann::json& j);

}  // namespace tessel::config
