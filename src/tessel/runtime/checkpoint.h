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

// A checkpoint read into memory once and verified (magic, version, checksum, header), so that
// its metadata can be checked before its sections are loaded without reading the file twice.
class CheckpointFile {
 public:
  // Throws IoError when the file cannot be read, CorruptDataError naming the file when it is
  // truncated, fails its checksum or has an unreadable header.
  static CheckpointFile open(const std::string& path);

  const nlohmann::json& meta() const { return header_; }
  // Copies every section by name into the given buffers; each must exist with the same element
  // count, else CorruptDataError naming the file and the section.
  void load(const std::vector<CheckpointSection>& sections) const;

 private:
  std::string path_;
  nlohmann::json header_;
  std::vector<char> bytes_;  // the whole file
  size_t payload_offset_ = 0;
};

// CheckpointFile::open(path).load(sections), returning the metadata.
nlohmann::json load_checkpoint(const std::string& path,
                               const std::vector<CheckpointSection>& sections);

}  // namespace tessel::runtime
