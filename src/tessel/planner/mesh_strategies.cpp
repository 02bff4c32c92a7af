#include "tessel/planner/mesh_strategies.h"

#include <fmt/format.h>

#include "tessel/core/check.h"
#include "tessel/core/error.h"

namespace tessel::planner {

namespace {

void check_mesh(const Mesh& mesh) {
  TESSEL_CHECK(!mesh.sizes.empty() && mesh.sizes.size() <= 2, InvalidArgumentError,
               "a device mesh has one or two axes, not {}", mesh.sizes.size());
  for (int d : mesh.sizes)
    TESSEL_CHECK(d >= 1, InvalidArgumentError, "mesh axis of {} devices; each needs at least 1", d);
}

// Whether the axes' layouts of one tensor compose: a dimension split on both divides by both.
bool composes(const MeshLayout& layout, const std::vector<int64_t>& shape, const Mesh& mesh) {
  if (layout.size() < 2) return true;
  const Shard& a = layout[0];
  const Shard& b = layout[1];
  if (a.kind != Shard::Kind::split || b.kind != Shard::Kind::split || a.dim != b.dim) return true;
  return a.dim >= 0 && size_t(a.dim) < shape.size() &&
         shape[size_t(a.dim)] % (int64_t(mesh.sizes[0]) * mesh.sizes[1]) == 0;
}

}  // namespace

int Mesh::devices() const {
  int n = 1;
  for (int d : sizes) n *= d;
  return n;
}

std::string to_string(const MeshLayout& layout) {
  std::string s;
  for (const Shard& x : layout) s += (s.empty() ? "" : " x ") + to_string(x);
  return s;
}

MeshLayout MeshStrategy::out() const {
  MeshLayout l;
  for (const auto& a : axis) l.push_back(a.out);
  return l;
}

MeshLayout MeshStrategy::in(size_t input) const {
  MeshLayout l;
  for (const auto& a : axis) l.push_back(a.in.at(input));
  return l;
}

MeshLayout MeshStrategy::weight(size_t w) const {
  MeshLayout l;
  for (const auto& a : axis) l.push_back(a.weights.at(w));
  return l;
}

std::vector<MeshStrategy> mesh_strategies(const OpGraph& g, int id, const Mesh& mesh) {
  check_mesh(mesh);
  const OpNode& node = g.node(id);
  const auto& weights = g.weights_used_by(id);
  std::vector<std::vector<OpStrategy>> per_axis;
  for (int d : mesh.sizes) per_axis.push_back(op_strategies(g, id, d));
  // The factor an axis's strategy divides the node's FLOPs by.
  auto divides = [&](const OpStrategy& s) {
    return node.flops > 0 && s.flops > 0 ? node.flops / s.flops : 1.0;
  };
  auto make = [&](std::vector<OpStrategy> axes) {
    MeshStrategy m;
    double flop_factor = 1;
    for (const auto& a : axes) {
      m.name += (m.name.empty() ? "" : " x ") + a.name;
      flop_factor *= divides(a);
    }
    m.axis = std::move(axes);
    m.flops = node.flops / flop_factor;
    for (size_t w = 0; w < weights.size(); ++w) {
      double n = double(elements(weights[w]));
      for (size_t a = 0; a < m.axis.size(); ++a)
        if (m.axis[a].weights.at(w).kind == Shard::Kind::split) n /= mesh.sizes[a];
      m.weight_elements += n;
    }
    return m;
  };
  std::vector<MeshStrategy> out;
  if (mesh.sizes.size() == 1) {
    for (const auto& s : per_axis[0]) out.push_back(make({s}));
    return out;
  }
  for (const auto& a : per_axis[0])
    for (const auto& b : per_axis[1]) {
      MeshStrategy m = make({a, b});
      bool ok = composes(m.out(), node.shape, mesh);
      for (size_t k = 0; ok && k < node.inputs.size(); ++k)
        ok = composes(m.in(k), g.node(node.inputs[k]).shape, mesh);
      for (size_t w = 0; ok && w < weights.size(); ++w)
        ok = composes(m.weight(w), weights[w], mesh);
      if (ok) out.push_back(std::move(m));
    }
  return out;
}

std::vector<Reshard> mesh_reshard(const MeshLayout& from, const MeshLayout& to, double bytes,
                                  const Mesh& mesh, int first) {
  check_mesh(mesh);
  TESSEL_CHECK(from.size() == mesh.sizes.size() && to.size() == mesh.sizes.size(),
               InvalidArgumentError, "mesh_reshard: layouts of {} and {} axes on a mesh of {}",
               from.size(), to.size(), mesh.sizes.size());
  TESSEL_CHECK(first >= 0 && size_t(first) < mesh.sizes.size(), InvalidArgumentError,
               "mesh_reshard: axis {} of a mesh of {}", first, mesh.sizes.size());
  // The first axis moves while the others hold the source's layout; each later one while the
  // axes before it already hold the target's.
  std::vector<size_t> order = {size_t(first)};
  for (size_t a = 0; a < mesh.sizes.size(); ++a)
    if (a != size_t(first)) order.push_back(a);
  std::vector<Reshard> out(mesh.sizes.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const size_t a = order[i];
    double held = bytes;
    for (size_t j = 0; j < order.size(); ++j) {
      if (j == i) continue;
      const Shard& other = j < i ? to[order[j]] : from[order[j]];
      if (other.kind == Shard::Kind::split) held /= mesh.sizes[order[j]];
    }
    out[a] = reshard(from[a], to[a], held, mesh.sizes[a]);
  }
  return out;
}

}  // namespace tessel::planner
