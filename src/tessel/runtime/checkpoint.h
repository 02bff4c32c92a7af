// Training checkpoints (the interim single-file format; the tensor-store issue replaces it with
// sharded safetensors + index + manifest).
//
// A checkpoint is one file `<dir>/step_<NNNNNNNN>.ckpt`:
//   "TSLCKPT1" | u32 version | u32 0 | u64 header bytes | header JSON | section bytes ... | u64
//   xxh3
// The JSON header holds the metadata (model config, step, data cursor, seeds) and the list of
// sections (name, element count); the trailing xxh3-64 covers everything before it.
//
// Writes are atomic: the file is written under a temporary name, fsynced, renamed, and only then
// does `<dir>/latest` (also replaced by rename) point at it. A crash at any moment leaves the
// previous checkpoint intact and `latest` naming a complete file.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessel::runtime {

struct CheckpointSection {
  std::string name;
  float* data;  // saved from / loaded into
  int64_t count;
};

// Writes the checkpoint for `step` and removes all but the newest `keep` checkpoints.
// Returns the path written. Throws IoError on failure (the previous checkpoint stays intact).
std::string save_checkpoint(const std::string& dir, int64_t step, const nlohmann::json& meta,
                            const std::vector<CheckpointSection>& sections, int keep);

// Path of the newest complete checkpoint in dir, if any.
std::optional<std::string> latest_checkpoint(const std::string& dir);

// Reads the metadata only (validates magic, version and checksum).
nlohmann::json read_checkpoint_meta(const std::string& path);

// Verifies and loads every section by name into the given buffers; each must exist with the same
// element count. Throws CorruptDataError naming the file (and section) when the file is truncated,
// fails its checksum, or does not hold what is asked for.
nlohmann::json load_checkpoint(const std::string& path,
                               const std::vector<CheckpointSection>& sections);

}  // namespace tessel::runtime
