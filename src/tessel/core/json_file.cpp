#include "tessel/core/json_file.h"

#include <fstream>

#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"

namespace tessel {

void write_json_file(const std::string& path, const nlohmann::json& doc) {
  write_file_atomically(path, doc.dump());
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  TESSEL_CHECK(in.good(), IoError, "cannot read {}", path);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not valid JSON: {}", path, e.what());
  }
}

}  // namespace tessel
