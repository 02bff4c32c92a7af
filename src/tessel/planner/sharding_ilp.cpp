#include "tessel/planner/sharding_ilp.h"

#include <fmt/format.h>

#include <map>
#include <set>

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

void check_costs(int t, const ShardingCosts& c) {
  TESSEL_CHECK(
      t >= 1 && c.flops_per_s > 0 && c.bandwidth > 0 && c.latency_s >= 0 && c.bytes_per_element > 0,
      InvalidArgumentError,
      "solve_sharding: {} devices, {} FLOP/s, {} B/s, latency {} s; need t >= 1 and "
      "positive rates",
      t, c.flops_per_s, c.bandwidth, c.latency_s);
}

// The programme's objective is in microseconds: in seconds, a step of milliseconds made of
// microsecond terms sits near CBC's absolute tolerances, and it proved worse solutions optimal.
constexpr double kUnitsPerSecond = 1e6;

double collective(const ShardingCosts& c, double bytes) {
  return c.latency_s + bytes / c.bandwidth;
}

}  // namespace

double strategy_cost(const OpGraph& g, int v, const OpStrategy& s, int t, const ShardingCosts& c) {
  const double priced = g.node(v).weights_of < 0 && c.memory_price > 0
                            ? c.memory_price * s.weight_elements * c.state_bytes_per_weight
                            : 0;
  return 3 * s.flops / c.flops_per_s + 2 * inside_cost(s, c) + weight_sync_cost(g, v, s, t, c) +
         priced;
}

EdgeCosts edge_costs(const OpGraph& g, int u, const OpStrategy& from, int v, size_t k,
                     const OpStrategy& to, int t, const ShardingCosts& c) {
  const double bytes = double(elements(g.node(u).shape)) * c.bytes_per_element;
  EdgeCosts e;
  const Reshard fwd = reshard(from.out, to.in[k], bytes, t);
  if (!fwd.collective.empty()) e.forward = collective(c, fwd.bytes_per_device);
  // Data entering the graph needs no gradient.
  if (g.node(u).kind != OpKind::input) {
    const Reshard bwd = reshard(input_gradient(to, k, g.node(v)), output_gradient(from), bytes, t);
    if (!bwd.collective.empty()) e.backward = collective(c, bwd.bytes_per_device);
  }
  return e;
}

double edge_cost(const OpGraph& g, int u, const OpStrategy& from, int v, size_t k,
                 const OpStrategy& to, int t, const ShardingCosts& c) {
  const EdgeCosts e = edge_costs(g, u, from, v, k, to, t, c);
  return e.forward + e.backward;
}

double backward_gradient_cost(const OpGraph& g, int u, const std::vector<OpStrategy>& chosen, int t,
                              const ShardingCosts& c) {
  if (g.node(u).kind == OpKind::input) return 0;
  const double bytes = double(elements(g.node(u).shape)) * c.bytes_per_element;
  const Shard need = output_gradient(chosen[size_t(u)]);
  std::set<std::string> seen;
  double cost = 0;
  for (int v = 0; v < g.size(); ++v)
    for (size_t k = 0; k < g.node(v).inputs.size(); ++k) {
      if (g.node(v).inputs[k] != u) continue;
      const Shard layout = input_gradient(chosen[size_t(v)], k, g.node(v));
      if (!seen.insert(to_string(layout)).second) continue;
      const Reshard r = reshard(layout, need, bytes, t);
      if (!r.collective.empty()) cost += collective(c, r.bytes_per_device);
    }
  return cost;
}

double inside_cost(const OpStrategy& s, const ShardingCosts& c) {
  return s.comm_bytes > 0 ? collective(c, s.comm_bytes) : 0;
}

double weight_sync_cost(const OpGraph& g, int v, const OpStrategy& s, int t,
                        const ShardingCosts& c) {
  double cost = 0;
  const auto& weights = g.weights_used_by(v);
  if (t > 1 && s.name.starts_with("batch"))
    for (size_t w = 0; w < weights.size(); ++w)
      if (s.weights[w].kind == Shard::Kind::replicated)
        cost +=
            collective(c, 2.0 * (t - 1) / t * double(elements(weights[w])) * c.bytes_per_element);
  return cost;
}

ShardingSolution solve_sharding(const OpGraph& g, int t, const ShardingCosts& c,
                                const IlpOptions& options) {
  return solve_sharding(g, t, c, options, ShardingProblem{});
}

ShardingSolution solve_sharding(const OpGraph& g, int t, const ShardingCosts& c,
                                const IlpOptions& options, const ShardingProblem& p) {
  check_costs(t, c);
  g.validate();
  const int n = g.size();
  auto sized = [&](size_t size, const char* what) {
    TESSEL_CHECK(size == 0 || size == size_t(n), InvalidArgumentError,
                 "solve_sharding: {} has {} entries for {} nodes", what, size, n);
  };
  sized(p.active.size(), "active");
  sized(p.allowed.size(), "allowed");
  sized(p.uncosted.size(), "uncosted");
  auto active = [&](int v) { return p.active.empty() || p.active[size_t(v)]; };
  std::vector<std::vector<OpStrategy>> options_of(static_cast<size_t>(n));
  // x[v]: (strategy index, variable) for the strategies v may take.
  std::vector<std::vector<std::pair<int, int>>> x(static_cast<size_t>(n));
  Ilp ilp;
  std::vector<Ilp::Term> memory;
  for (int v = 0; v < n; ++v) {
    if (!active(v)) continue;
    const OpNode& node = g.node(v);
    options_of[size_t(v)] = op_strategies(g, v, t);
    std::vector<int> allowed;
    if (!p.allowed.empty()) allowed = p.allowed[size_t(v)];
    if (allowed.empty())
      for (int i = 0; i < int(options_of[size_t(v)].size()); ++i) allowed.push_back(i);
    const bool costed = p.uncosted.empty() || !p.uncosted[size_t(v)];
    std::vector<Ilp::Term> one;
    for (int i : allowed) {
      TESSEL_CHECK(i >= 0 && i < int(options_of[size_t(v)].size()), InvalidArgumentError,
                   "solve_sharding: node '{}' allows strategy {} of {}", node.name, i,
                   options_of[size_t(v)].size());
      const OpStrategy& s = options_of[size_t(v)][size_t(i)];
      const int var = ilp.add_binary(fmt::format("x.{}.{}", node.name, s.name),
                                     costed ? kUnitsPerSecond * strategy_cost(g, v, s, t, c) : 0);
      x[size_t(v)].push_back({i, var});
      one.push_back({var, 1.0});
      // A tied head's weights are the embedding's: counted there.
      if (costed && node.weights_of < 0 && s.weight_elements > 0)
        memory.push_back({var, s.weight_elements * c.state_bytes_per_weight});
    }
    ilp.add_eq(one, 1, fmt::format("one.{}", node.name));
  }
  if (std::isfinite(c.memory_bytes) && !memory.empty())
    ilp.add_le(memory, c.memory_bytes, "memory");
  // Readers of each node's output within the programme: (consumer, input index).
  std::vector<std::vector<std::pair<int, size_t>>> readers(static_cast<size_t>(n));
  for (int v = 0; v < n; ++v)
    if (active(v))
      for (size_t k = 0; k < g.node(v).inputs.size(); ++k)
        if (active(g.node(v).inputs[k])) readers[size_t(g.node(v).inputs[k])].push_back({v, k});
  auto fans_out = [&](int u) {
    return readers[size_t(u)].size() > 1 && g.node(u).kind != OpKind::input;
  };
  // Edges: forward, the producer's output layout against what the consumer reads there;
  // backward, the gradient the consumer makes of that input against what the producer's own
  // backward needs -- for a producer with several readers, below.
  for (int v = 0; v < n; ++v) {
    if (!active(v)) continue;
    const OpNode& node = g.node(v);
    for (size_t k = 0; k < node.inputs.size(); ++k) {
      const int u = node.inputs[k];
      if (!active(u)) continue;
      for (const auto& [a, xa] : x[size_t(u)])
        for (const auto& [b, xb] : x[size_t(v)]) {
          const OpStrategy& from = options_of[size_t(u)][size_t(a)];
          const OpStrategy& to = options_of[size_t(v)][size_t(b)];
          const EdgeCosts e = edge_costs(g, u, from, v, k, to, t, c);
          const double cost = fans_out(u) ? e.forward : e.forward + e.backward;
          if (cost == 0) continue;
          const int y = ilp.add_continuous(
              fmt::format("y.{}.{}.{}.{}", g.node(u).name, from.name, node.name, to.name), 0, 1,
              kUnitsPerSecond * cost);
          const std::vector<Ilp::Term> link = {{y, 1.0}, {xa, -1.0}, {xb, -1.0}};
          ilp.add_ge(link, -1);
        }
    }
  }
  // A producer with several readers sums the gradients they leave: those of one layout locally,
  // then each distinct layout changed once to what its backward needs (backward_gradient_cost).
  // has[G] >= x of every reader strategy leaving layout G (minimisation keeps it at their max);
  // y >= x[u][a] + has[G] - 1 pays G's change for u's strategy a.
  for (int u = 0; u < n; ++u) {
    if (!active(u) || !fans_out(u)) continue;
    const double bytes = double(elements(g.node(u).shape)) * c.bytes_per_element;
    std::map<std::string, std::pair<Shard, int>> has;  // by to_string(G)
    for (const auto& [v, k] : readers[size_t(u)])
      for (const auto& [b, xb] : x[size_t(v)]) {
        const Shard layout = input_gradient(options_of[size_t(v)][size_t(b)], k, g.node(v));
        auto it = has.find(to_string(layout));
        if (it == has.end())
          it = has.emplace(
                      to_string(layout),
                      std::pair{layout, ilp.add_continuous(fmt::format("has.{}.{}", g.node(u).name,
                                                                       to_string(layout)),
                                                           0, 1, 0)})
                   .first;
        const std::vector<Ilp::Term> at_least = {{it->second.second, 1.0}, {xb, -1.0}};
        ilp.add_ge(at_least, 0);
      }
    for (const auto& [a, xa] : x[size_t(u)]) {
      const Shard need = output_gradient(options_of[size_t(u)][size_t(a)]);
      for (const auto& [name, entry] : has) {
        const Reshard r = reshard(entry.first, need, bytes, t);
        if (r.collective.empty()) continue;
        const int y = ilp.add_continuous(
            fmt::format("g.{}.{}.{}", g.node(u).name, options_of[size_t(u)][size_t(a)].name, name),
            0, 1, kUnitsPerSecond * collective(c, r.bytes_per_device));
        const std::vector<Ilp::Term> link = {{y, 1.0}, {xa, -1.0}, {entry.second, -1.0}};
        ilp.add_ge(link, -1);
      }
    }
  }
  // A node reading another's weights (a head tied to the embedding) holds them as that node
  // does: one table, one layout.
  for (int v = 0; v < n; ++v) {
    const int u = g.node(v).weights_of;
    if (u < 0 || !active(v) || !active(u)) continue;
    for (const auto& [a, xa] : x[size_t(u)])
      for (const auto& [b, xb] : x[size_t(v)])
        if (options_of[size_t(u)][size_t(a)].weights.front() !=
            options_of[size_t(v)][size_t(b)].weights.front()) {
          const std::vector<Ilp::Term> both = {{xa, 1.0}, {xb, 1.0}};
          ilp.add_le(both, 1);
        }
  }
  const IlpResult r = ilp.solve(options);
  ShardingSolution out;
  out.status = r.status;
  out.variables = ilp.variables();
  out.constraints = ilp.constraints();
  out.solve_s = r.seconds;
  out.bound_s = r.bound / kUnitsPerSecond;
  if (!r.has_solution()) return out;
  out.time_s = r.objective / kUnitsPerSecond;
  out.chosen.resize(size_t(n));
  out.index.assign(size_t(n), -1);
  for (int v = 0; v < n; ++v) {
    if (!active(v)) continue;
    for (const auto& [i, var] : x[size_t(v)])
      if (r.integer(var) == 1) out.index[size_t(v)] = i;
    TESSEL_CHECK(out.index[size_t(v)] >= 0, Error, "internal: no strategy chosen for node '{}'",
                 g.node(v).name);
    out.chosen[size_t(v)] = options_of[size_t(v)][size_t(out.index[size_t(v)])];
  }
  return out;
}

}  // namespace tessel::planner
