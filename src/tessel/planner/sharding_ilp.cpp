#include "tessel/planner/sharding_ilp.h"

#include <fmt/format.h>

#include <set>

#include "tessel/core/check.h"
#include "tessel/planner/sharding_programme.h"

namespace tessel::planner {

const OpStrategy& ShardingSolution::of(const OpGraph& graph, const std::string& name) const {
  for (int i = 0; i < graph.size() && size_t(i) < chosen.size(); ++i)
    if (graph.node(i).name == name) return chosen[size_t(i)];
  TESSEL_THROW(InvalidArgumentError, "sharding solution: no node named '{}' with a strategy", name);
}

namespace {

void check_costs(int t, const ShardingCosts& c) {
  TESSEL_CHECK(
      t >= 1 && c.flops_per_s > 0 && c.bandwidth > 0 && c.latency_s >= 0 && c.bytes_per_element > 0,
      InvalidArgumentError,
      "solve_sharding: {} devices, {} FLOP/s, {} B/s, latency {} s; need t >= 1 and "
      "positive rates",
      t, c.flops_per_s, c.bandwidth, c.latency_s);
}

}  // namespace

// The layout of the gradient a strategy's backward leaves for its input k: an input every device
// read whole while each computed only its part of the output gets a part of the gradient from
// each (their sum: partial); a partial input (each device's term of a sum) gets the whole
// gradient; a split input gets its part.
Shard input_gradient(const OpStrategy& s, size_t k, const OpNode& node) {
  const Shard& in = s.in[k];
  if (in.kind == Shard::Kind::partial) return Shard::R();
  if (in.kind == Shard::Kind::replicated && s.flops < node.flops) return Shard::P();
  return in;
}

// The layout the producer's backward needs its output's gradient in: each term of a partial
// output has the whole gradient.
Shard output_gradient(const OpStrategy& s) {
  return s.out.kind == Shard::Kind::partial ? Shard::R() : s.out;
}

double collective(const ShardingCosts& c, double bytes, double message) {
  if (c.nccl.defined() && c.hosts > 1 && message > 0)
    return bytes / nccl_bus_bandwidth(message, c.ranks, c.hosts, c.bandwidth, c.nccl);
  if (!c.bus_curve.empty()) return bytes / bus_bandwidth(c.bus_curve, message);
  return c.latency_s + bytes / c.bandwidth;
}

double strategy_cost(const OpGraph& g, int v, const OpStrategy& s, int t, const ShardingCosts& c) {
  const double priced = g.node(v).weights_of < 0 && c.memory_price > 0
                            ? c.memory_price * s.weight_elements * c.state_bytes_per_weight
                            : 0;
  return 3 * s.flops / c.flops_per_s + 2 * inside_cost(s, c) +
         c.sync_share * weight_sync_cost(g, v, s, t, c) + priced;
}

EdgeCosts edge_costs(const OpGraph& g, int u, const OpStrategy& from, int v, size_t k,
                     const OpStrategy& to, int t, const ShardingCosts& c) {
  const double bytes = double(elements(g.node(u).shape)) * c.bytes_per_element;
  EdgeCosts e;
  const Reshard fwd = reshard(from.out, to.in[k], bytes, t);
  if (!fwd.collective.empty()) e.forward = collective(c, fwd.bytes_per_device, fwd.message_bytes);
  // Data entering the graph needs no gradient.
  if (g.node(u).kind != OpKind::input) {
    const Reshard bwd = reshard(input_gradient(to, k, g.node(v)), output_gradient(from), bytes, t);
    if (!bwd.collective.empty())
      e.backward = collective(c, bwd.bytes_per_device, bwd.message_bytes);
  }
  return e;
}

double edge_cost(const OpGraph& g, int u, const OpStrategy& from, int v, size_t k,
                 const OpStrategy& to, int t, const ShardingCosts& c) {
  const EdgeCosts e = edge_costs(g, u, from, v, k, to, t, c);
  return e.forward + e.backward;
}

double backward_gradient_cost(const OpGraph& g, int u, const std::vector<OpGraph::Read>& readers,
                              const std::vector<OpStrategy>& chosen, int t,
                              const ShardingCosts& c) {
  if (g.node(u).kind == OpKind::input) return 0;
  const double bytes = double(elements(g.node(u).shape)) * c.bytes_per_element;
  const Shard need = output_gradient(chosen[size_t(u)]);
  std::set<std::string> seen;
  double cost = 0;
  for (const auto& [v, k] : readers) {
    const Shard layout = input_gradient(chosen[size_t(v)], k, g.node(v));
    if (!seen.insert(to_string(layout)).second) continue;
    const Reshard r = reshard(layout, need, bytes, t);
    if (!r.collective.empty()) cost += collective(c, r.bytes_per_device, r.message_bytes);
  }
  return cost;
}

double inside_cost(const OpStrategy& s, const ShardingCosts& c) {
  // The strategy's own all-reduces (the loss's): messages of half what each device sends.
  return s.comm_bytes > 0 ? collective(c, s.comm_bytes, s.comm_bytes / 2) : 0;
}

double weight_sync_cost(const OpGraph& g, int v, const OpStrategy& s, int t,
                        const ShardingCosts& c) {
  double cost = 0;
  const auto& weights = g.weights_used_by(v);
  if (t > 1 && s.name.starts_with("batch"))
    for (size_t w = 0; w < weights.size(); ++w)
      if (s.weights[w].kind == Shard::Kind::replicated)
        cost +=
            collective(c, 2.0 * (t - 1) / t * double(elements(weights[w])) * c.bytes_per_element,
                       double(elements(weights[w])) * c.bytes_per_element);
  return cost;
}

ShardingSolution solve_sharding(const OpGraph& g, int t, const ShardingCosts& c,
                                const IlpOptions& options) {
  return solve_sharding(g, t, c, options, ShardingProblem{});
}

namespace {

// One mesh axis of t devices: op_sharding's strategies, priced as above.
class OneAxis : public StrategySpace {
 public:
  OneAxis(const OpGraph& g, int t, const ShardingCosts& c) : g_(g), t_(t), c_(c) {
    options_.resize(size_t(g.size()));
  }
  // Strategies are enumerated for the nodes the programme uses only.
  const std::vector<OpStrategy>& of(int v) const {
    auto& o = options_[size_t(v)];
    if (o.empty()) o = op_strategies(g_, v, t_);
    return o;
  }
  int count(int v) const override { return int(of(v).size()); }
  std::string name(int v, int s) const override { return at(v, s).name; }
  double node_cost(int v, int s) const override { return strategy_cost(g_, v, at(v, s), t_, c_); }
  double state_bytes(int v, int s) const override {
    return at(v, s).weight_elements * c_.state_bytes_per_weight;
  }
  EdgeCosts edge(int u, int a, int v, size_t k, int b) const override {
    return edge_costs(g_, u, at(u, a), v, k, at(v, b), t_, c_);
  }
  std::string gradient_key(int v, int b, size_t k) const override {
    return to_string(input_gradient(at(v, b), k, g_.node(v)));
  }
  double gradient_change(int u, int a, int v, int b, size_t k) const override {
    const double bytes = double(elements(g_.node(u).shape)) * c_.bytes_per_element;
    const Reshard r =
        reshard(input_gradient(at(v, b), k, g_.node(v)), output_gradient(at(u, a)), bytes, t_);
    return r.collective.empty() ? 0 : collective(c_, r.bytes_per_device, r.message_bytes);
  }
  bool same_weights(int owner, int a, int reader, int b) const override {
    return at(owner, a).weights.front() == at(reader, b).weights.front();
  }
  double inside(int v, int s) const override { return inside_cost(at(v, s), c_); }
  double step_sync(int v, int s) const override {
    return weight_sync_cost(g_, v, at(v, s), t_, c_);
  }

 private:
  const OpStrategy& at(int v, int s) const { return of(v)[size_t(s)]; }
  const OpGraph& g_;
  const int t_;
  const ShardingCosts c_;
  mutable std::vector<std::vector<OpStrategy>> options_;
};

}  // namespace

std::unique_ptr<StrategySpace> one_axis_space(const OpGraph& g, int t, const ShardingCosts& c) {
  check_costs(t, c);
  return std::make_unique<OneAxis>(g, t, c);
}

ShardingSolution solve_sharding(const OpGraph& g, int t, const ShardingCosts& c,
                                const IlpOptions& options, const ShardingProblem& p) {
  check_costs(t, c);
  const OneAxis space(g, t, c);
  const Programme r = solve_programme(g, space, c.memory_bytes, options, p);
  return solution_of<ShardingSolution>(r, space, g.size());
}

}  // namespace tessel::planner
