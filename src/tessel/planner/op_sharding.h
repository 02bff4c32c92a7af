// How one operator of an OpGraph can run on the t devices of one mesh axis (issue 20's
// per-operator strategies), and what it costs to move a tensor from one layout to another.
//
// A tensor's layout on the axis (Shard):
//   R      replicated: every device holds all of it;
//   S(d)   split along dimension d into t equal, contiguous parts, device i holding part i;
//   P      partial: every device holds a tensor of the full shape, and the value is their sum
//          (what a matmul split along its contraction dimension leaves).
// A strategy fixes the layout of the operator's output, of each input it reads, and of its
// weights, and what one device computes and stores. The strategies per kind:
//   matmul with weights W[K, N] (+ bias[N]), x[..., K] -> y[..., N]:
//     replicated; column (W S(1), y S(last)); row (x S(last), W S(0), y P; one device adds the
//     bias); batch (x and y S(d) for a leading d, W replicated). A head tied to the embedding
//     reads the table [N, K] transposed, so its column and row strategies split the table's
//     dimension 0 and 1.
//   matmul of two activations a[..., M, K] b[..., K, N] (q k^T, p v): replicated; batch over
//     a leading dimension both share; contraction (a S(last), b S(K's dim), y P).
//   gather (embedding, table[V, C]): replicated; vocab (table S(0), y P: each device looks up
//     the ids in its rows, zeros elsewhere); hidden (table S(1), y S(last)); batch (ids S(d)).
//   element-wise: replicated, S(d) for any d every input has (inputs of lower rank are
//     broadcast from the right and follow their aligned dimension), and for add (and a mul by a
//     scale, one input) P in, P out.
//   norms, softmax, loss: replicated, or S(d) for d other than the last (the normalised one);
//     the loss also vocab-parallel (logits S(last), Megatron's cross-entropy: three all-reduces
//     of one float per token).
//   rope: S(d) for d other than the last (it mixes pairs within the head dimension).
//   reshape, transpose, split, concat: follow OpNode::dim_of (an input split along d is an
//     output split along dim_of[d]); replicated; partial passes through.
//   input: replicated, or S(d).
//   conv x[B, Cin, ...] W[Cout, Cin, ...] -> y[B, Cout, ...]: batch (W replicated), output
//     channels (W S(0), y S(1)), input channels (x S(1), W S(1), y P).
//   reduce (keeping its leading dimensions, as a global pool does): S(d) for a kept d.
//   other: replicated only.
// A split strategy needs its dimension divisible by t; strategies that would not are left out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessel/planner/op_graph.h"

namespace tessel::planner {

struct Shard {
  enum class Kind { replicated, split, partial };
  Kind kind = Kind::replicated;
  int dim = -1;  // split only
  static Shard R() { return {}; }
  static Shard S(int d) { return {Kind::split, d}; }
  static Shard P() { return {Kind::partial, -1}; }
  bool operator==(const Shard&) const = default;
};
std::string to_string(const Shard& s);

struct OpStrategy {
  std::string name;
  Shard out;
  std::vector<Shard> in;  // per input of the node
  // Per weight of the node (or of the node it reads them from): its layout.
  std::vector<Shard> weights;
  double flops = 0;            // per device
  double weight_elements = 0;  // per device
  // Bytes one device sends in collectives the strategy runs inside the operator (all-reduces of
  // the vocab-parallel loss's per-token maximum, sum and target logit).
  double comm_bytes = 0;
};

// Every strategy of node `id` on t >= 1 devices (replicated first). Throws InvalidArgumentError
// for t < 1 or an id outside the graph.
std::vector<OpStrategy> op_strategies(const OpGraph& graph, int id, int t);

// Moving a tensor of `bytes` bytes from layout `from` to `to` on t devices: the collective and
// the bytes each device sends (ring algorithms): none (same layout, R -> S(d): a local slice,
// R or S -> P: keep one copy, zeros elsewhere); all-gather S -> R, (t - 1) / t; reduce-scatter
// P -> S, (t - 1) / t; all-reduce P -> R, 2 (t - 1) / t; all-to-all S(d) -> S(e), (t - 1) / t^2.
struct Reshard {
  std::string collective;  // "" for none
  double bytes_per_device = 0;
  double message_bytes = 0;  // the tensor the group's collective works on (nccl-tests' size)
};
Reshard reshard(const Shard& from, const Shard& to, double bytes, int t);

}  // namespace tessel::planner
