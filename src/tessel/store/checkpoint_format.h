// Internal to the store's checkpoints: what the writer (checkpoint_writer.cpp) and the reader
// (checkpoint_reader.cpp) share of the format checkpoint_store.h describes -- the index's format
// name, the directory name rule, the tiling check, the manifest checksum and the checked accessors
// that turn malformed index or manifest JSON into CorruptDataError. Not an interface of the store.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/tensor/box.h"
#include "tessel/tensor/dtype.h"

namespace tessel::store::detail {

inline constexpr std::string_view kIndexFormat = "tessel-checkpoint-index";

// DIR as given but without trailing separators, so "ckpt/" and "ckpt" stage beside each other.
// Throws InvalidArgumentError for an empty name.
std::string normalize_dir(std::string dir);

// Why `boxes` do not tile `shape` exactly, or "" when they do.
std::string tiling_problem(const Shape& shape, const std::vector<Box>& boxes);

// The manifest's own checksum covers its compact dump without the "checksum" key; nlohmann
// sorts keys and prints numbers in shortest round-trip form, so re-dumping a parsed manifest
// reproduces the hashed text exactly.
uint64_t manifest_checksum(nlohmann::json m);

// Checked reads of index and manifest JSON: each throws CorruptDataError naming `what` when the
// value is missing or of the wrong type.
uint64_t json_u64(const nlohmann::json& v, const std::string& what);
std::string json_str(const nlohmann::json& obj, const char* key, const std::string& what);
const nlohmann::json& json_field(const nlohmann::json& obj, const char* key,
                                 const std::string& what);
// A dtype name under `key` ("f32", "bf16", ...).
DType json_dtype(const nlohmann::json& obj, const char* key, const std::string& what);
// A 16-hex-digit checksum under `key`.
uint64_t json_hash(const nlohmann::json& obj, const char* key, const std::string& what);
// A box written as a list of [lo, hi] pairs.
Box json_box(const nlohmann::json& v, const std::string& what);

}  // namespace tessel::store::detail
