// Operator strategies on a device mesh of up to two axes (issue 20: sharding "over a device mesh
// of up to 2 dimensions"), built from the one-axis strategies of op_sharding.h: an operator takes
// one strategy per axis, e.g. a batch split on the outer axis (data parallelism across hosts)
// and a column split on the inner one (tensor parallelism within a host).
//
// Splits compose outer axis first: a tensor split along the same dimension on both axes is cut
// into sizes[0] parts, each cut into sizes[1] (device (i, j) holds part j of part i), so that
// dimension must divide by sizes[0] x sizes[1]; partial on an axis means that axis's devices hold
// terms of a sum (the other axis's layout applies to each term). A device computes the node's
// FLOPs divided by what each axis's strategy divides them by, and holds each weight divided by
// each axis that splits it.
//
// Moving a tensor between mesh layouts goes axis by axis: the groups along axis a (devices that
// differ only in their axis-a coordinate) run the one-axis collective of reshard() on what each
// holds -- the tensor's bytes divided by the parts the other axis splits it into at that moment:
// the source's layout when axis a moves first, the target's when it moves second. A planner
// takes the cheaper order.
#pragma once

#include <string>
#include <vector>

#include "tessel/planner/op_graph.h"
#include "tessel/planner/op_sharding.h"

namespace tessel::planner {

struct Mesh {
  std::vector<int> sizes;  // one or two axes, outer first, each >= 1
  int devices() const;
};

// A tensor's layout on the mesh: one Shard per axis.
using MeshLayout = std::vector<Shard>;
std::string to_string(const MeshLayout& layout);

struct MeshStrategy {
  std::string name;              // the axes' strategy names joined by " x "
  std::vector<OpStrategy> axis;  // per axis: op_strategies on that axis's size
  double flops = 0;              // per device
  double weight_elements = 0;    // per device
  MeshLayout out() const;
  MeshLayout in(size_t input) const;
  MeshLayout weight(size_t w) const;
};

// Every combination of node `id`'s strategies on each axis whose splits compose (a dimension split
// on both axes divides by their product). Throws InvalidArgumentError for a mesh of no axis, more
// than two, or an axis below 1, and what op_strategies throws.
std::vector<MeshStrategy> mesh_strategies(const OpGraph& graph, int id, const Mesh& mesh);

// Moving a tensor of `bytes` from layout `from` to `to`, axis `first` first: per axis, the
// collective its groups run and the bytes each device sends (reshard() on the bytes each holds).
std::vector<Reshard> mesh_reshard(const MeshLayout& from, const MeshLayout& to, double bytes,
                                  const Mesh& mesh, int first = 0);

}  // namespace tessel::planner
