#include "tessel/planner/sharding_programme.h"

#include <set>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/core/error.h"

namespace tessel::planner {

namespace {
constexpr double kUnitsPerSecond = 1e6;
}  // namespace

Programme solve_programme(const OpGraph& g, const StrategySpace& space, double memory_bytes,
                          const IlpOptions& options, const ShardingProblem& p, bool tight) {
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
  // x[v]: (strategy index, variable) for the strategies v may take.
  std::vector<std::vector<std::pair<int, int>>> x(static_cast<size_t>(n));
  Ilp ilp;
  std::vector<Ilp::Term> memory;
  for (int v = 0; v < n; ++v) {
    if (!active(v)) continue;
    const OpNode& node = g.node(v);
    const int count = space.count(v);
    std::vector<int> allowed;
    if (!p.allowed.empty()) allowed = p.allowed[size_t(v)];
    if (allowed.empty())
      for (int i = 0; i < count; ++i) allowed.push_back(i);
    const bool costed = p.uncosted.empty() || !p.uncosted[size_t(v)];
    std::vector<Ilp::Term> one;
    for (int i : allowed) {
      TESSEL_CHECK(i >= 0 && i < count, InvalidArgumentError,
                   "solve_sharding: node '{}' allows strategy {} of {}", node.name, i, count);
      const int var = ilp.add_binary(fmt::format("x.{}.{}", node.name, space.name(v, i)),
                                     costed ? kUnitsPerSecond * space.node_cost(v, i) : 0);
      x[size_t(v)].push_back({i, var});
      one.push_back({var, 1.0});
      // A tied head's weights are the embedding's: counted there.
      if (costed && node.weights_of < 0 && space.state_bytes(v, i) > 0)
        memory.push_back({var, space.state_bytes(v, i)});
    }
    ilp.add_eq(one, 1, fmt::format("one.{}", node.name));
  }
  if (std::isfinite(memory_bytes) && !memory.empty()) ilp.add_le(memory, memory_bytes, "memory");
  // Readers of each node's output within the programme.
  std::vector<std::vector<OpGraph::Read>> readers = g.readers();
  for (int u = 0; u < n; ++u)
    std::erase_if(readers[size_t(u)],
                  [&](const OpGraph::Read& r) { return !active(u) || !active(r.node); });
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
      if (tight) {
        // One pair variable per pair of strategies, its marginals the two nodes' choices.
        std::vector<std::vector<Ilp::Term>> row_of_a(x[size_t(u)].size()),
            row_of_b(x[size_t(v)].size());
        for (size_t i = 0; i < x[size_t(u)].size(); ++i)
          for (size_t j = 0; j < x[size_t(v)].size(); ++j) {
            const int a = x[size_t(u)][i].first, b = x[size_t(v)][j].first;
            const EdgeCosts e = space.edge(u, a, v, k, b);
            const double cost = fans_out(u) ? e.forward : e.forward + e.backward;
            const int y =
                ilp.add_continuous(fmt::format("e.{}.{}.{}.{}", g.node(u).name, space.name(u, a),
                                               node.name, space.name(v, b)),
                                   0, 1, kUnitsPerSecond * cost);
            row_of_a[i].push_back({y, 1.0});
            row_of_b[j].push_back({y, 1.0});
          }
        for (size_t i = 0; i < row_of_a.size(); ++i) {
          row_of_a[i].push_back({x[size_t(u)][i].second, -1.0});
          ilp.add_eq(row_of_a[i], 0);
        }
        for (size_t j = 0; j < row_of_b.size(); ++j) {
          row_of_b[j].push_back({x[size_t(v)][j].second, -1.0});
          ilp.add_eq(row_of_b[j], 0);
        }
        continue;
      }
      for (const auto& [a, xa] : x[size_t(u)])
        for (const auto& [b, xb] : x[size_t(v)]) {
          const EdgeCosts e = space.edge(u, a, v, k, b);
          const double cost = fans_out(u) ? e.forward : e.forward + e.backward;
          if (cost == 0) continue;
          const int y =
              ilp.add_continuous(fmt::format("y.{}.{}.{}.{}", g.node(u).name, space.name(u, a),
                                             node.name, space.name(v, b)),
                                 0, 1, kUnitsPerSecond * cost);
          const std::vector<Ilp::Term> link = {{y, 1.0}, {xa, -1.0}, {xb, -1.0}};
          ilp.add_ge(link, -1);
        }
    }
  }
  // A producer with several readers sums the gradients they leave: those of one layout locally,
  // then each distinct layout changed once to what its backward needs (backward_gradient_cost).
  // has[G] >= x of every reader strategy leaving layout G (minimisation keeps it at their max);
  // y >= x[u][a] + has[G] - 1 pays G's change for u's strategy a.
  struct Has {
    int var;
    int v, b;  // a reader strategy leaving G
    size_t k;
  };
  for (int u = 0; u < n; ++u) {
    if (!active(u) || !fans_out(u)) continue;
    std::map<std::string, Has> has;
    for (const auto& [v, k] : readers[size_t(u)])
      for (const auto& [b, xb] : x[size_t(v)]) {
        const std::string key = space.gradient_key(v, b, k);
        auto it = has.find(key);
        if (it == has.end())
          it = has.emplace(key, Has{ilp.add_continuous(
                                        fmt::format("has.{}.{}", g.node(u).name, key), 0, 1, 0),
                                    v, b, k})
                   .first;
        const std::vector<Ilp::Term> at_least = {{it->second.var, 1.0}, {xb, -1.0}};
        ilp.add_ge(at_least, 0);
      }
    for (const auto& [a, xa] : x[size_t(u)]) {
      for (const auto& [key, h] : has) {
        const double cost = space.gradient_change(u, a, h.v, h.b, h.k);
        if (cost == 0) continue;
        const int y =
            ilp.add_continuous(fmt::format("g.{}.{}.{}", g.node(u).name, space.name(u, a), key), 0,
                               1, kUnitsPerSecond * cost);
        const std::vector<Ilp::Term> link = {{y, 1.0}, {xa, -1.0}, {h.var, -1.0}};
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
        if (!space.same_weights(u, a, v, b)) {
          const std::vector<Ilp::Term> both = {{xa, 1.0}, {xb, 1.0}};
          ilp.add_le(both, 1);
        }
  }
  // The tight formulation's LP is near-integral: CBC's presolve, cuts and heuristics only cost
  // time there (a 2-axis mesh's segment programmes: 8x faster without them, the same optima).
  IlpOptions o = options;
  o.plain = o.plain || tight;
  const IlpResult r = ilp.solve(o);
  Programme out;
  out.status = r.status;
  out.variables = ilp.variables();
  out.constraints = ilp.constraints();
  out.solve_s = r.seconds;
  out.bound_s = r.bound / kUnitsPerSecond;
  if (!r.has_solution()) return out;
  out.time_s = r.objective / kUnitsPerSecond;
  out.index.assign(size_t(n), -1);
  for (int v = 0; v < n; ++v) {
    if (!active(v)) continue;
    for (const auto& [i, var] : x[size_t(v)])
      if (r.integer(var) == 1) out.index[size_t(v)] = i;
    TESSEL_CHECK(out.index[size_t(v)] >= 0, Error, "internal: no strategy chosen for node '{}'",
                 g.node(v).name);
  }
  return out;
}

std::vector<NodeComm> node_comm(const OpGraph& g, const StrategySpace& space,
                                const std::vector<int>& index) {
  TESSEL_CHECK(index.size() == size_t(g.size()), InvalidArgumentError,
               "node_comm: {} strategies for a graph of {} nodes", index.size(), g.size());
  for (int v = 0; v < g.size(); ++v)
    TESSEL_CHECK(index[size_t(v)] < space.count(v) &&
                     (index[size_t(v)] >= 0 || g.node(v).kind == OpKind::input),
                 InvalidArgumentError, "node_comm: node '{}' has strategy {} of {}", g.node(v).name,
                 index[size_t(v)], space.count(v));
  const auto readers = g.readers();
  std::vector<NodeComm> out(size_t(g.size()));
  for (int v = 0; v < g.size(); ++v) {
    const int b = index[size_t(v)];
    // Data entering the graph without a strategy of its own is loaded as its readers read it
    // and needs no gradient.
    if (b < 0) continue;
    NodeComm& c = out[size_t(v)];
    c.inside = space.inside(v, b);
    c.step_sync = space.step_sync(v, b);
    const auto& inputs = g.node(v).inputs;
    for (size_t k = 0; k < inputs.size(); ++k)
      if (const int a = index[size_t(inputs[k])]; a >= 0)
        c.forward_edges += space.edge(inputs[k], a, v, k, b).forward;
    if (g.node(v).kind == OpKind::input) continue;
    std::set<std::string> seen;
    for (const auto& [r, k] : readers[size_t(v)])
      if (seen.insert(space.gradient_key(r, index[size_t(r)], k)).second)
        c.backward_edges += space.gradient_change(v, b, r, index[size_t(r)], k);
  }
  return out;
}

}  // namespace tessel::planner
