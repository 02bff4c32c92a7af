#include "tessel/planner/mesh_sharding.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "tessel/core/check.h"
#include "tessel/core/error.h"
#include "tessel/planner/sharding_programme.h"

namespace tessel::planner {

namespace {

class MeshSpace : public StrategySpace {
 public:
  MeshSpace(const OpGraph& g, const MeshCosts& c) : g_(g), c_(c) {
    options_.resize(size_t(g.size()));
  }
  const std::vector<MeshStrategy>& of(int v) const {
    auto& o = options_[size_t(v)];
    if (o.empty()) o = mesh_strategies(g_, v, c_.mesh);
    return o;
  }
  int count(int v) const override { return int(of(v).size()); }
  std::string name(int v, int s) const override { return at(v, s).name; }
  double node_cost(int v, int s) const override {
    const ShardingCosts& base = c_.axes[0];
    double cost = 3 * at(v, s).flops / base.flops_per_s + 2 * inside(v, s) +
                  base.sync_share * step_sync(v, s);
    if (g_.node(v).weights_of < 0 && base.memory_price > 0)
      cost += base.memory_price * state_bytes(v, s);
    return cost;
  }
  // Per axis, the strategy's collectives on what each device holds (the tokens the other axis's
  // split leaves).
  double inside(int v, int s) const override {
    const MeshStrategy& m = at(v, s);
    double cost = 0;
    for (size_t a = 0; a < axes(); ++a) {
      const OpStrategy& s_a = m.axis[a];
      const double other = split_by_other(a, s_a.in.empty() ? m.out() : m.in(0));
      if (s_a.comm_bytes > 0)
        cost += collective(c_.axes[a], s_a.comm_bytes / other, s_a.comm_bytes / other / 2);
    }
    return cost;
  }
  // Per axis, a batch split keeping a weight whole on that axis all-reduces its gradient among
  // the axis's groups (its bytes after the other axis's split).
  double step_sync(int v, int s) const override {
    const MeshStrategy& m = at(v, s);
    const auto& weights = g_.weights_used_by(v);
    double cost = 0;
    for (size_t a = 0; a < axes(); ++a) {
      const OpStrategy& s_a = m.axis[a];
      const int d = c_.mesh.sizes[a];
      if (d > 1 && s_a.name.starts_with("batch"))
        for (size_t w = 0; w < weights.size(); ++w)
          if (s_a.weights[w].kind == Shard::Kind::replicated)
            cost += collective(c_.axes[a],
                               2.0 * (d - 1) / d * double(elements(weights[w])) /
                                   split_by_other(a, m.weight(w)) * c_.axes[0].bytes_per_element,
                               double(elements(weights[w])) / split_by_other(a, m.weight(w)) *
                                   c_.axes[0].bytes_per_element);
    }
    return cost;
  }
  double state_bytes(int v, int s) const override {
    return at(v, s).weight_elements * c_.axes[0].state_bytes_per_weight;
  }
  EdgeCosts edge(int u, int a, int v, size_t k, int b) const override {
    const MeshStrategy& from = at(u, a);
    const MeshStrategy& to = at(v, b);
    EdgeCosts e;
    e.forward = moves(from.out(), to.in(k), u);
    if (g_.node(u).kind != OpKind::input) e.backward = moves(gradient(to, k, v), need(from), u);
    return e;
  }
  std::string gradient_key(int v, int b, size_t k) const override {
    return to_string(gradient(at(v, b), k, v));
  }
  double gradient_change(int u, int a, int v, int b, size_t k) const override {
    return moves(gradient(at(v, b), k, v), need(at(u, a)), u);
  }
  bool same_weights(int owner, int a, int reader, int b) const override {
    return at(owner, a).weight(0) == at(reader, b).weight(0);
  }

 private:
  const MeshStrategy& at(int v, int s) const { return of(v)[size_t(s)]; }
  size_t axes() const { return c_.mesh.sizes.size(); }
  // The parts the axes other than `a` split a tensor of this layout into.
  double split_by_other(size_t a, const MeshLayout& layout) const {
    double parts = 1;
    for (size_t x = 0; x < axes(); ++x)
      if (x != a && layout[x].kind == Shard::Kind::split) parts *= c_.mesh.sizes[x];
    return parts;
  }
  MeshLayout gradient(const MeshStrategy& m, size_t k, int v) const {
    MeshLayout l;
    for (const auto& s : m.axis) l.push_back(input_gradient(s, k, g_.node(v)));
    return l;
  }
  MeshLayout need(const MeshStrategy& m) const {
    MeshLayout l;
    for (const auto& s : m.axis) l.push_back(output_gradient(s));
    return l;
  }
  // Moving node u's output between layouts, axis by axis, each on its own link, in the cheaper
  // order.
  double moves(const MeshLayout& from, const MeshLayout& to, int u) const {
    const double bytes = double(elements(g_.node(u).shape)) * c_.axes[0].bytes_per_element;
    double best = std::numeric_limits<double>::infinity();
    for (int first = 0; first < int(axes()); ++first) {
      const auto per_axis = mesh_reshard(from, to, bytes, c_.mesh, first);
      double t = 0;
      for (size_t x = 0; x < per_axis.size(); ++x)
        if (!per_axis[x].collective.empty())
          t += collective(c_.axes[x], per_axis[x].bytes_per_device, per_axis[x].message_bytes);
      best = std::min(best, t);
    }
    return best;
  }

  const OpGraph& g_;
  const MeshCosts c_;
  mutable std::vector<std::vector<MeshStrategy>> options_;
};

}  // namespace

const MeshStrategy& MeshSolution::of(const OpGraph& graph, const std::string& name) const {
  for (int i = 0; i < graph.size() && size_t(i) < chosen.size(); ++i)
    if (graph.node(i).name == name) return chosen[size_t(i)];
  TESSEL_THROW(InvalidArgumentError, "mesh sharding: no node named '{}' with a strategy", name);
}

namespace {

void check_costs(const MeshCosts& c) {
  TESSEL_CHECK(c.axes.size() == c.mesh.sizes.size(), InvalidArgumentError,
               "mesh sharding: {} axis costs for a mesh of {} axes", c.axes.size(),
               c.mesh.sizes.size());
  for (const auto& a : c.axes)
    TESSEL_CHECK(
        a.flops_per_s > 0 && a.bandwidth > 0 && a.latency_s >= 0 && a.bytes_per_element > 0,
        InvalidArgumentError,
        "mesh sharding: an axis with {} FLOP/s, {} B/s, latency {} s; need positive rates",
        a.flops_per_s, a.bandwidth, a.latency_s);
}

}  // namespace

MeshSolution solve_mesh_sharding(const OpGraph& g, const MeshCosts& c, const IlpOptions& options,
                                 const ShardingProblem& problem) {
  check_costs(c);
  const MeshSpace space(g, c);
  const Programme r = solve_programme(g, space, c.axes[0].memory_bytes, options, problem);
  return solution_of<MeshSolution>(r, space, g.size());
}

std::unique_ptr<StrategySpace> mesh_space(const OpGraph& g, const MeshCosts& c) {
  check_costs(c);
  return std::make_unique<MeshSpace>(g, c);
}

MeshSolution shard_mesh_graph(const OpGraph& g, const MeshCosts& c, const IlpOptions& options,
                              GraphShardingStats* stats, int whole_up_to) {
  check_costs(c);
  GraphShardingStats local;
  auto space_at = [&](double price) {
    MeshCosts priced = c;
    priced.axes[0].memory_price = price;
    return std::make_unique<MeshSpace>(g, priced);
  };
  // What the costs depend on besides the graph: the mesh and each axis's link.
  std::string key = "mesh";
  for (size_t a = 0; a < c.axes.size(); ++a)
    key += fmt::format("|{}:{}/{}/{}", c.mesh.sizes[a], c.axes[a].bandwidth, c.axes[a].latency_s,
                       c.axes[a].flops_per_s);
  const Programme r = shard_by_segments(g, space_at, key, c.axes[0].memory_bytes, options,
                                        stats != nullptr ? *stats : local, whole_up_to);
  return solution_of<MeshSolution>(r, MeshSpace(g, c), g.size());
}

}  // namespace tessel::planner
