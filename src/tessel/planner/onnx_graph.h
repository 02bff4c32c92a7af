// An operator graph imported from an ONNX file, and how tessel gets one: by running the importer
// (src/tessel/onnx: libonnx, shape inference) as its own program, tessel-onnx-import, which writes
// the graph as JSON.
//
// Why a separate program. libonnx brings the full protobuf runtime (3.21 in Debian 12);
// SentencePiece, which `tessel data prepare` uses, carries its own protobuf-lite (3.14) with the
// same symbols. In one process the dynamic linker binds one to the other and SentencePiece aborts
// on its version check. The importer's process also contains anything a hostile file does to
// libonnx: a crash or a hang is a failed import, not a dead `tessel plan serve`.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/planner/op_graph.h"

namespace tessel::planner {

struct OnnxOptions {
  // Values for symbolic dimensions (dim_param), e.g. {"batch", 8}.
  std::map<std::string, int64_t> dims = {};
  // How the caller gives a symbol a value, for messages: "{}" stands for the symbol's name.
  std::string dim_syntax = "--dim {}=VALUE";
  // Names the model in messages (default: its path).
  std::string source = {};
  // The importer may take this long (shape inference of a large model), then it is killed.
  std::chrono::milliseconds deadline{120'000};
};

struct OnnxGraph {
  OpGraph graph;
  std::vector<std::string> warnings;  // what the planner will not shard, what was folded
  std::string producer;               // producer_name and version, as the file says
  int64_t opset = 0;                  // of the default domain
};

// A symbolic dimension's value as the caller writes it, NAME<separator>VALUE with a positive
// integer VALUE (`--dim batch=8`, the query parameter `dim=batch:8`); nothing when malformed, so
// each caller names its own syntax in the error.
std::optional<std::pair<std::string, int64_t>> parse_dim(const std::string& text, char separator);

// The importer's output format, and back. onnx_graph_from_json throws CorruptDataError naming a
// missing or malformed field, and what OpGraph::validate() throws.
nlohmann::json onnx_graph_json(const OnnxGraph& g);
OnnxGraph onnx_graph_from_json(const nlohmann::json& j);

// Runs tessel-onnx-import on `path` and returns its graph. The program is $TESSEL_ONNX_IMPORT, or
// tessel-onnx-import beside the running executable. Throws what the importer threw (IoError for
// a file that cannot be read, CorruptDataError for one that is not a model, ConfigError for a
// dimension without a value, ...), CorruptDataError when it crashed or passed the deadline, and
// IoError when it cannot be found or started.
OnnxGraph read_onnx(const std::filesystem::path& path, const OnnxOptions& options = {});
// The same for a model held in memory (a posted one): written to a temporary file for the
// importer, which is removed after.
OnnxGraph read_onnx_bytes(std::string_view bytes, const OnnxOptions& options = {});

}  // namespace tessel::planner
