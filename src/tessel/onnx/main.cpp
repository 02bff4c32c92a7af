// tessel-onnx-import MODEL --out FILE [--dim NAME=VALUE]... [--dim-syntax S] [--source NAME]
//
// Reads an ONNX model (onnx_import.h) and writes its operator graph to FILE as JSON
// (planner/onnx_graph.h: onnx_graph_json), or {"error": {"kind", "message"}} and exit 1 when the
// model is bad. tessel runs it (planner::read_onnx); it is a program of its own to keep libonnx's
// protobuf out of the tessel process and to contain what a hostile file does to libonnx.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "tessel/core/error.h"
#include "tessel/onnx/onnx_import.h"

namespace {

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text << '\n';
  out.close();
  if (!out.good()) {
    std::fprintf(stderr, "tessel-onnx-import: cannot write %s\n", path.c_str());
    std::exit(3);
  }
}

int usage() {
  std::fprintf(stderr,
               "usage: tessel-onnx-import MODEL --out FILE [--dim NAME=VALUE]... "
               "[--dim-syntax S] [--source NAME]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, out;
  tessel::planner::OnnxOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--out" && has_value) {
      out = argv[++i];
    } else if (a == "--dim-syntax" && has_value) {
      options.dim_syntax = argv[++i];
    } else if (a == "--source" && has_value) {
      options.source = argv[++i];
    } else if (a == "--dim" && has_value) {
      const auto dim = tessel::planner::parse_dim(argv[++i], '=');
      if (!dim) return usage();
      options.dims[dim->first] = dim->second;
    } else if (model.empty() && !a.starts_with("--")) {
      model = a;
    } else {
      return usage();
    }
  }
  if (model.empty() || out.empty()) return usage();
  try {
    write_file(
        out,
        tessel::planner::onnx_graph_json(tessel::planner::import_onnx_file(model, options)).dump());
    return 0;
  } catch (const tessel::Error& e) {
    write_file(out,
               nlohmann::json({{"error", {{"kind", e.kind()}, {"message", e.what()}}}}).dump());
    return 1;
  } catch (const std::exception& e) {
    write_file(out, nlohmann::json({{"error", {{"kind", "error"}, {"message", e.what()}}}}).dump());
    return 1;
  }
}
