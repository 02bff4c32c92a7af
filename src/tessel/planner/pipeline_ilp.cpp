#include "tessel/planner/pipeline_ilp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "tessel/core/check.h"

namespace tessel::planner {

namespace {

// The graph with one node per segment between critical nodes (inputs left out), and for each
// original node its segment (-1 for inputs). With whole_layers, segments that end inside a layer
// are merged with the next.
std::pair<OpGraph, std::vector<int>> coarsen(const OpGraph& g, bool whole_layers) {
  OpGraph coarse;
  std::vector<int> segment_of(size_t(g.size()), -1);
  const auto segments = g.segments();
  OpNode node;
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& nodes = segments[i];
    const int index = coarse.size();
    for (int v : nodes) {
      node.flops += g.node(v).flops;
      segment_of[size_t(v)] = index;
    }
    if (whole_layers && i + 1 < segments.size() &&
        g.node(segments[i + 1].front()).layer == g.node(nodes.back()).layer)
      continue;
    node.name = g.node(nodes.back()).name;
    node.kind = OpKind::other;
    node.shape = g.node(nodes.back()).shape;  // the only tensor that can cross after it
    if (index > 0) node.inputs = {index - 1};
    coarse.add(std::move(node));
    node = OpNode{};
  }
  return {std::move(coarse), std::move(segment_of)};
}

}  // namespace

PipelineCut cut_pipeline(const OpGraph& g, int S, const PipelineCutOptions& o) {
  if (o.coarsen && !g.critical_nodes().empty()) {
    auto [coarse, segment_of] = coarsen(g, o.whole_layers);
    PipelineCutOptions fine = o;
    fine.coarsen = false;
    PipelineCut cut = cut_pipeline(coarse, S, fine);
    if (cut.stage.empty()) return cut;
    std::vector<int> stage(size_t(g.size()), -1);
    for (int v = 0; v < g.size(); ++v)
      if (segment_of[size_t(v)] >= 0) stage[size_t(v)] = cut.stage[size_t(segment_of[size_t(v)])];
    // Data entering the graph is loaded by the first stage that reads it.
    for (int v = 0; v < g.size(); ++v)
      for (int u : g.node(v).inputs)
        if (g.node(u).kind == OpKind::input &&
            (stage[size_t(u)] < 0 || stage[size_t(v)] < stage[size_t(u)]))
          stage[size_t(u)] = stage[size_t(v)];
    for (int& s : stage) s = std::max(s, 0);
    cut.stage = std::move(stage);
    return cut;
  }
  const std::vector<int> order = g.validate();
  const int n = g.size();
  int with_flops = 0;
  double total = 0;
  for (const auto& node : g.nodes()) {
    total += node.flops;
    with_flops += node.flops > 0 ? 1 : 0;
  }
  TESSEL_CHECK(S >= 1 && S <= std::max(with_flops, 1) && o.balance_tolerance >= 0,
               InvalidArgumentError,
               "cut_pipeline: {} stages for {} operators with FLOPs, tolerance {}; need 1 <= "
               "stages <= operators and a tolerance >= 0",
               S, with_flops, o.balance_tolerance);
  // Each operator's window of stages, around where the FLOP prefix of the order puts it.
  std::vector<int> lo(size_t(n), 0), hi(size_t(n), S - 1);
  if (o.window >= 0 && total > 0) {
    double prefix = 0;
    for (int v : order) {
      const double mid = prefix + g.node(v).flops / 2;
      prefix += g.node(v).flops;
      const int at = std::min(S - 1, int(std::floor(mid / total * S)));
      lo[size_t(v)] = std::max(0, at - o.window);
      hi[size_t(v)] = std::min(S - 1, at + o.window);
    }
  }
  Ilp ilp;
  std::vector<std::vector<int>> z(static_cast<size_t>(n));  // z[v][s - lo[v]]
  auto on = [&](int v, int s) { return z[size_t(v)][size_t(s - lo[size_t(v)])]; };
  std::vector<std::vector<Ilp::Term>> load(static_cast<size_t>(S)), present(static_cast<size_t>(S));
  for (int v = 0; v < n; ++v) {
    std::vector<Ilp::Term> one;
    for (int s = lo[size_t(v)]; s <= hi[size_t(v)]; ++s) {
      const int var = ilp.add_binary(fmt::format("z.{}.{}", g.node(v).name, s));
      z[size_t(v)].push_back(var);
      one.push_back({var, 1.0});
      if (g.node(v).flops > 0) {
        // In shares of the total: FLOP counts near 1e11 as coefficients make CBC's presolve
        // declare feasible programmes infeasible.
        load[size_t(s)].push_back({var, g.node(v).flops / total});
        present[size_t(s)].push_back({var, 1.0});
      }
    }
    ilp.add_eq(one, 1);
  }
  const double cap = (1 + o.balance_tolerance) / S;
  for (int s = 0; s < S; ++s) {
    TESSEL_CHECK(!present[size_t(s)].empty(), InvalidArgumentError,
                 "cut_pipeline: no operator may go to stage {} with window {}; widen it", s,
                 o.window);
    if (total > 0) ilp.add_le(load[size_t(s)], cap, fmt::format("balance.{}", s));
    ilp.add_ge(present[size_t(s)], 1, fmt::format("nonempty.{}", s));
  }
  // Terms of sum_{s <= b} z[v][s] (le) or sum_{s > b} z[v][s] (gt) within v's window.
  auto part = [&](int v, int b, bool le, double coef, std::vector<Ilp::Term>& terms) {
    for (int s = lo[size_t(v)]; s <= hi[size_t(v)]; ++s)
      if ((s <= b) == le) terms.push_back({on(v, s), coef});
  };
  const auto readers = g.readers();
  for (int v = 0; v < n; ++v) {
    for (int u : g.node(v).inputs) {
      // stage(u) <= stage(v).
      std::vector<Ilp::Term> order_row;
      for (int s = lo[size_t(u)]; s <= hi[size_t(u)]; ++s)
        order_row.push_back({on(u, s), double(s)});
      for (int s = lo[size_t(v)]; s <= hi[size_t(v)]; ++s)
        order_row.push_back({on(v, s), -double(s)});
      ilp.add_le(order_row, 0);
    }
  }
  for (int u = 0; u < n; ++u) {
    // Data entering the graph (token ids, targets) is read where it is needed, by that stage.
    if (readers[size_t(u)].empty() || g.node(u).kind == OpKind::input) continue;
    const double bytes = double(elements(g.node(u).shape)) * o.bytes_per_element;
    int last = lo[size_t(u)];
    for (const auto& r : readers[size_t(u)]) last = std::max(last, hi[size_t(r.node)]);
    for (int b = lo[size_t(u)]; b < last; ++b) {
      const int w = ilp.add_binary(fmt::format("w.{}.{}", g.node(u).name, b), bytes);
      for (const auto& r : readers[size_t(u)]) {
        const int v = r.node;
        if (hi[size_t(v)] <= b) continue;  // v never beyond b
        std::vector<Ilp::Term> row = {{w, 1.0}};
        part(u, b, true, -1.0, row);
        part(v, b, false, -1.0, row);
        ilp.add_ge(row, -1);
      }
    }
  }
  // Start from the FLOP-prefix split of the topological order (each stage takes operators until
  // it holds its share): feasible whenever no operator is too large for the balance, and a
  // solver on a large graph may otherwise search long for any solution at all.
  IlpOptions solve_options = o.ilp;
  if (solve_options.start.empty() && total > 0) {
    double prefix = 0;
    int stage = 0;
    for (int v : order) {
      const double f = g.node(v).flops;
      if (stage + 1 < S && prefix + f / 2 > (stage + 1) * total / S) ++stage;
      prefix += f;
      const int s = std::clamp(stage, lo[size_t(v)], hi[size_t(v)]);
      solve_options.start.push_back({on(v, s), 1.0});
    }
  }
  const IlpResult r = ilp.solve(solve_options);
  PipelineCut out;
  out.status = r.status;
  out.variables = ilp.variables();
  out.constraints = ilp.constraints();
  out.solve_s = r.seconds;
  if (!r.has_solution()) return out;
  out.crossing_bytes = r.objective;
  out.stage.assign(size_t(n), -1);
  out.stage_flops.assign(size_t(S), 0);
  for (int v = 0; v < n; ++v) {
    for (int s = lo[size_t(v)]; s <= hi[size_t(v)]; ++s)
      if (r.integer(on(v, s)) == 1) out.stage[size_t(v)] = s;
    out.stage_flops[size_t(out.stage[size_t(v)])] += g.node(v).flops;
  }
  return out;
}

}  // namespace tessel::planner
