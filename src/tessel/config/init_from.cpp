#include "tessel/config/init_from.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tessel/config/hf_model_config.h"
#include "tessel/config/model_json.h"
#include "tessel/core/check.h"
#include "tessel/core/json_file.h"

namespace tessel::config {

namespace fs = std::filesystem;

model::ModelConfig init_from_model(const std::string& path) {
  const fs::path dir = path;
  TESSEL_CHECK(fs::is_directory(dir), ConfigError,
               "init_from: '{}' is not a directory; name a Hugging Face model directory "
               "(config.json + model.safetensors) or a tessel checkpoint",
               path);
  if (fs::exists(dir / "config.json")) {
    const auto j = read_json_file((dir / "config.json").string());
    std::string name =
        j.is_object() && j.contains("_name_or_path") && j["_name_or_path"].is_string()
            ? j["_name_or_path"].get<std::string>()
            : fs::absolute(dir).lexically_normal().filename().string();
    return model_config_from_hf(j, name.empty() ? "hf-model" : name,
                                fmt::format("'{}'", (dir / "config.json").string()));
  }
  fs::path manifest = dir / "manifest.json";
  if (!fs::exists(manifest) && fs::exists(dir / "latest")) {
    // A run's checkpoint.dir: `latest` names its newest step directory.
    std::ifstream in(dir / "latest");
    std::string name;
    std::getline(in, name);
    manifest = dir / name / "manifest.json";
  }
  TESSEL_CHECK(fs::exists(manifest), ConfigError,
               "init_from: '{}' is neither a Hugging Face model directory (no config.json) nor a "
               "tessel checkpoint (no manifest.json, no 'latest'); convert other formats first "
               "(`tessel convert`)",
               path);
  const auto j = read_json_file(manifest.string());
  TESSEL_CHECK(
      j.is_object() && j.contains("meta") && j["meta"].is_object() && j["meta"].contains("model"),
      CorruptDataError,
      "init_from: '{}' has no model description (meta \"model\"); it was not written by "
      "tessel's training or import",
      manifest.string());
  return model_config_from_json(j["meta"]["model"]);
}

void check_init_from_model(const model::ModelConfig& wanted, const model::ModelConfig& source,
                           const std::string& path) {
  auto a = to_json(wanted), b = to_json(source);
  std::vector<std::string> diffs;
  for (const auto& [key, value] : a.items())
    if (key != "name" && b.at(key) != value)
      diffs.push_back(
          fmt::format("{}: {} (config) vs {} (weights)", key, value.dump(), b.at(key).dump()));
  std::string list;
  for (const auto& d : diffs) list += (list.empty() ? "" : "; ") + d;
  TESSEL_CHECK(diffs.empty(), ConfigError,
               "the model section differs from the model of init_from '{}' ({}): remove the "
               "model section to train the model the weights are of",
               path, list);
}

}  // namespace tessel::config
