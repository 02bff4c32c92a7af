// Reading an ONNX model through the importer program (onnx_graph.h): the graph crosses the process
// boundary as JSON, whole; the importer's errors arrive as the same typed errors.
#include "tessel/planner/onnx_graph.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::planner {
namespace {

std::string gpt_block() {
  return std::string(TESSEL_SOURCE_DIR) + "/src/tessel/planner/testdata/gpt_block.onnx";
}

TEST(OnnxGraph, ReadsAModelThroughTheImporterAndRoundTripsItsJson) {
  const auto g = read_onnx(gpt_block(), {.dims = {{"batch", 8}}});
  ASSERT_EQ(g.graph.size(), 33);  // 32 operators and the input
  EXPECT_EQ(g.opset, 17);
  EXPECT_EQ(g.graph.node(0).kind, OpKind::input);
  EXPECT_EQ(g.graph.node(0).shape, (std::vector<int64_t>{8, 16, 32}));
  int weighted = 0;
  for (const auto& n : g.graph.nodes()) weighted += !n.weights.empty();
  EXPECT_EQ(weighted, 10);  // 2 norms, 4 matmuls, 4 bias adds
  const auto back = onnx_graph_from_json(onnx_graph_json(g));
  EXPECT_EQ(onnx_graph_json(back), onnx_graph_json(g));
}

TEST(OnnxGraph, TheImportersErrorsArriveTyped) {
  tessel::testing::TempDir dir;
  const auto junk = (dir / "junk.onnx").string();
  std::ofstream(junk) << "not a model";
  EXPECT_THROW(read_onnx(junk), CorruptDataError);
  try {
    read_onnx(gpt_block(), {.dim_syntax = "dim={}:N"});
    ADD_FAILURE() << "no error for a symbol without a value";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dim=batch:N"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_onnx(dir / "missing.onnx"), IoError);
}

TEST(OnnxGraph, AMissingImporterSaysHowToBuildIt) {
  ::setenv("TESSEL_ONNX_IMPORT", "/nonexistent/tessel-onnx-import", 1);
  try {
    read_onnx(gpt_block(), {.dims = {{"batch", 8}}});
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("ninja tessel-onnx-import"), std::string::npos)
        << e.what();
  }
  ::unsetenv("TESSEL_ONNX_IMPORT");
}

TEST(OnnxGraph, ParseDimTakesNameSeparatorPositiveValue) {
  EXPECT_EQ(parse_dim("batch=8", '='), std::make_pair(std::string("batch"), int64_t(8)));
  EXPECT_EQ(parse_dim("seq:1024", ':'), std::make_pair(std::string("seq"), int64_t(1024)));
  for (const char* bad : {"batch", "=8", "batch=0", "batch=-2", "batch=x", "batch=8x", "batch:8"})
    EXPECT_FALSE(parse_dim(bad, '=').has_value()) << bad;
}

TEST(OnnxGraph, MalformedJsonIsNamed) {
  EXPECT_THROW(onnx_graph_from_json({{"nodes", {{{"name", "x"}}}}}), CorruptDataError);
  EXPECT_THROW(onnx_graph_from_json(nlohmann::json::object()), CorruptDataError);
}

}  // namespace
}  // namespace tessel::planner
