#include "tessel/planner/sharding_ilp.h"

#include <fmt/format.h>

#include "tessel/core/check.h"

namespace tessel::planner {

const OpStrategy& ShardingSolution::of(const OpGraph& graph, const std::string& name) const {
  for (int i = 0; i < graph.size() && size_t(i) < chosen.size(); ++i)
    if (graph.node(i).name == name) return chosen[size_t(i)];
  TESSEL_THROW(InvalidArgumentError, "sharding solution: no node named '{}' with a strategy", name);
}

namespace {

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

}  // namespace

ShardingSolution solve_sharding(const OpGraph& g, int t, const ShardingCosts& c,
                                const IlpOptions& options) {
  TESSEL_CHECK(
      t >= 1 && c.flops_per_s > 0 && c.bandwidth > 0 && c.latency_s >= 0 && c.bytes_per_element > 0,
      InvalidArgumentError,
      "solve_sharding: {} devices, {} FLOP/s, {} B/s, latency {} s; need t >= 1 and "
      "positive rates",
      t, c.flops_per_s, c.bandwidth, c.latency_s);
  g.validate();
  const int n = g.size();
  auto collective = [&](double bytes) { return c.latency_s + bytes / c.bandwidth; };
  std::vector<std::vector<OpStrategy>> options_of(static_cast<size_t>(n));
  std::vector<std::vector<int>> x(static_cast<size_t>(n));
  Ilp ilp;
  std::vector<Ilp::Term> memory;
  for (int v = 0; v < n; ++v) {
    const OpNode& node = g.node(v);
    options_of[size_t(v)] = op_strategies(g, v, t);
    const auto& weights = node.weights_of >= 0 ? g.node(node.weights_of).weights : node.weights;
    std::vector<Ilp::Term> one;
    for (const OpStrategy& s : options_of[size_t(v)]) {
      double cost = 3 * s.flops / c.flops_per_s;
      if (s.comm_bytes > 0) cost += 2 * collective(s.comm_bytes);
      if (t > 1 && s.name.starts_with("batch"))
        for (size_t w = 0; w < weights.size(); ++w)
          if (s.weights[w].kind == Shard::Kind::replicated)
            cost +=
                collective(2.0 * (t - 1) / t * double(elements(weights[w])) * c.bytes_per_element);
      const int var = ilp.add_binary(fmt::format("x.{}.{}", node.name, s.name), cost);
      x[size_t(v)].push_back(var);
      one.push_back({var, 1.0});
      // A tied head's weights are the embedding's: counted there.
      if (node.weights_of < 0 && s.weight_elements > 0)
        memory.push_back({var, s.weight_elements * c.state_bytes_per_weight});
    }
    ilp.add_eq(one, 1, fmt::format("one.{}", node.name));
  }
  if (std::isfinite(c.memory_bytes) && !memory.empty())
    ilp.add_le(memory, c.memory_bytes, "memory");
  // Edges: forward, the producer's output layout against what the consumer reads there;
  // backward, the gradient the consumer makes of that input against what the producer's own
  // backward needs (data entering the graph needs none).
  for (int v = 0; v < n; ++v) {
    const OpNode& node = g.node(v);
    for (size_t k = 0; k < node.inputs.size(); ++k) {
      const int u = node.inputs[k];
      const bool needs_gradient = g.node(u).kind != OpKind::input;
      const double bytes = double(elements(g.node(u).shape)) * c.bytes_per_element;
      const auto& from = options_of[size_t(u)];
      const auto& to = options_of[size_t(v)];
      for (size_t a = 0; a < from.size(); ++a)
        for (size_t b = 0; b < to.size(); ++b) {
          double cost = 0;
          const Reshard fwd = reshard(from[a].out, to[b].in[k], bytes, t);
          if (!fwd.collective.empty()) cost += collective(fwd.bytes_per_device);
          if (needs_gradient) {
            const Reshard bwd =
                reshard(input_gradient(to[b], k, node), output_gradient(from[a]), bytes, t);
            if (!bwd.collective.empty()) cost += collective(bwd.bytes_per_device);
          }
          if (cost == 0) continue;
          const int y = ilp.add_continuous(
              fmt::format("y.{}.{}.{}.{}", g.node(u).name, from[a].name, node.name, to[b].name), 0,
              1, cost);
          const std::vector<Ilp::Term> link = {
              {y, 1.0}, {x[size_t(u)][a], -1.0}, {x[size_t(v)][b], -1.0}};
          ilp.add_ge(link, -1);
        }
    }
  }
  // A node reading another's weights (a head tied to the embedding) holds them as that node
  // does: one table, one layout.
  for (int v = 0; v < n; ++v) {
    const int u = g.node(v).weights_of;
    if (u < 0) continue;
    const auto& mine = options_of[size_t(v)];
    const auto& owner = options_of[size_t(u)];
    for (size_t a = 0; a < owner.size(); ++a)
      for (size_t b = 0; b < mine.size(); ++b)
        if (owner[a].weights.front() != mine[b].weights.front()) {
          const std::vector<Ilp::Term> both = {{x[size_t(u)][a], 1.0}, {x[size_t(v)][b], 1.0}};
          ilp.add_le(both, 1);
        }
  }
  const IlpResult r = ilp.solve(options);
  ShardingSolution out;
  out.status = r.status;
  out.variables = ilp.variables();
  out.constraints = ilp.constraints();
  out.solve_s = r.seconds;
  out.bound_s = r.bound;
  if (!r.has_solution()) return out;
  out.time_s = r.objective;
  for (int v = 0; v < n; ++v) {
    int picked = -1;
    for (size_t s = 0; s < x[size_t(v)].size(); ++s)
      if (r.integer(x[size_t(v)][s]) == 1) picked = int(s);
    TESSEL_CHECK(picked >= 0, Error, "internal: no strategy chosen for node '{}'", g.node(v).name);
    out.chosen.push_back(options_of[size_t(v)][size_t(picked)]);
  }
  return out;
}

}  // namespace tessel::planner
