// Small JSON documents on disk: the files workers, the coordinator and tools exchange or keep
// (switch markers, failure reports, scale requests, a Hugging Face config.json).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace tessel {

// Writes `doc` to `path` atomically (AtomicFileWriter: a reader sees all of it or nothing).
// Throws IoError.
void write_json_file(const std::string& path, const nlohmann::json& doc);
// Throws IoError when `path` cannot be read, CorruptDataError when it is not JSON.
nlohmann::json read_json_file(const std::string& path);

}  // namespace tessel
