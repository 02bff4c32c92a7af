#include "tessel/config/yaml_reader.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

namespace tessel::config {

YamlSection::YamlSection(YAML::Node node, std::string path, std::string file)
    : node_(std::move(node)), path_(std::move(path)), file_(std::move(file)) {
  TESSEL_CHECK(!node_ || node_.IsNull() || node_.IsMap(), ConfigError,
               "{}: section '{}' must be a mapping of keys to values (line {})", file_, path_,
               node_.Mark().line + 1);
  if (!node_ || !node_.IsMap()) return;
  // yaml-cpp keeps the first of two equal keys and drops the second without a word: a config
  // that sets `steps` twice, or has two `training:` sections, would run with the wrong value.
  std::map<std::string, int> line_of;
  for (const auto& kv : node_) {
    const int line = kv.first.Mark().line + 1;
    TESSEL_CHECK(kv.first.IsScalar(), ConfigError,
                 "{}: a key of section '{}' is not a name (line {}); keys are plain words", file_,
                 path_.empty() ? "(top level)" : path_, line);
    const auto key = kv.first.as<std::string>();
    const auto [it, fresh] = line_of.emplace(key, line);
    TESSEL_CHECK(fresh, ConfigError, "{}: '{}' is given twice (lines {} and {}); keep one", file_,
                 path_.empty() ? key : path_ + "." + key, it->second, line);
  }
}

bool YamlSection::has(const std::string& key) const {
  return node_ && node_.IsMap() && node_[key];
}

YamlSection YamlSection::section(const std::string& key) {
  known_.insert(key);
  YAML::Node child = has(key) ? node_[key] : YAML::Node();
  return YamlSection(child, path_.empty() ? key : path_ + "." + key, file_);
}

std::vector<YamlSection> YamlSection::list(const std::string& key) {
  known_.insert(key);
  std::vector<YamlSection> out;
  if (!has(key)) return out;
  const YAML::Node items = node_[key];
  const std::string name = path_.empty() ? key : path_ + "." + key;
  TESSEL_CHECK(items.IsSequence(), ConfigError, "{}: '{}' must be a list (line {})", file_, name,
               items.Mark().line + 1);
  for (size_t i = 0; i < items.size(); ++i)
    out.emplace_back(items[i], fmt::format("{}[{}]", name, i), file_);
  return out;
}

std::string YamlSection::where(const std::string& key) const {
  return fmt::format("{}: '{}'", file_, path_.empty() ? key : path_ + "." + key);
}

void YamlSection::read_choice(const std::string& key, std::string& out,
                              std::initializer_list<std::string_view> choices) {
  read(key, out);
  if (std::find(choices.begin(), choices.end(), out) != choices.end()) return;
  TESSEL_THROW(ConfigError, "{}: '{}' is not one of the choices; use {}", where(key), out,
               fmt::join(choices, ", "));
}

void YamlSection::reject_unknown_keys() const {
  if (!node_ || !node_.IsMap()) return;
  for (const auto& kv : node_) {
    auto key = kv.first.as<std::string>();
    if (known_.count(key)) continue;
    std::string allowed;
    for (const auto& k : known_) allowed += (allowed.empty() ? "" : ", ") + k;
    TESSEL_THROW(ConfigError, "{}: unknown key '{}' (line {}); allowed here: {}", file_,
                 path_.empty() ? key : path_ + "." + key, kv.first.Mark().line + 1, allowed);
  }
}

YAML::Node load_yaml_file(const std::string& path) {
  TESSEL_CHECK(std::filesystem::exists(path), IoError, "config file '{}' does not exist", path);
  std::ifstream in(path, std::ios::binary);
  TESSEL_CHECK(in.good(), IoError, "cannot read config file '{}'", path);
  return parse_yaml(std::string(std::istreambuf_iterator<char>(in), {}), path);
}

YAML::Node parse_yaml(const std::string& text, const std::string& file) {
  try {
    YAML::Node node = YAML::Load(text);
    TESSEL_CHECK(node.IsMap(), ConfigError, "{}: the config must be a YAML mapping (key: value)",
                 file);
    return node;
  } catch (const YAML::ParserException& e) {
    TESSEL_THROW(ConfigError, "{}: malformed YAML at line {}, column {}: {}", file, e.mark.line + 1,
                 e.mark.column + 1, e.msg);
  }
}

}  // namespace tessel::config
