// The ONNX importer (the program tessel-onnx-import; planner/onnx_graph.h says why it is a
// program of its own and how tessel runs it). An OpGraph (planner/op_graph.h) from an ONNX model
// file, so the graph planner can shard models it has no preset for. The file is parsed with
// Debian's libonnx (ModelProto), its shapes completed by ONNX shape inference (with data
// propagation, so shape arithmetic such as Shape -> Gather -> Concat -> Reshape resolves), and
// every operator becomes one OpNode with its output shape, its forward FLOPs and the weights it
// owns, following transformer_graph.h's conventions: 2 m n k per matmul, one per output element for
// element-wise operators (eight for Gelu), five for norms, softmax and the loss, none for layout
// operators.
//
// Tensors:
//   graph inputs that are not initializers     OpKind::input nodes;
//   floating-point initializers (> 1 element)  weights: the first node reading one owns it
//                                              (OpNode::weights); a later reader ties to it
//                                              (OpNode::weights_of) when it has no weights of its
//                                              own and reads it as op_sharding expects a tied
//                                              one, else lists it again;
//   other initializers, Constant nodes, Shape  constants: no node, no edge (shape, axes and
//   and Size, and nodes computed only from     split operands). Shapes are static here, so a
//   constants                                  shape computation is a constant; such nodes are
//                                              folded and counted in one warning.
// Operators (op_type -> OpKind):
//   MatMul x[.., K] W[K, N], Gemm (transB)     matmul with the weight [K, N] (+ Gemm's bias)
//   MatMul of two activations of equal rank     matmul (batched, q k^T and p v)
//   Add, Sub of two activations                add
//   Add, Sub with a constant or weight operand  gelu: op_sharding lets an add pass partial sums
//                                              through, which would add a bias t times
//   Mul, Div                                    mul (c / x: gelu, it is not linear in x)
//   LayerNormalization (last axis)              layer_norm
//   SimplifiedLayerNormalization, RMSNorm...   rms_norm
//   Softmax, LogSoftmax over the last axis      softmax
//   Gelu, FastGelu, BiasGelu                    gelu
//   unary and n-ary element-wise maps (Relu,    gelu (op_sharding's element-wise map without
//   Sigmoid, Tanh, Erf, Sqrt, Exp, Neg, Cast,   partial sums)
//   Identity, Dropout, Pow, Where, ...)
//   Reshape, Flatten, Squeeze, Unsqueeze        reshape (dim_of from prefix products)
//   Transpose                                   transpose (dim_of from perm)
//   Split                                       one split node per output (dim_of identity)
//   Concat of one activation                    concat
//   Gather from a weight table [V, C]           gather (the embedding)
//   ReduceMean, ReduceSum, ReduceMax, ReduceMin reduce
//   Conv (group 1)                              conv
//   SoftmaxCrossEntropyLoss (scores [N, C])     loss
//   anything else                               other, replicated, with one warning per op_type
// A known operator used in a way op_sharding's strategies do not describe (a MatMul whose weight
// is its first operand, a Softmax over another axis, a Concat of several activations, a grouped
// Conv, ...) is kept as `other` too, with one warning per op_type and reason. No node is dropped:
// outputs past the first (LayerNormalization's mean, Dropout's mask) map to the node itself.
#pragma once

#include <filesystem>
#include <string_view>

#include "tessel/planner/onnx_graph.h"

// In namespace planner: the importer is the planner's front end, built apart only to keep libonnx
// (and its protobuf) out of the tessel binary.
namespace tessel::planner {

// In this process (the importer's). Throws IoError if the file cannot be read, else what
// parse_onnx throws.
OnnxGraph import_onnx_file(const std::filesystem::path& path, const OnnxOptions& options = {});

// Throws CorruptDataError naming `source` for bytes that are no ONNX model (or a truncated one),
// a model without a graph, one that shape inference rejects, a node reading a tensor nothing
// produces, or a cycle; ConfigError for a dimension without a value (naming the tensor, the
// dimension and the fix) or a node whose output shape stays unknown. Never anything but a
// tessel::Error.
OnnxGraph parse_onnx(std::string_view bytes, const OnnxOptions& options = {},
                     std::string_view source = "<memory>");

}  // namespace tessel::planner
