#include "tessel/onnx/onnx_import.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <onnx/defs/schema.h>
#include <onnx/onnx_pb.h>
#include <onnx/shape_inference/implementation.h>

#include <algorithm>
#include <climits>
#include <exception>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/core/mapped_file.h"

namespace tessel::planner {

namespace {

using Shape = std::vector<int64_t>;

// Beyond this many elements a tensor is no model's: products of the dimensions would overflow
// the planner's int64 arithmetic.
constexpr int64_t kMaxElements = int64_t(1) << 60;

bool is_float(int32_t type) {
  using T = onnx::TensorProto;
  return type == T::FLOAT || type == T::FLOAT16 || type == T::DOUBLE || type == T::BFLOAT16;
}

const onnx::AttributeProto* attribute(const onnx::NodeProto& node, std::string_view name) {
  for (const auto& a : node.attribute())
    if (a.name() == name) return &a;
  return nullptr;
}
int64_t attr_int(const onnx::NodeProto& node, std::string_view name, int64_t fallback) {
  const auto* a = attribute(node, name);
  return a ? a->i() : fallback;
}
std::optional<std::vector<int64_t>> attr_ints(const onnx::NodeProto& node, std::string_view name) {
  const auto* a = attribute(node, name);
  if (!a) return std::nullopt;
  return std::vector<int64_t>(a->ints().begin(), a->ints().end());
}

// Element-wise maps with no partial-sum rule (op_sharding treats gelu and silu so; gelu is the
// generic one). Multi-input ones broadcast like any element-wise operator.
const std::unordered_set<std::string>& elementwise_maps() {
  static const std::unordered_set<std::string> ops = {
      "Relu",     "Sigmoid",     "Tanh",       "Erf",  "Sqrt",  "Exp",       "Neg",      "Cast",
      "Identity", "Dropout",     "Reciprocal", "Abs",  "Log",   "LeakyRelu", "Elu",      "Selu",
      "Softplus", "HardSigmoid", "HardSwish",  "Mish", "Clip",  "Where",     "Max",      "Min",
      "Equal",    "Less",        "Greater",    "Not",  "And",   "Or",        "Sin",      "Cos",
      "Floor",    "Ceil",        "Round",      "Sign", "IsNaN", "QuickGelu", "CastLike", "Pow"};
  return ops;
}
bool is_layout(const std::string& op) {
  return op == "Reshape" || op == "Flatten" || op == "Squeeze" || op == "Unsqueeze" ||
         op == "Transpose" || op == "Split" || op == "Concat";
}
bool is_rms_norm(const std::string& op) {
  return op == "SimplifiedLayerNormalization" || op == "RMSNormalization" || op == "RMSNorm";
}
// Operators whose first output has the broadcast shape of their operands: the shape when
// inference gives none (contrib operators, such as com.microsoft's FastGelu, have no schema in
// libonnx).
bool keeps_shape(const std::string& op) {
  return elementwise_maps().contains(op) || op == "Add" || op == "Sub" || op == "Mul" ||
         op == "Div" || op == "Gelu" || op == "FastGelu" || op == "BiasGelu" ||
         op == "LayerNormalization" || is_rms_norm(op) || op == "Softmax" || op == "LogSoftmax";
}

std::optional<Shape> broadcast(const std::vector<const Shape*>& shapes) {
  Shape out;
  for (const Shape* s : shapes) {
    if (s->size() > out.size()) out.insert(out.begin(), s->size() - out.size(), 1);
    const size_t off = out.size() - s->size();
    for (size_t i = 0; i < s->size(); ++i) {
      int64_t& o = out[off + i];
      const int64_t d = (*s)[i];
      if (d == o || d == 1) continue;
      if (o != 1) return std::nullopt;
      o = d;
    }
  }
  return out;
}

// Reshape-like views (Reshape, Flatten, Squeeze, Unsqueeze) keep the elements' row-major order.
// Input dimension d begins after P_in(d) = in[0] ... in[d-1] outer positions. If some output
// dimension e begins at the same P_out(e) = P_in(d) (the first such of size > 1), a split of d
// into t contiguous parts cuts the flat buffer at the same places as a split of e into t parts
// (each of the P outer positions holds the same number of elements after it), so dim_of[d] = e:
// e holds d's outermost part. Otherwise d starts inside an output dimension (the inner D of
// [.., H, D] -> [.., H * D]) and no split of the output matches: -1. Dimensions of size 1
// cannot be split: -1.
std::vector<int> view_dim_of(const Shape& in, const Shape& out) {
  std::vector<int> dim_of(in.size(), -1);
  int64_t p_in = 1;
  for (size_t d = 0; d < in.size(); ++d) {
    if (in[d] > 1) {
      int64_t p_out = 1;
      for (size_t e = 0; e < out.size() && p_out <= p_in; ++e) {
        if (p_out == p_in && out[e] > 1) {
          dim_of[d] = int(e);
          break;
        }
        p_out *= out[e];
      }
    }
    p_in *= in[d];
  }
  return dim_of;
}

std::vector<int> identity_dim_of(size_t rank) {
  std::vector<int> dim_of(rank);
  for (size_t d = 0; d < rank; ++d) dim_of[d] = int(d);
  return dim_of;
}

// One ONNX node's operands, sorted by what they are.
struct Operand {
  enum class Kind { absent, constant, weight, activation };
  Kind kind = Kind::absent;
  std::string name;
};

// What one OpNode will read of a weight initializer: its name, the shape the node's kind wants
// it in (a matmul's [K, N]) and whether that is the file's shape transposed.
struct WeightRead {
  std::string name;
  Shape shape;
  bool transposed = false;
};

// One OpNode to be: the ONNX node it comes from and, for Split, which output.
struct Planned {
  int onnx = -1;       // index into graph.node(), -1 for a graph input
  int output = 0;      // the output this node stands for (Split), else 0
  std::string tensor;  // that output's name
  OpNode node;
  std::vector<WeightRead> reads;
};

class Importer {
 public:
  Importer(onnx::ModelProto& model, const OnnxOptions& options, std::string_view source)
      : model_(model), g_(*model.mutable_graph()), options_(options), source_(source) {}

  OnnxGraph run() {
    OnnxGraph out;
    out.producer = model_.producer_name();
    if (!model_.producer_version().empty()) out.producer += " " + model_.producer_version();
    for (const auto& o : model_.opset_import())
      if (o.domain().empty() || o.domain() == "ai.onnx") out.opset = o.version();
    fill_dims();
    for (const auto& t : g_.initializer()) {
      check_tensor(t, "initializer");
      initializers_[t.name()] = &t;
    }
    verify_nodes();
    fill_kernel_shapes();
    check_rank_operands();
    infer_shapes();
    restore_domains();
    collect_types();
    classify_tensors();
    plan_nodes();
    connect();
    // Cycles first: a node on one has no inferred shape, and the cycle is what is wrong.
    order_ = structure().validate();
    for (int id : order_) describe(id);
    assign_weights();
    for (auto& p : planned_) out.graph.add(std::move(p.node));
    out.graph.validate();
    out.warnings = std::move(warnings_);
    for (const auto& [op, n] : unknown_)
      out.warnings.push_back(fmt::format(
          "{} {} of op '{}' {} kept replicated: the planner does not know how to shard {}", n,
          n == 1 ? "node" : "nodes", op, n == 1 ? "is" : "are", n == 1 ? "it" : "them"));
    for (const auto& [key, w] : downgraded_)
      out.warnings.push_back(fmt::format("{} {} of op '{}' {} kept replicated: {} (e.g. node '{}')",
                                         w.count, w.count == 1 ? "node" : "nodes", key.first,
                                         w.count == 1 ? "is" : "are", key.second, w.example));
    if (!folded_.empty()) {
      int n = 0;
      std::string ops;
      for (const auto& [op, k] : folded_) {
        n += k;
        ops += fmt::format("{}{} {}", ops.empty() ? "" : ", ", k, op);
      }
      out.warnings.push_back(fmt::format(
          "{} {} computed only from constants and static shapes ({}) {} folded into constants: "
          "no operators",
          n, n == 1 ? "node" : "nodes", ops, n == 1 ? "is" : "are"));
    }
    return out;
  }

 private:
  // Symbolic dimensions given a value become fixed before inference, so it propagates them.
  void fill_dims() {
    auto fill = [&](onnx::ValueInfoProto& v) {
      if (!v.has_type() || !v.type().has_tensor_type() || !v.type().tensor_type().has_shape())
        return;
      for (auto& dim : *v.mutable_type()->mutable_tensor_type()->mutable_shape()->mutable_dim())
        if (dim.has_dim_param())
          if (auto it = options_.dims.find(dim.dim_param()); it != options_.dims.end())
            dim.set_dim_value(it->second);
    };
    for (auto& v : *g_.mutable_input()) fill(v);
    for (auto& v : *g_.mutable_output()) fill(v);
    for (auto& v : *g_.mutable_value_info()) fill(v);
  }

  // A tensor's data must be as long as its dims say (when it has any: dims alone are enough
  // here, and external data is not read): shape inference reads constants' values (Reshape's
  // shape, Split's sizes) trusting that, and copies past its buffer otherwise.
  void check_tensor(const onnx::TensorProto& t, std::string_view what) const {
    using T = onnx::TensorProto;
    const Shape dims(t.dims().begin(), t.dims().end());
    check_elements(dims, t.name());
    if (t.data_location() == T::EXTERNAL) return;
    int64_t size = 0;  // bytes per element in raw_data
    int64_t per = 1;   // entries per element in the typed field
    int64_t typed = 0;
    switch (t.data_type()) {
      case T::FLOAT:
        size = 4, typed = t.float_data_size();
        break;
      case T::COMPLEX64:
        size = 8, per = 2, typed = t.float_data_size();
        break;
      case T::UINT8:
      case T::INT8:
      case T::BOOL:
        size = 1, typed = t.int32_data_size();
        break;
      case T::UINT16:
      case T::INT16:
      case T::FLOAT16:
      case T::BFLOAT16:
        size = 2, typed = t.int32_data_size();
        break;
      case T::INT32:
        size = 4, typed = t.int32_data_size();
        break;
      case T::INT64:
        size = 8, typed = t.int64_data_size();
        break;
      case T::UINT32:
        size = 4, typed = t.uint64_data_size();
        break;
      case T::UINT64:
        size = 8, typed = t.uint64_data_size();
        break;
      case T::DOUBLE:
        size = 8, typed = t.double_data_size();
        break;
      case T::COMPLEX128:
        size = 16, per = 2, typed = t.double_data_size();
        break;
      case T::STRING:
        typed = t.string_data_size();
        break;
      default:
        TESSEL_THROW(CorruptDataError, "{}: {} '{}' has the unknown data type {}", source_, what,
                     t.name(), t.data_type());
    }
    const int64_t n = elements(dims);
    if (t.has_raw_data()) {
      TESSEL_CHECK(size > 0 && int64_t(t.raw_data().size()) == n * size, CorruptDataError,
                   "{}: {} '{}' has {} bytes of data for {} elements of {} bytes", source_, what,
                   t.name(), t.raw_data().size(), n, size);
    } else {
      TESSEL_CHECK(typed == 0 || typed == n * per, CorruptDataError,
                   "{}: {} '{}' has {} values for {} elements", source_, what, t.name(), typed, n);
    }
  }

  // Each node against its schema (operand and output counts, attribute types), as the ONNX
  // checker does: shape inference trusts them and crashes on a node that has too few.
  // Operators without a schema (contrib domains, unknown op_types) are left to `other`.
  void verify_nodes() const {
    std::unordered_map<std::string, int> versions;
    for (const auto& o : model_.opset_import())
      versions[o.domain() == "ai.onnx" ? "" : o.domain()] = int(o.version());
    for (int i = 0; i < g_.node_size(); ++i) {
      const auto& node = g_.node(i);
      for (const auto& a : node.attribute()) {
        if (a.has_t()) check_tensor(a.t(), fmt::format("attribute '{}' of node", a.name()));
        for (const auto& t : a.tensors())
          check_tensor(t, fmt::format("attribute '{}' of node", a.name()));
      }
      const std::string domain = node.domain() == "ai.onnx" ? "" : node.domain();
      auto it = versions.find(domain);
      if (it == versions.end()) continue;  // shape inference names the missing import
      const auto* schema = onnx::OpSchemaRegistry::Schema(node.op_type(), it->second, domain);
      if (!schema) continue;
      try {
        schema->Verify(node);
      } catch (const std::exception& e) {
        TESSEL_THROW(CorruptDataError, "{}: node '{}' ({}) does not match its ONNX schema: {}",
                     source_, node_name(i), node.op_type(), e.what());
      }
    }
  }

  // libonnx 1.12 takes a Conv's kernel from its weight's dims when kernel_shape is absent and
  // indexes the (input-rank) strides and dilations with it unchecked: a weight whose rank
  // differs from the input's reads past them. The attribute (the same value, by the spec) is
  // checked against the input's rank.
  // It also divides by strides unchecked: window attributes must be positive (pads not
  // negative), and small enough for its int64 arithmetic.
  void fill_kernel_shapes() {
    static const std::unordered_set<std::string> windowed = {
        "Conv",        "ConvTranspose", "ConvInteger", "QLinearConv", "MaxPool",
        "AveragePool", "LpPool",        "MaxUnpool",   "MaxRoiPool"};
    for (int i = 0; i < g_.node_size(); ++i) {
      auto& node = *g_.mutable_node(i);
      if (!windowed.contains(node.op_type())) continue;
      for (const auto& a : node.attribute()) {
        const bool pads = a.name() == "pads" || a.name() == "output_padding";
        if (!pads && a.name() != "strides" && a.name() != "dilations" && a.name() != "kernel_shape")
          continue;
        for (int64_t v : a.ints())
          TESSEL_CHECK(v >= (pads ? 0 : 1) && v <= (int64_t(1) << 31), CorruptDataError,
                       "{}: node '{}' ({}) has {} [{}]; they must be {} and below 2^31", source_,
                       node_name(i), node.op_type(), a.name(), fmt::join(a.ints(), ", "),
                       pads ? "non-negative" : "positive");
      }
      if ((node.op_type() != "Conv" && node.op_type() != "ConvTranspose") ||
          attribute(node, "kernel_shape") || node.input_size() < 2)
        continue;
      auto it = initializers_.find(node.input(1));
      if (it == initializers_.end()) {
        // A weight computed in the graph: its rank is unknown until inference, which would
        // trust it. Inference skips the node (a private domain; the import maps op_types, not
        // domains), whose output shape must then come from value_info.
        if (hidden_.empty()) {
          auto* o = model_.add_opset_import();
          o->set_domain("tessel.uninferred");
          o->set_version(1);
        }
        hidden_.push_back({i, node.domain()});
        node.set_domain("tessel.uninferred");
        continue;
      }
      const auto& dims = it->second->dims();
      TESSEL_CHECK(dims.size() >= 3, CorruptDataError,
                   "{}: node '{}' ({}) has the weight '{}' of rank {}; a convolution's is [C_out, "
                   "C_in, kernel...]",
                   source_, node_name(i), node.op_type(), node.input(1), dims.size());
      auto* a = node.add_attribute();
      a->set_name("kernel_shape");
      a->set_type(onnx::AttributeProto::INTS);
      for (int d = 2; d < dims.size(); ++d) a->add_ints(dims[d]);
    }
  }

  // Reshape, Expand and ConstantOfShape take their output's rank from the length of a 1-D
  // operand; libonnx makes that many dimensions even when the values are unknown, so a declared
  // length of 2^62 exhausts memory. No model has a rank beyond kMaxRank.
  void check_rank_operands() const {
    constexpr int64_t kMaxRank = 1024;
    std::unordered_map<std::string, const onnx::TypeProto*> declared;
    for (const auto* list : {&g_.input(), &g_.value_info(), &g_.output()})
      for (const auto& v : *list) declared[v.name()] = &v.type();
    for (int i = 0; i < g_.node_size(); ++i) {
      const auto& node = g_.node(i);
      const int operand = node.op_type() == "ConstantOfShape"                         ? 0
                          : node.op_type() == "Reshape" || node.op_type() == "Expand" ? 1
                                                                                      : -1;
      if (operand < 0 || node.input_size() <= operand) continue;
      const std::string& name = node.input(operand);
      int64_t length = -1;
      if (auto it = initializers_.find(name); it != initializers_.end()) {
        if (it->second->dims_size() == 1) length = it->second->dims(0);
      } else if (auto d = declared.find(name); d != declared.end() &&
                                               d->second->has_tensor_type() &&
                                               d->second->tensor_type().shape().dim_size() == 1) {
        length = d->second->tensor_type().shape().dim(0).dim_value();
      }
      TESSEL_CHECK(length <= kMaxRank, CorruptDataError,
                   "{}: node '{}' ({}) takes its output's rank from '{}', of {} elements", source_,
                   node_name(i), node.op_type(), name, length);
    }
  }

  // Twice: without data propagation, then with it (shape arithmetic such as Shape -> Gather ->
  // Concat -> Reshape) only if every Shape and Size node's input got a shape, because
  // libonnx 1.12's propagation reads that input's type without checking it exists.
  void infer_shapes() {
    infer(false);
    std::unordered_set<std::string> shaped;
    for (const auto* list : {&g_.input(), &g_.value_info(), &g_.output()})
      for (const auto& v : *list)
        if (v.type().has_tensor_type() && v.type().tensor_type().has_shape())
          shaped.insert(v.name());
    for (const auto& node : g_.node())
      if ((node.op_type() == "Shape" || node.op_type() == "Size") &&
          (node.input_size() < 1 ||
           (!shaped.contains(node.input(0)) && !initializers_.contains(node.input(0)))))
        return;
    infer(true);
  }
  void restore_domains() {
    for (const auto& [i, domain] : hidden_) g_.mutable_node(i)->set_domain(domain);
  }
  void infer(bool propagate) {
    try {
      // Node-level inference errors are not fatal (error mode 0): a contrib operator without a
      // schema keeps its declared shape or gets one from its kind below.
      onnx::shape_inference::InferShapes(model_, onnx::OpSchemaRegistry::Instance(),
                                         onnx::ShapeInferenceOptions(false, 0, propagate));
    } catch (const std::exception& e) {
      TESSEL_THROW(CorruptDataError, "{}: ONNX shape inference rejects the model: {}", source_,
                   e.what());
    } catch (...) {
      TESSEL_THROW(CorruptDataError, "{}: ONNX shape inference rejects the model", source_);
    }
  }

  void collect_types() {
    for (const auto& v : g_.input()) types_[v.name()] = &v.type();
    for (const auto& v : g_.value_info()) types_[v.name()] = &v.type();
    for (const auto& v : g_.output()) types_[v.name()] = &v.type();
  }

  // A fixed shape from a declared one; `fix` says how to fix a dimension without a value.
  Shape resolve(const onnx::TensorShapeProto& s, const std::string& tensor,
                std::string_view fix) const {
    Shape out;
    for (int d = 0; d < s.dim_size(); ++d) {
      const auto& dim = s.dim(d);
      int64_t v = -1;
      if (dim.has_dim_value()) {
        v = dim.dim_value();
      } else if (dim.has_dim_param() && !dim.dim_param().empty() &&
                 !dim.dim_param().starts_with("unk__")) {  // inference's own made-up symbols
        auto it = options_.dims.find(dim.dim_param());
        TESSEL_CHECK(it != options_.dims.end(), ConfigError,
                     "{}: dimension {} of '{}' is the symbol '{}', which has no value: pass {}",
                     source_, d, tensor, dim.dim_param(),
                     fmt::format(fmt::runtime(options_.dim_syntax), dim.dim_param()));
        v = it->second;
      } else {
        TESSEL_THROW(ConfigError, "{}: dimension {} of '{}' has no size: {}", source_, d, tensor,
                     fix);
      }
      TESSEL_CHECK(v >= 0, CorruptDataError, "{}: dimension {} of '{}' is {}", source_, d, tensor,
                   v);
      out.push_back(v);
    }
    check_elements(out, tensor);
    return out;
  }
  void check_elements(const Shape& s, const std::string& tensor) const {
    int64_t n = 1;
    for (int64_t d : s) {
      TESSEL_CHECK(d >= 0 && (d == 0 || n <= kMaxElements / d), CorruptDataError,
                   "{}: tensor '{}' has dimensions {} (more than 2^60 elements or negative)",
                   source_, tensor, fmt::join(s, " x "));
      n *= d;
    }
  }
  // The declared (or inferred) shape of a tensor, if any.
  std::optional<Shape> declared(const std::string& tensor, std::string_view fix) const {
    if (auto it = initializers_.find(tensor); it != initializers_.end()) {
      Shape s(it->second->dims().begin(), it->second->dims().end());
      check_elements(s, tensor);
      return s;
    }
    auto it = types_.find(tensor);
    if (it == types_.end() || !it->second->has_tensor_type() ||
        !it->second->tensor_type().has_shape())
      return std::nullopt;
    return resolve(it->second->tensor_type().shape(), tensor, fix);
  }

  void classify_tensors() {
    for (const auto& t : g_.initializer()) {
      const Shape s(t.dims().begin(), t.dims().end());
      check_elements(s, t.name());
      // A scalar (a 1 / sqrt(d) scale, an exponent) is a constant, not a parameter to shard.
      // External-data initializers (data_location EXTERNAL) need only their dims here.
      if (is_float(t.data_type()) && elements(s) > 1)
        weights_.insert(t.name());
      else
        constants_.insert(t.name());
    }
    // Shapes are static once resolved, so Shape and Size are constants, and so is whatever is
    // computed only from constants (shape arithmetic, masks from ConstantOfShape). Repeat until
    // nothing changes, for files that list nodes out of order.
    folded_node_.assign(size_t(g_.node_size()), 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (int i = 0; i < g_.node_size(); ++i) {
        if (folded_node_[size_t(i)]) continue;
        const auto& node = g_.node(i);
        bool constant =
            node.op_type() == "Constant" || node.op_type() == "Shape" || node.op_type() == "Size";
        if (!constant) {
          int read = 0;
          constant = true;
          for (const auto& in : node.input()) {
            if (in.empty()) continue;
            ++read;
            if (!constants_.contains(in)) constant = false;
          }
          constant = constant && read > 0;
        }
        if (!constant) continue;
        folded_node_[size_t(i)] = 1;
        changed = true;
        if (node.op_type() != "Constant") ++folded_[node.op_type()];
        for (const auto& o : node.output())
          if (!o.empty()) constants_.insert(o);
      }
    }
    // An Identity of a weight (PyTorch's exporter writes one for each initializer equal to
    // another, e.g. the zero biases of convolutions with batch norm folded in) is that weight.
    for (int i = 0; i < g_.node_size(); ++i) {
      const auto& node = g_.node(i);
      if (folded_node_[size_t(i)] || node.op_type() != "Identity" || node.input_size() != 1 ||
          node.output_size() != 1 || !weights_.contains(node.input(0)))
        continue;
      folded_node_[size_t(i)] = 1;
      ++folded_["Identity"];
      aliases_[node.output(0)] = node.input(0);
    }
  }

  std::string node_name(int i) const {
    const auto& node = g_.node(i);
    return node.name().empty() ? fmt::format("{}{}", node.op_type(), i) : node.name();
  }

  void plan_nodes() {
    for (const auto& v : g_.input()) {
      if (initializers_.contains(v.name())) continue;  // IR < 4 lists initializers as inputs
      Planned p;
      p.tensor = v.name();
      p.node.name = v.name();
      p.node.kind = OpKind::input;
      produce(v.name(), int(planned_.size()));
      planned_.push_back(std::move(p));
    }
    for (int i = 0; i < g_.node_size(); ++i) {
      if (folded_node_[size_t(i)]) continue;
      const auto& node = g_.node(i);
      std::vector<int> outputs;
      for (int o = 0; o < node.output_size(); ++o)
        if (!node.output(o).empty()) outputs.push_back(o);
      TESSEL_CHECK(!outputs.empty(), CorruptDataError, "{}: node '{}' ({}) has no outputs", source_,
                   node_name(i), node.op_type());
      const bool split = node.op_type() == "Split" && outputs.size() > 1;
      for (size_t k = 0; k < (split ? outputs.size() : 1); ++k) {
        Planned p;
        p.onnx = i;
        p.output = outputs[k];
        p.tensor = node.output(outputs[k]);
        p.node.name = split ? fmt::format("{}.{}", node_name(i), k) : node_name(i);
        p.node.op_type = node.op_type();
        const int id = int(planned_.size());
        if (split) {
          produce(p.tensor, id);
        } else {
          for (int o : outputs) produce(node.output(o), id);  // later outputs: the same node
        }
        planned_.push_back(std::move(p));
      }
    }
  }
  void produce(const std::string& tensor, int id) {
    TESSEL_CHECK(producer_.emplace(tensor, id).second, CorruptDataError,
                 "{}: tensor '{}' is produced twice (a graph input, or two nodes' outputs)",
                 source_, tensor);
  }

  Operand operand(const std::string& name, int onnx_node) const {
    if (name.empty()) return {};
    if (constants_.contains(name)) return {Operand::Kind::constant, name};
    if (weights_.contains(name)) return {Operand::Kind::weight, name};
    if (auto it = aliases_.find(name); it != aliases_.end())
      return {Operand::Kind::weight, it->second};
    TESSEL_CHECK(producer_.contains(name), CorruptDataError,
                 "{}: node '{}' reads tensor '{}', which no node, graph input or initializer "
                 "produces",
                 source_, node_name(onnx_node), name);
    return {Operand::Kind::activation, name};
  }

  // Edges: every activation operand, in operand order.
  void connect() {
    operands_.resize(size_t(g_.node_size()));
    for (auto& p : planned_) {
      if (p.onnx < 0) continue;
      auto& ops = operands_[size_t(p.onnx)];
      if (ops.empty())
        for (const auto& in : g_.node(p.onnx).input()) ops.push_back(operand(in, p.onnx));
      for (const auto& o : ops)
        if (o.kind == Operand::Kind::activation) p.node.inputs.push_back(producer_.at(o.name));
    }
  }

  OpGraph structure() const {
    OpGraph g;
    for (const auto& p : planned_) {
      OpNode n;
      n.name = p.node.name;
      n.inputs = p.node.inputs;
      g.add(std::move(n));
    }
    return g;
  }

  const Shape& shape_of(const std::string& tensor) const {
    auto it = shapes_.find(tensor);
    if (it != shapes_.end()) return it->second;
    if (auto w = weight_shapes_.find(tensor); w != weight_shapes_.end()) return w->second;
    TESSEL_THROW(ConfigError,
                 "{}: the shape of '{}' is unknown after shape inference: give the graph inputs "
                 "fixed shapes, or add its shape to the model's value_info",
                 source_, tensor);
  }
  const Shape& weight_shape(const std::string& name) {
    auto it = weight_shapes_.find(name);
    if (it == weight_shapes_.end()) {
      const auto* t = initializers_.at(name);
      it = weight_shapes_.emplace(name, Shape(t->dims().begin(), t->dims().end())).first;
    }
    return it->second;
  }

  void downgrade(Planned& p, const std::string& reason) {
    p.node.kind = OpKind::other;
    p.node.dim_of.clear();
    auto& w = downgraded_[{p.node.op_type, reason}];
    if (w.count++ == 0) w.example = p.node.name;
  }

  // Shape, kind, FLOPs, dim_of and the weights it reads of node `id`; inputs come first.
  void describe(int id) {
    Planned& p = planned_[size_t(id)];
    OpNode& n = p.node;
    if (p.onnx < 0) {
      auto s = declared(p.tensor, "give the input a fixed shape");
      TESSEL_CHECK(s.has_value(), ConfigError,
                   "{}: graph input '{}' has no shape: give the input a fixed shape", source_,
                   p.tensor);
      n.shape = *s;
      shapes_[p.tensor] = n.shape;
      return;
    }
    const auto& node = g_.node(p.onnx);
    const std::string& op = node.op_type();
    const auto& ops = operands_[size_t(p.onnx)];
    std::vector<size_t> acts, weights;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind == Operand::Kind::activation) acts.push_back(i);
      if (ops[i].kind == Operand::Kind::weight) {
        weights.push_back(i);
        check_elements(weight_shape(ops[i].name), ops[i].name);
      }
    }
    const std::string fix =
        fmt::format("give the graph inputs fixed shapes (or {} for their symbols)",
                    fmt::format(fmt::runtime(options_.dim_syntax), "NAME"));
    auto out = declared(p.tensor, fix);
    if (!out && keeps_shape(op)) {
      std::vector<const Shape*> in;
      for (size_t i : acts) in.push_back(&shape_of(ops[i].name));
      for (size_t i : weights) in.push_back(&weight_shape(ops[i].name));
      if (!in.empty()) out = broadcast(in);
    }
    TESSEL_CHECK(out.has_value(), ConfigError,
                 "{}: the shape of '{}', output of node '{}' ({}), is unknown after shape "
                 "inference: {}, or add the output's shape to the model's value_info",
                 source_, p.tensor, n.name, op, fix);
    n.shape = *out;
    shapes_[p.tensor] = n.shape;
    // Later outputs of the same node, when known (a reader of an unknown one says so).
    if (op != "Split")
      for (int o = 1; o < node.output_size(); ++o)
        if (!node.output(o).empty()) try {
            if (auto s = declared(node.output(o), fix)) shapes_[node.output(o)] = *s;
          } catch (const ConfigError&) {
          }
    const double out_elements = double(elements(n.shape));
    auto is = [&](size_t i, Operand::Kind k) { return i < ops.size() && ops[i].kind == k; };
    auto act_shape = [&](size_t i) -> const Shape& { return shape_of(ops[i].name); };
    auto read = [&](size_t i, bool transposed = false) {
      Shape s = weight_shape(ops[i].name);
      if (transposed) std::reverse(s.begin(), s.end());
      p.reads.push_back({ops[i].name, s, transposed});
    };
    auto read_all_weights = [&] {
      for (size_t i : weights) read(i);
    };
    n.flops = out_elements;  // element-wise and unknown operators: one per output element
    n.kind = OpKind::other;

    if (op == "MatMul") {
      // x [..., K] times a weight [K, N], or stacked weights [E..., K, N] (experts) whose
      // leading dimensions line up with x's.
      if (acts.size() == 1 && acts[0] == 0 && weights.size() == 1 && weights[0] == 1 &&
          weight_shape(ops[1].name).size() >= 2 &&
          act_shape(0).size() >= weight_shape(ops[1].name).size()) {
        n.kind = OpKind::matmul;
        read(1);
        n.flops = 2.0 * out_elements * double(act_shape(0).back());
      } else if (acts.size() == 2 && weights.empty() && act_shape(0).size() == n.shape.size() &&
                 act_shape(1).size() == n.shape.size() && n.shape.size() >= 2) {
        n.kind = OpKind::matmul;
        n.flops = 2.0 * out_elements * double(act_shape(0).back());
      } else {
        read_all_weights();
        downgrade(p,
                  "a MatMul shards as activation x weight [..., K, N] or as two activations of "
                  "the output's rank");
      }
      return;
    }
    if (op == "Gemm") {
      const bool trans_a = attr_int(node, "transA", 0) != 0,
                 trans_b = attr_int(node, "transB", 0) != 0;
      const bool bias_ok = !is(2, Operand::Kind::activation);
      if (!trans_a && bias_ok && acts.size() == 1 && acts[0] == 0 && is(1, Operand::Kind::weight) &&
          weight_shape(ops[1].name).size() == 2 && act_shape(0).size() == 2) {
        n.kind = OpKind::matmul;
        // Kept as [K, N], op_sharding's layout; transposed marks a file holding [N, K].
        read(1, trans_b);
        if (is(2, Operand::Kind::weight)) read(2);
        n.flops = 2.0 * out_elements * double(act_shape(0).back());
      } else if (!trans_a && bias_ok && acts.size() == 2 && weights.empty() && acts[1] == 1 &&
                 act_shape(0).size() == 2 && act_shape(1).size() == 2) {
        n.kind = OpKind::matmul;
        n.flops = 2.0 * out_elements * double(act_shape(0).back());
      } else {
        read_all_weights();
        downgrade(p,
                  "a Gemm shards as A x weight B (+ a bias C) or A x B of activations, without "
                  "transA");
      }
      return;
    }
    if (op == "Add" || op == "Sub") {
      read_all_weights();
      if (acts.size() == 2) {
        n.kind = OpKind::add;
      } else if (acts.size() == 1) {
        // A bias (or constant) added to one activation: not a sum of partials, so not `add`,
        // whose strategies pass partial sums through (the bias would be added t times).
        n.kind = OpKind::gelu;
      } else {
        downgrade(p, "it reads no activation");
      }
      return;
    }
    if (op == "Mul" || op == "Div") {
      read_all_weights();
      if (acts.empty()) {
        downgrade(p, "it reads no activation");
      } else if (op == "Div" && acts.size() == 1 && acts[0] == 1) {
        n.kind = OpKind::gelu;  // c / x: not linear in x, so no partial sums
      } else {
        // x * c and x / c are linear in x: op_sharding's mul of one input passes partial sums.
        n.kind = OpKind::mul;
      }
      return;
    }
    if (op == "Pow" && is(1, Operand::Kind::activation)) {
      n.kind = OpKind::mul;  // x^y of two activations: element-wise binary, two inputs
      return;
    }
    if (op == "LayerNormalization" || is_rms_norm(op) || op == "Softmax" || op == "LogSoftmax") {
      read_all_weights();
      const int64_t rank = int64_t(n.shape.size());
      const bool softmax = op == "Softmax" || op == "LogSoftmax";
      // Softmax's axis defaulted to 1 (on the input flattened to 2-D) before opset 13.
      const int64_t fallback = softmax && opset() < 13 ? 1 : -1;
      int64_t axis = attr_int(node, "axis", fallback);
      if (axis < 0) axis += rank;
      if (acts.size() != 1 || acts[0] != 0) {
        downgrade(p, "its scale or bias is an activation");
      } else if (rank == 0 || axis != rank - 1) {
        downgrade(p, fmt::format("it normalises axis {} of a rank-{} tensor, not the last one",
                                 axis, rank));
      } else {
        n.kind = softmax                      ? OpKind::softmax
                 : op == "LayerNormalization" ? OpKind::layer_norm
                                              : OpKind::rms_norm;
        n.flops = 5.0 * out_elements;
      }
      return;
    }
    if (op == "Gelu" || op == "FastGelu" || op == "BiasGelu" || elementwise_maps().contains(op)) {
      read_all_weights();
      if (acts.empty()) {
        downgrade(p, "it reads no activation");
      } else {
        n.kind = OpKind::gelu;
        if (op == "Gelu" || op == "FastGelu" || op == "BiasGelu") n.flops = 8.0 * out_elements;
      }
      return;
    }
    if (is_layout(op)) {
      read_all_weights();
      n.flops = 0;
      if (acts.size() != 1 || acts[0] != 0) {
        downgrade(p, op == "Concat" ? "op_sharding's concat reads one activation"
                                    : "its data operand is not its only activation");
        return;
      }
      const Shape& in = act_shape(0);
      if (op == "Transpose") {
        std::vector<int64_t> perm;
        if (auto a = attr_ints(node, "perm")) {
          perm = *a;
        } else {
          for (size_t i = in.size(); i > 0; --i) perm.push_back(int64_t(i) - 1);
        }
        std::vector<int> dim_of(in.size(), -1);
        bool ok = perm.size() == in.size() && n.shape.size() == in.size();
        for (size_t i = 0; ok && i < perm.size(); ++i) {
          ok = perm[i] >= 0 && perm[i] < int64_t(in.size()) && dim_of[size_t(perm[i])] < 0;
          if (ok) dim_of[size_t(perm[i])] = int(i);  // output dim i is input dim perm[i]
        }
        TESSEL_CHECK(ok, CorruptDataError,
                     "{}: node '{}' (Transpose) has perm [{}], which is no permutation of its "
                     "rank-{} input",
                     source_, n.name, fmt::join(perm, ", "), in.size());
        n.kind = OpKind::transpose;
        n.dim_of = std::move(dim_of);
      } else if (op == "Split" || op == "Concat") {
        if (n.shape.size() != in.size()) {
          downgrade(p, "its output's rank differs from its input's");
          return;
        }
        n.dim_of = identity_dim_of(in.size());
        if (op == "Split") {
          // As transformer_graph's q / k / v: a split of the fused output along the split axis
          // is taken as a split of each part (Megatron lays the fused weight out per partition).
          n.kind = OpKind::split;
        } else {
          // The other operands are constants; a split along the axis is no split of the output.
          int64_t axis = attr_int(node, "axis", 0);
          if (axis < 0) axis += int64_t(in.size());
          if (axis >= 0 && axis < int64_t(in.size())) n.dim_of[size_t(axis)] = -1;
          n.kind = OpKind::concat;
        }
      } else {
        n.kind = OpKind::reshape;
        n.dim_of = view_dim_of(in, n.shape);
      }
      return;
    }
    if (op == "Gather") {
      read_all_weights();
      if (is(0, Operand::Kind::weight) && weight_shape(ops[0].name).size() == 2 &&
          acts.size() == 1 && acts[0] == 1 && attr_int(node, "axis", 0) == 0) {
        n.kind = OpKind::gather;
      } else {
        downgrade(p, "it is no embedding lookup (a weight table [V, C] indexed by activations)");
      }
      return;
    }
    if (op == "ReduceMean" || op == "ReduceSum" || op == "ReduceMax" || op == "ReduceMin" ||
        op == "GlobalAveragePool" || op == "GlobalMaxPool" || op == "MaxPool" ||
        op == "AveragePool") {
      read_all_weights();
      if (acts.size() == 1 && acts[0] == 0) {
        n.kind = OpKind::reduce;
        n.flops = double(elements(act_shape(0)));
      } else {
        downgrade(p, "its data operand is not its only activation");
      }
      return;
    }
    if (op == "Conv") {
      read_all_weights();
      const int64_t group = attr_int(node, "group", 1);
      if (acts.size() == 1 && acts[0] == 0 && is(1, Operand::Kind::weight) &&
          !is(2, Operand::Kind::activation) && group == 1 &&
          weight_shape(ops[1].name).size() >= 3 && act_shape(0).size() >= 2 &&
          n.shape.size() >= 2) {
        n.kind = OpKind::conv;
        const Shape& w = weight_shape(ops[1].name);  // [Cout, Cin / group, kernel...]
        double per_output = 1;
        for (size_t i = 1; i < w.size(); ++i) per_output *= double(w[i]);
        n.flops = 2.0 * out_elements * per_output;
      } else {
        downgrade(p, group != 1 ? "op_sharding's input-channel split assumes group 1"
                                : "it shards as activation * weight (+ bias)");
      }
      return;
    }
    if (op == "SoftmaxCrossEntropyLoss") {
      read_all_weights();
      if (acts.size() == 2 && acts[0] == 0 && acts[1] == 1 && n.shape.empty() &&
          act_shape(0).size() == 2) {
        n.kind = OpKind::loss;
        n.flops = 5.0 * double(elements(act_shape(0)));
      } else {
        downgrade(p, "op_sharding's loss reads scores [N, C] and labels and reduces to a scalar");
      }
      return;
    }
    read_all_weights();
    ++unknown_[op];
  }

  // The first reader of a weight owns it. A later reader with no weights of its own ties to the
  // owner (weights_of) when it reads the owner's first weight in the orientation op_sharding
  // assumes for a tie: a matmul reads the owner's table as [N, K] (Gemm transB over an embedding
  // table), any other kind as the owner holds it. Otherwise it lists the weight as its own: the
  // planner then counts that weight twice (parameters, memory) but plans each reader correctly.
  void assign_weights() {
    struct Owner {
      int id;
      bool transposed;
      bool first;  // the owner's first weight
    };
    std::unordered_map<std::string, Owner> owner;
    for (int id = 0; id < int(planned_.size()); ++id) {
      Planned& p = planned_[size_t(id)];
      std::vector<const WeightRead*> shared;
      for (const auto& r : p.reads) {
        auto it = owner.find(r.name);
        if (it == owner.end()) {
          owner.emplace(r.name, Owner{id, r.transposed, p.node.weights.empty()});
          p.node.weights.push_back(r.shape);
        } else {
          shared.push_back(&r);
        }
      }
      if (shared.empty()) continue;
      if (p.node.weights.empty() && shared.size() == 1) {
        const Owner& o = owner.at(shared[0]->name);
        const bool matmul = p.node.kind == OpKind::matmul;
        if (o.first && (matmul ? o.transposed != shared[0]->transposed
                               : o.transposed == shared[0]->transposed)) {
          p.node.weights_of = o.id;
          continue;
        }
      }
      for (const WeightRead* r : shared) p.node.weights.push_back(r->shape);
    }
  }

  int64_t opset() const {
    for (const auto& o : model_.opset_import())
      if (o.domain().empty() || o.domain() == "ai.onnx") return o.version();
    return 0;
  }

  struct Downgrade {
    int count = 0;
    std::string example;
  };

  onnx::ModelProto& model_;
  onnx::GraphProto& g_;
  const OnnxOptions& options_;
  std::string source_;
  std::unordered_map<std::string, const onnx::TypeProto*> types_;
  std::unordered_map<std::string, const onnx::TensorProto*> initializers_;
  std::unordered_set<std::string> weights_, constants_;
  std::map<std::string, std::string> aliases_;  // an Identity's output -> the weight it copies
  std::vector<char> folded_node_;
  std::vector<std::pair<int, std::string>> hidden_;  // nodes kept from inference, their domain
  std::map<std::string, int> folded_;                // op_type -> nodes folded into constants
  std::map<std::string, int> unknown_;               // op_type -> nodes kept as `other`
  std::map<std::pair<std::string, std::string>, Downgrade> downgraded_;
  std::vector<std::string> warnings_;
  std::unordered_map<std::string, int> producer_;  // tensor -> the planned node producing it
  std::vector<Planned> planned_;
  std::vector<std::vector<Operand>> operands_;  // per ONNX node
  std::vector<int> order_;
  std::unordered_map<std::string, Shape> shapes_;  // resolved activation shapes
  std::unordered_map<std::string, Shape> weight_shapes_;
};

}  // namespace

OnnxGraph parse_onnx(std::string_view bytes, const OnnxOptions& options, std::string_view source) {
  onnx::ModelProto model;
  TESSEL_CHECK(bytes.size() <= size_t(INT_MAX), CorruptDataError,
               "{}: {} bytes is beyond protobuf's 2 GiB limit: save the model with its weights "
               "as external data",
               source, bytes.size());
  TESSEL_CHECK(model.ParseFromArray(bytes.data(), int(bytes.size())), CorruptDataError,
               "{}: not an ONNX model or truncated ({} bytes do not parse as a ModelProto)", source,
               bytes.size());
  TESSEL_CHECK(model.has_graph(), CorruptDataError,
               "{}: not an ONNX model or truncated: the ModelProto has no graph", source);
  try {
    return Importer(model, options, source).run();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // Protobuf and onnx report through std exceptions; the caller sees a tessel error.
    TESSEL_THROW(CorruptDataError, "{}: the ONNX model cannot be read: {}", source, e.what());
  }
}

OnnxGraph import_onnx_file(const std::filesystem::path& path, const OnnxOptions& options) {
  std::error_code ec;
  TESSEL_CHECK(std::filesystem::is_regular_file(path, ec), IoError,
               "cannot read ONNX model '{}': no such file (export one with torch.onnx.export, or "
               "see tools/make_test_onnx.py)",
               path.string());
  const MappedFile file = MappedFile::open(path.string());
  return parse_onnx(std::string_view(reinterpret_cast<const char*>(file.data()), file.size()),
                    options, options.source.empty() ? path.string() : options.source);
}

}  // namespace tessel::planner
