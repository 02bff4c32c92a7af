// The operator graph the graph planner works on (issue 20): one node per operator of a model's
// forward pass, each with its output shape, its forward FLOPs and the weight it owns, and edges
// from the operators whose outputs it reads. Built from a ModelConfig for the presets
// (transformer_graph.h) or, later, from an ONNX file.
//
// A graph is a DAG. Nodes may be added in any order and name inputs not added yet (an ONNX
// file lists its nodes in any order the writer liked); validate() checks the whole and returns a
// topological order, or names what is wrong: an input that is no node, or a cycle.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::planner {

// What an operator is, as far as sharding cares: the matmul family (a contraction dimension
// that can be split, leaving partial sums), element-wise maps (split along any dimension),
// normalisations and softmax (split along every dimension but the normalised last one),
// reductions, layout changes, gathers (the embedding: split the table's rows or columns), and
// `other`, an operator the planner does not know and keeps replicated.
enum class OpKind {
  input,   // data entering the graph (token ids, targets)
  gather,  // embedding lookup: out = table[ids]
  matmul,  // out = a b (+ bias), batched over leading dimensions
  add,     // element-wise binary
  mul,     // element-wise binary
  layer_norm,
  rms_norm,
  softmax,  // over the last dimension
  gelu,
  silu,
  rope,     // rotary position embedding on q or k
  reshape,  // a view: split or merge dimensions (heads)
  transpose,
  split,  // one output of a split (q, k or v from a fused projection)
  concat,
  reduce,  // a reduction over some dimensions
  conv,
  loss,  // softmax cross-entropy over the last dimension, mean over tokens
  other,
};
std::string_view op_kind_name(OpKind k);

struct OpNode {
  std::string name = {};
  OpKind kind = OpKind::other;
  std::vector<int> inputs = {};                    // producing nodes, in operand order
  std::vector<int64_t> shape = {};                 // of the output
  std::vector<std::vector<int64_t>> weights = {};  // parameters it owns (weight, bias)
  int weights_of = -1;  // reads the weights of that node instead (a head tied to the embedding)
  // Layout operators (reshape, transpose, split, concat): for each dimension of the first input,
  // the output dimension holding its outermost part (-1: none), so a split along input
  // dimension d is a split along output dimension dim_of[d] (op_sharding.h).
  std::vector<int> dim_of = {};
  double flops = 0;          // forward
  int layer = -1;            // transformer block, -1 outside blocks
  std::string op_type = {};  // the source's own name for it (an ONNX op_type)
};

class OpGraph {
 public:
  // Returns the node's id (ids count from 0 in the order added).
  int add(OpNode node);
  int size() const { return int(nodes_.size()); }
  const OpNode& node(int id) const { return nodes_[size_t(id)]; }
  const std::vector<OpNode>& nodes() const { return nodes_; }

  // Checks every input names a node and the graph has no cycle; returns the nodes in a
  // topological order (inputs before the nodes reading them; among ready nodes, lower ids
  // first). Throws CorruptDataError naming the node and the bad input, or a node on a cycle.
  std::vector<int> validate() const;

  // The critical nodes, in topological order: those every path of the computation goes through
  // (no edge jumps over them in validate()'s order; data entering the graph, OpKind::input, is
  // not part of the computation and ignored). They cut the graph into segments that meet only
  // in them -- a transformer's residual adds -- which the graph planner shards one at a time and
  // joins by dynamic programming over the critical nodes' strategies (TePDist).
  std::vector<int> critical_nodes() const;
  // The computation cut at its critical nodes: each segment the computing nodes after one
  // critical node through the next, in topological order (inputs left out); a last segment may
  // end on a node that is not critical (the graph's end).
  std::vector<std::vector<int>> segments() const;

  // The weights node `id` computes with: its own, or those of the node it reads them from.
  const std::vector<std::vector<int64_t>>& weights_used_by(int id) const {
    const OpNode& n = node(id);
    return n.weights_of >= 0 ? node(n.weights_of).weights : n.weights;
  }

  // Per node, the nodes reading its output and at which of their inputs, in id order.
  struct Read {
    int node;
    size_t input;
  };
  std::vector<std::vector<Read>> readers() const;

  // Sums over the nodes (forward FLOPs; parameters as elements).
  double total_flops() const;
  int64_t total_parameters() const;

 private:
  std::vector<int> critical_in(const std::vector<int>& order) const;

  std::vector<OpNode> nodes_;
};

// Elements of a shape (1 for a scalar).
int64_t elements(const std::vector<int64_t>& shape);

}  // namespace tessel::planner
