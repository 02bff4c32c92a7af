// Strict reading of YAML config sections: every key must be known, every value well-typed.
//
// A misspelt key is a silent bug in most trainers (the default is used and nobody notices); here it
// is a ConfigError naming the key, its section, the file and the keys that are allowed.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <initializer_list>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/core/check.h"

namespace tessel::config {

template <typename T>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, bool>)
    return "true/false";
  else if constexpr (std::is_integral_v<T>)
    return "an integer";
  else if constexpr (std::is_floating_point_v<T>)
    return "a number";
  else if constexpr (std::is_same_v<T, std::string>)
    return "a string";
  else
    return "a list";
}

class YamlSection {
 public:
  // `path` is the dotted name of the section ("training"), `file` the config file for messages.
  YamlSection(YAML::Node node, std::string path, std::string file);

  bool has(const std::string& key) const;
  // Reads `key` into `out` when present (out keeps its default otherwise).
  template <typename T>
  void read(const std::string& key, T& out);
  // Reads a string that must be one of `choices` (out keeps its default when absent); anything
  // else is a ConfigError that lists them.
  void read_choice(const std::string& key, std::string& out,
                   std::initializer_list<std::string_view> choices);
  // A nested section; an absent key gives an empty section.
  YamlSection section(const std::string& key);
  // A list of sections ("key[0]", "key[1]", ...); an absent key gives an empty list. Throws
  // ConfigError when the value is not a list of mappings.
  std::vector<YamlSection> list(const std::string& key);
  // Throws ConfigError for the first key that no read()/section()/has()-then-read call consumed.
  void reject_unknown_keys() const;
  const std::string& path() const { return path_; }
  std::string where(const std::string& key) const;

 private:
  YAML::Node node_;
  std::string path_, file_;
  std::set<std::string> known_;
};

template <typename T>
void YamlSection::read(const std::string& key, T& out) {
  known_.insert(key);
  if (!node_ || !node_.IsMap() || !node_[key]) return;
  const YAML::Node& v = node_[key];
  try {
    out = v.as<T>();
  } catch (const YAML::Exception&) {
    TESSEL_THROW(ConfigError, "{}: cannot read '{}' as {} (line {})", where(key), YAML::Dump(v),
                 type_name<T>(), v.Mark().line + 1);
  }
  // .inf and .nan are YAML numbers, but no setting means them (an infinite epsilon trains to
  // nothing, a NaN clip disables clipping).
  if constexpr (std::is_floating_point_v<T>)
    TESSEL_CHECK(std::isfinite(out), ConfigError, "{}: '{}' is not a finite number (line {})",
                 where(key), YAML::Dump(v), v.Mark().line + 1);
}

// Loads a YAML file; malformed YAML is a ConfigError with the file, line and column.
YAML::Node load_yaml_file(const std::string& path);
// The same for YAML text already in memory; `file` names it in messages.
YAML::Node parse_yaml(const std::string& text, const std::string& file);

}  // namespace tessel::config
