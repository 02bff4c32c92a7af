#include "tessel/onnx/onnx_import.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include <unistd.h>

#include "tessel/core/error.h"
#include "tessel/planner/sharding_ilp.h"
#include "tessel/planner/sharding_test_util.h"

namespace tessel::planner {
namespace {

using Shape = std::vector<int64_t>;
constexpr int32_t kFloat = onnx::TensorProto::FLOAT;
constexpr int32_t kInt64 = onnx::TensorProto::INT64;

// Builds a ModelProto in memory. Weights carry dims only: the importer, like shape inference,
// never reads their values. Dimensions of -1 take their symbol from `params` (same index); -2
// have neither value nor symbol.
class ModelBuilder {
 public:
  explicit ModelBuilder(int opset = 17) {
    m_.set_ir_version(8);
    m_.set_producer_name("tessel-test");
    m_.set_producer_version("1");
    auto* o = m_.add_opset_import();
    o->set_domain("");
    o->set_version(opset);
    m_.mutable_graph()->set_name("g");
  }
  void domain(const std::string& name, int version) {
    auto* o = m_.add_opset_import();
    o->set_domain(name);
    o->set_version(version);
  }
  void input(const std::string& name, int32_t type, const Shape& dims,
             const std::vector<std::string>& params = {}) {
    value(m_.mutable_graph()->add_input(), name, type, dims, params);
  }
  void output(const std::string& name, int32_t type, const Shape& dims,
              const std::vector<std::string>& params = {}) {
    value(m_.mutable_graph()->add_output(), name, type, dims, params);
  }
  void value_info(const std::string& name, const Shape& dims) {
    value(m_.mutable_graph()->add_value_info(), name, kFloat, dims, {});
  }
  void weight(const std::string& name, const Shape& dims) {
    auto* t = m_.mutable_graph()->add_initializer();
    t->set_name(name);
    t->set_data_type(kFloat);
    for (int64_t d : dims) t->add_dims(d);
  }
  void scalar(const std::string& name, float v) {
    auto* t = m_.mutable_graph()->add_initializer();
    t->set_name(name);
    t->set_data_type(kFloat);
    t->add_float_data(v);
  }
  void ints(const std::string& name, const Shape& values) {
    auto* t = m_.mutable_graph()->add_initializer();
    t->set_name(name);
    t->set_data_type(kInt64);
    t->add_dims(int64_t(values.size()));
    for (int64_t v : values) t->add_int64_data(v);
  }
  onnx::NodeProto& node(const std::string& op, const std::vector<std::string>& inputs,
                        const std::vector<std::string>& outputs, const std::string& name = "") {
    auto* n = m_.mutable_graph()->add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (const auto& i : inputs) n->add_input(i);
    for (const auto& o : outputs) n->add_output(o);
    return *n;
  }
  static void attr(onnx::NodeProto& n, const std::string& name, int64_t v) {
    auto* a = n.add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(v);
  }
  static void attr(onnx::NodeProto& n, const std::string& name, const Shape& v) {
    auto* a = n.add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INTS);
    for (int64_t x : v) a->add_ints(x);
  }
  std::string bytes() const { return m_.SerializeAsString(); }

 private:
  static void value(onnx::ValueInfoProto* v, const std::string& name, int32_t type,
                    const Shape& dims, const std::vector<std::string>& params) {
    v->set_name(name);
    auto* t = v->mutable_type()->mutable_tensor_type();
    t->set_elem_type(type);
    auto* s = t->mutable_shape();
    for (size_t i = 0; i < dims.size(); ++i) {
      auto* d = s->add_dim();
      if (dims[i] >= 0) d->set_dim_value(dims[i]);
      if (dims[i] == -1) d->set_dim_param(params.at(i));
    }
  }
  onnx::ModelProto m_;
};

int id_of(const OpGraph& g, const std::string& name) {
  for (int i = 0; i < g.size(); ++i)
    if (g.node(i).name == name) return i;
  ADD_FAILURE() << "no node " << name;
  return -1;
}

// x[8, 16] -> MatMul w1[16, 32] -> Add b1[32] -> Relu -> MatMul w2[32, 4] -> y[8, 4].
std::string mlp(const std::string& activation = "Relu", int64_t batch = 8) {
  ModelBuilder b;
  b.input("x", kFloat, {batch, 16});
  b.output("y", kFloat, {batch, 4});
  b.weight("w1", {16, 32});
  b.weight("b1", {32});
  b.weight("w2", {32, 4});
  b.node("MatMul", {"x", "w1"}, {"h"}, "fc1");
  b.node("Add", {"h", "b1"}, {"hb"}, "fc1.bias");
  b.node(activation, {"hb"}, {"a"}, "act");
  b.value_info("a", {batch, 32});  // for an activation inference does not know
  b.node("MatMul", {"a", "w2"}, {"y"}, "fc2");
  return b.bytes();
}

TEST(OnnxImport, MlpKindsShapesWeightsEdgesAndFlops) {
  const OnnxGraph r = parse_onnx(mlp());
  const OpGraph& g = r.graph;
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  EXPECT_EQ(r.producer, "tessel-test 1");
  EXPECT_EQ(r.opset, 17);
  ASSERT_EQ(g.size(), 5);
  struct Want {
    std::string name;
    OpKind kind;
    Shape shape;
    std::vector<Shape> weights;
    std::vector<std::string> inputs;
    double flops;
  };
  // FLOPs: 2 m n k per matmul, one per output element for the element-wise operators; the bias
  // add is element-wise without partial sums (gelu, see onnx_import.h).
  const std::vector<Want> want = {
      {"x", OpKind::input, {8, 16}, {}, {}, 0},
      {"fc1", OpKind::matmul, {8, 32}, {{16, 32}}, {"x"}, 2.0 * 8 * 32 * 16},
      {"fc1.bias", OpKind::gelu, {8, 32}, {{32}}, {"fc1"}, 8 * 32},
      {"act", OpKind::gelu, {8, 32}, {}, {"fc1.bias"}, 8 * 32},
      {"fc2", OpKind::matmul, {8, 4}, {{32, 4}}, {"act"}, 2.0 * 8 * 4 * 32},
  };
  for (const Want& w : want) {
    SCOPED_TRACE(w.name);
    const OpNode& n = g.node(id_of(g, w.name));
    EXPECT_EQ(n.kind, w.kind) << op_kind_name(n.kind);
    EXPECT_EQ(n.shape, w.shape);
    EXPECT_EQ(n.weights, w.weights);
    EXPECT_EQ(n.weights_of, -1);
    std::vector<std::string> inputs;
    for (int i : n.inputs) inputs.push_back(g.node(i).name);
    EXPECT_EQ(inputs, w.inputs);
    EXPECT_EQ(n.flops, w.flops);  // small integers: exact in double
  }
  EXPECT_EQ(g.node(id_of(g, "fc1")).op_type, "MatMul");
  EXPECT_EQ(g.total_parameters(), 16 * 32 + 32 + 32 * 4);
}

// One pre-norm attention block as torch.onnx writes it: x[1, T, C] -> LayerNormalization ->
// MatMul [C, 3C] -> Split q / k / v -> Reshape to heads -> Transpose -> q k^T -> scale ->
// Softmax -> p v -> Transpose -> Reshape -> MatMul [C, C] -> residual Add. GPT-2 350M's sizes
// (C 1024, 16 heads, 1024 tokens), where sharding_ilp_test finds Megatron's layout.
constexpr int64_t T = 1024, C = 1024, H = 16, D = 64;
std::string attention_block() {
  ModelBuilder b;
  b.input("x", kFloat, {1, T, C});
  b.output("y", kFloat, {1, T, C});
  b.weight("ln.weight", {C});
  b.weight("ln.bias", {C});
  b.weight("qkv.weight", {C, 3 * C});
  b.weight("proj.weight", {C, C});
  b.ints("qkv.split", {C, C, C});
  b.ints("heads.shape", {1, T, H, D});
  b.ints("merge.shape", {1, T, C});
  b.scalar("scale", 8);  // sqrt(D)
  ModelBuilder::attr(b.node("LayerNormalization", {"x", "ln.weight", "ln.bias"}, {"ln"}, "ln_1"),
                     "axis", -1);
  b.node("MatMul", {"ln", "qkv.weight"}, {"qkv"}, "attn.qkv");
  ModelBuilder::attr(b.node("Split", {"qkv", "qkv.split"}, {"q", "k", "v"}, "split"), "axis", 2);
  for (const char* t : {"q", "k", "v"})
    b.node("Reshape", {t, "heads.shape"}, {fmt::format("{}h", t)}, fmt::format("heads.{}", t));
  ModelBuilder::attr(b.node("Transpose", {"qh"}, {"q4"}, "q.t"), "perm", Shape{0, 2, 1, 3});
  ModelBuilder::attr(b.node("Transpose", {"kh"}, {"kT"}, "k.t"), "perm", Shape{0, 2, 3, 1});
  ModelBuilder::attr(b.node("Transpose", {"vh"}, {"v4"}, "v.t"), "perm", Shape{0, 2, 1, 3});
  b.node("MatMul", {"q4", "kT"}, {"s"}, "qk");
  b.node("Div", {"s", "scale"}, {"s2"}, "scale");
  ModelBuilder::attr(b.node("Softmax", {"s2"}, {"p"}, "softmax"), "axis", -1);
  b.node("MatMul", {"p", "v4"}, {"o"}, "pv");
  ModelBuilder::attr(b.node("Transpose", {"o"}, {"o2"}, "o.t"), "perm", Shape{0, 2, 1, 3});
  b.node("Reshape", {"o2", "merge.shape"}, {"o3"}, "merge_heads");
  b.node("MatMul", {"o3", "proj.weight"}, {"proj"}, "attn.proj");
  b.node("Add", {"x", "proj"}, {"y"}, "residual");
  return b.bytes();
}

TEST(OnnxImport, AttentionBlockShardsLikeMegatron) {
  const OnnxGraph r = parse_onnx(attention_block());
  const OpGraph& g = r.graph;
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  auto node = [&](const std::string& name) -> const OpNode& { return g.node(id_of(g, name)); };
  // 1 input + 17 ONNX nodes, the Split as three.
  ASSERT_EQ(g.size(), 1 + 17 + 2);
  EXPECT_EQ(node("ln_1").kind, OpKind::layer_norm);
  EXPECT_EQ(node("ln_1").weights, (std::vector<Shape>{{C}, {C}}));
  EXPECT_EQ(node("attn.qkv").shape, (Shape{1, T, 3 * C}));
  EXPECT_EQ(node("attn.qkv").flops, 2.0 * T * 3 * C * C);
  for (int i = 0; i < 3; ++i) {
    const OpNode& s = node(fmt::format("split.{}", i));
    EXPECT_EQ(s.kind, OpKind::split);
    EXPECT_EQ(s.shape, (Shape{1, T, C}));
    EXPECT_EQ(s.dim_of, (std::vector<int>{0, 1, 2}));
  }
  // [1, T, C] -> [1, T, H, D]: C's outer part is H. The shape operand is a constant: no edge.
  EXPECT_EQ(node("heads.q").kind, OpKind::reshape);
  EXPECT_EQ(node("heads.q").dim_of, (std::vector<int>{-1, 1, 2}));
  EXPECT_EQ(node("heads.q").inputs, std::vector<int>{id_of(g, "split.0")});
  EXPECT_EQ(node("k.t").dim_of, (std::vector<int>{0, 3, 1, 2}));
  EXPECT_EQ(node("qk").kind, OpKind::matmul);
  EXPECT_EQ(node("qk").shape, (Shape{1, H, T, T}));
  EXPECT_EQ(node("qk").flops, 2.0 * H * T * T * D);
  EXPECT_EQ(node("scale").kind, OpKind::mul);  // by a scalar constant: no weight, one input
  EXPECT_TRUE(node("scale").weights.empty());
  EXPECT_EQ(node("softmax").kind, OpKind::softmax);
  // [1, T, H, D] -> [1, T, C]: H is C's outer part, D an inner one.
  EXPECT_EQ(node("merge_heads").dim_of, (std::vector<int>{-1, 1, 2, -1}));
  EXPECT_EQ(node("residual").kind, OpKind::add);
  EXPECT_EQ(g.total_parameters(), 2 * C + 3 * C * C + C * C);

  const ShardingSolution s = solve_sharding(g, 2, testing::nvlink_costs(), {.time_limit_s = 60});
  ASSERT_EQ(s.status, IlpStatus::optimal) << ilp_status_name(s.status);
  EXPECT_EQ(s.of(g, "attn.qkv").name, "column");
  EXPECT_EQ(s.of(g, "attn.proj").name, "row");
  EXPECT_EQ(s.of(g, "qk").name, "batch(1)");  // heads
  EXPECT_EQ(s.of(g, "pv").name, "batch(1)");
  if (::testing::Test::HasFailure())
    for (int i = 0; i < g.size(); ++i)
      fmt::print("  {:<14} {:<12} out {}\n", g.node(i).name, s.chosen[size_t(i)].name,
                 to_string(s.chosen[size_t(i)].out));
}

TEST(OnnxImport, UnknownOpsAreKeptReplicatedWithOneWarning) {
  ModelBuilder b;
  b.input("x", kFloat, {4, 8});
  b.output("z", kFloat, {4, 8});
  b.domain("example.custom", 1);
  b.node("Relu", {"x"}, {"a"}, "relu");
  // Custom-domain operators have no schema: their shapes come from value_info.
  for (const char* t : {"b", "c", "z"}) {
    auto& n = b.node("Foo", {t[0] == 'b' ? "a" : t[0] == 'c' ? "b" : "c"}, {t});
    n.set_domain("example.custom");
    b.value_info(t, {4, 8});
  }
  const OnnxGraph r = parse_onnx(b.bytes());
  ASSERT_EQ(r.graph.size(), 5);
  for (int i = 2; i < 5; ++i) {
    EXPECT_EQ(r.graph.node(i).kind, OpKind::other);
    EXPECT_EQ(r.graph.node(i).op_type, "Foo");
    EXPECT_EQ(r.graph.node(i).name, fmt::format("Foo{}", i - 1));  // op_type + index unnamed
    EXPECT_EQ(r.graph.node(i).inputs, std::vector<int>{i - 1});
  }
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings[0],
            "3 nodes of op 'Foo' are kept replicated: the planner does not know how to shard "
            "them");
}

TEST(OnnxImport, SymbolicDimsNeedValues) {
  ModelBuilder b;
  b.input("x", kFloat, {-1, 16}, {"batch"});
  b.output("y", kFloat, {-1, 4}, {"batch"});
  b.weight("w", {16, 4});
  b.node("MatMul", {"x", "w"}, {"y"}, "fc");
  try {
    parse_onnx(b.bytes(), {}, "model.onnx");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("model.onnx"), std::string::npos) << what;
    EXPECT_NE(what.find("'x'"), std::string::npos) << what;
    EXPECT_NE(what.find("'batch'"), std::string::npos) << what;
    EXPECT_NE(what.find("--dim batch=VALUE"), std::string::npos) << what;
  }
  const OnnxGraph r = parse_onnx(b.bytes(), {.dims = {{"batch", 8}}});
  ASSERT_EQ(r.graph.size(), 2);
  EXPECT_EQ(r.graph.node(0).shape, (Shape{8, 16}));
  EXPECT_EQ(r.graph.node(1).shape, (Shape{8, 4}));
  EXPECT_EQ(r.graph.node(1).flops, 2.0 * 8 * 4 * 16);

  ModelBuilder unsized;
  unsized.input("x", kFloat, {-2, 16});
  unsized.weight("w", {16, 4});
  unsized.node("MatMul", {"x", "w"}, {"y"}, "fc");
  try {
    parse_onnx(unsized.bytes());
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("give the input a fixed shape"), std::string::npos)
        << e.what();
  }
}

TEST(OnnxImport, CyclesAreCorrupt) {
  ModelBuilder b;
  b.input("x", kFloat, {4});
  b.node("Add", {"x", "b"}, {"a"}, "first");
  b.node("Relu", {"a"}, {"b"}, "second");
  b.value_info("a", {4});
  b.value_info("b", {4});
  EXPECT_THROW(parse_onnx(b.bytes()), CorruptDataError);
}

// ids -> Gather wte[100, 16] -> Gemm (transB) with wte: a head tied to the embedding; and
// image[2, 3, 8, 8] -> Conv [4, 3, 3, 3] (+ bias) -> ReduceMean.
std::string embedding_and_conv() {
  ModelBuilder b;
  b.input("ids", kInt64, {8});
  b.input("image", kFloat, {2, 3, 8, 8});
  b.weight("wte", {100, 16});
  b.weight("conv.weight", {4, 3, 3, 3});
  b.weight("conv.bias", {4});
  b.node("Gather", {"wte", "ids"}, {"e"}, "wte");
  ModelBuilder::attr(b.node("Gemm", {"e", "wte"}, {"logits"}, "lm_head"), "transB", 1);
  auto& conv = b.node("Conv", {"image", "conv.weight", "conv.bias"}, {"c"}, "conv");
  ModelBuilder::attr(conv, "pads", Shape{1, 1, 1, 1});
  b.node("ReduceMean", {"c"}, {"pool"}, "pool");
  return b.bytes();
}

TEST(OnnxImport, TiedEmbeddingGemmAndConv) {
  const OnnxGraph r = parse_onnx(embedding_and_conv());
  const OpGraph& g = r.graph;
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  const OpNode& wte = g.node(id_of(g, "wte"));
  EXPECT_EQ(wte.kind, OpKind::gather);
  EXPECT_EQ(wte.weights, (std::vector<Shape>{{100, 16}}));
  EXPECT_EQ(wte.flops, 8 * 16);
  const OpNode& head = g.node(id_of(g, "lm_head"));
  EXPECT_EQ(head.kind, OpKind::matmul);
  EXPECT_EQ(head.shape, (Shape{8, 100}));
  EXPECT_EQ(head.weights_of, id_of(g, "wte"));  // the table, read transposed
  EXPECT_TRUE(head.weights.empty());
  EXPECT_EQ(head.flops, 2.0 * 8 * 100 * 16);
  const OpNode& c = g.node(id_of(g, "conv"));
  EXPECT_EQ(c.kind, OpKind::conv);
  EXPECT_EQ(c.shape, (Shape{2, 4, 8, 8}));
  EXPECT_EQ(c.weights, (std::vector<Shape>{{4, 3, 3, 3}, {4}}));
  EXPECT_EQ(c.flops, 2.0 * (2 * 4 * 8 * 8) * 3 * 3 * 3);  // 2 prod(out) Cin prod(kernel)
  EXPECT_EQ(g.node(id_of(g, "pool")).kind, OpKind::reduce);
  EXPECT_EQ(g.total_parameters(), 100 * 16 + 4 * 3 * 3 * 3 + 4);
}

// Every answer to a damaged file is a graph or a tessel::Error: no crash, no other exception.
// Returns whether it is a graph.
bool expect_graph_or_error(std::string_view bytes, const std::string& what) {
  try {
    parse_onnx(bytes, {.dims = {{"batch", 8}}}, what);
    return true;
  } catch (const Error&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
  return false;
}

// A model that still parses but says something odd: another op_type, an operand renamed to any
// tensor (cycles, a node reading itself) or removed, an attribute or a dimension set to an
// extreme, a shape constant changed, a node removed.
std::string mutate(const std::string& bytes, std::mt19937& rng) {
  onnx::ModelProto m;
  EXPECT_TRUE(m.ParseFromString(bytes));
  auto& g = *m.mutable_graph();
  auto pick = [&](int n) { return n > 0 ? int(rng() % unsigned(n)) : 0; };
  const int64_t extremes[] = {
      -3, -1, 0, 1, 2, 3, 5, int64_t(1) << 31, int64_t(1) << 40, int64_t(1) << 62};
  const int64_t extreme = extremes[pick(std::size(extremes))];
  std::vector<std::string> tensors = {""};
  for (const auto& n : g.node())
    for (const auto& o : n.output()) tensors.push_back(o);
  for (const auto& t : g.initializer()) tensors.push_back(t.name());
  if (g.node_size() == 0) return m.SerializeAsString();
  auto& node = *g.mutable_node(pick(g.node_size()));
  switch (pick(7)) {
    case 0: {
      static const char* ops[] = {"MatMul",    "Gemm",      "Add",
                                  "Sub",       "Mul",       "Div",
                                  "Relu",      "Softmax",   "LayerNormalization",
                                  "Reshape",   "Transpose", "Split",
                                  "Concat",    "Gather",    "ReduceMean",
                                  "Conv",      "Flatten",   "Squeeze",
                                  "Unsqueeze", "Pow",       "Where",
                                  "Expand",    "Tile",      "SoftmaxCrossEntropyLoss",
                                  "Shape",     "Constant",  "If",
                                  "Loop",      "Foo",       "Gelu",
                                  "Slice",     "Einsum",    "TopK",
                                  "Cast"};
      node.set_op_type(ops[pick(std::size(ops))]);
      break;
    }
    case 1:
      if (node.input_size() > 0)
        node.set_input(pick(node.input_size()), tensors[size_t(pick(int(tensors.size())))]);
      break;
    case 2: {
      static const char* names[] = {"axis",     "perm", "transA",  "transB", "group",
                                    "keepdims", "pads", "strides", "split",  "axes"};
      auto* a = node.add_attribute();
      a->set_name(names[pick(std::size(names))]);
      if (rng() % 2) {
        a->set_type(onnx::AttributeProto::INT);
        a->set_i(extreme);
      } else {
        a->set_type(onnx::AttributeProto::INTS);
        for (int i = pick(5); i >= 0; --i) a->add_ints(extremes[pick(std::size(extremes))]);
      }
      break;
    }
    case 3: {
      auto* vi = rng() % 2 ? g.mutable_input() : g.mutable_value_info();
      if (vi->empty()) break;
      auto* shape = (*vi)[pick(vi->size())].mutable_type()->mutable_tensor_type()->mutable_shape();
      if (shape->dim_size() > 0)
        shape->mutable_dim(pick(shape->dim_size()))->set_dim_value(extreme);
      break;
    }
    case 4: {
      auto& t = *g.mutable_initializer(pick(g.initializer_size()));
      if (t.int64_data_size() > 0)
        t.set_int64_data(pick(t.int64_data_size()), extreme);
      else if (t.dims_size() > 0)
        t.set_dims(pick(t.dims_size()), extreme);
      break;
    }
    case 5:
      g.mutable_node()->DeleteSubrange(pick(g.node_size()), 1);
      break;
    case 6:
      if (node.output_size() > 0)
        node.set_output(pick(node.output_size()), tensors[size_t(pick(int(tensors.size())))]);
      break;
  }
  return m.SerializeAsString();
}

TEST(OnnxImport, DamagedFilesAreErrorsNotCrashes) {
  EXPECT_THROW(parse_onnx(""), CorruptDataError);
  EXPECT_THROW(parse_onnx("this is not an ONNX model at all"), CorruptDataError);
  // TESSEL_ONNX_FUZZ=N runs N of each kind of mutation instead (a longer hunt, by hand).
  const char* env = std::getenv("TESSEL_ONNX_FUZZ");
  const int rounds = env ? std::atoi(env) : 150;
  for (const std::string& model : {mlp(), attention_block(), embedding_and_conv()}) {
    for (size_t n = 0; n < model.size(); n += 7)
      expect_graph_or_error(std::string_view(model).substr(0, n), fmt::format("first {}", n));
    std::mt19937 rng(20240611);
    int graphs = 0;
    for (int i = 0; i < rounds; ++i) {
      std::string damaged = model;
      damaged[rng() % damaged.size()] ^= char(1 + rng() % 255);
      graphs += expect_graph_or_error(damaged, fmt::format("byte flip {}", i));
      std::string mutated = model;
      for (int k = 1 + int(rng() % 3); k > 0; --k) mutated = mutate(mutated, rng);
      graphs += expect_graph_or_error(mutated, fmt::format("mutation {}", i));
    }
    // Most damage is caught, but some must get through to the import proper (a flipped byte in
    // a name, a harmless attribute), or the fuzz tests only the parser.
    EXPECT_GT(graphs, rounds / 10);
  }
}

TEST(OnnxImport, ReadsFilesAndNamesMissingOnes) {
  const auto dir = std::filesystem::temp_directory_path() /
                   fmt::format("tessel_onnx_import_test_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const auto path = dir / "mlp.onnx";
  {
    std::ofstream f(path, std::ios::binary);
    f << mlp();
  }
  EXPECT_EQ(import_onnx_file(path).graph.size(), 5);
  EXPECT_THROW(import_onnx_file(dir / "missing.onnx"), IoError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessel::planner
