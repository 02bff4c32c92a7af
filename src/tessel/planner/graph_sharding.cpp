#include "tessel/planner/graph_sharding.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "tessel/core/check.h"

namespace tessel::planner {

namespace {

constexpr double kNone = std::numeric_limits<double>::infinity();

struct Segment {
  int head = -1;           // the critical node before it (-1: the graph's start)
  int tail = -1;           // its last node, critical (-1: the last segment's, chosen freely)
  std::vector<int> nodes;  // computing nodes after head, through tail, in topological order
};

struct Solved {
  double time = kNone;
  IlpStatus status = IlpStatus::no_solution;
  std::vector<int> index;  // per segment node
};

class Planner {
 public:
  Planner(const OpGraph& g, int t, const ShardingCosts& c, const IlpOptions& o,
          GraphShardingStats& stats)
      : g_(g), t_(t), c_(c), o_(o), stats_(stats) {
    // Each segment ends on a critical node, the next one's head; the last one's end is nobody's
    // head, so its programme chooses it freely (the best over all its strategies).
    int head = -1;
    for (auto& nodes : g.segments()) {
      Segment s;
      s.head = head;
      s.nodes = std::move(nodes);
      head = s.tail = s.nodes.back();
      segments_.push_back(std::move(s));
    }
    if (!segments_.empty()) segments_.back().tail = -1;
    stats_.segments = int(segments_.size());
    for (int v = 0; v < g.size(); ++v) options_.push_back(op_strategies(g, v, t));
  }

  // The DP over the critical nodes' strategies, every node limited to `allowed` (empty: all).
  ShardingSolution run(const std::vector<std::vector<int>>& allowed) {
    allowed_ = &allowed;
    // f[a]: the best time of everything before and including the current head in strategy a.
    std::vector<double> f = {0};
    std::vector<int> f_index = {-1};  // the head strategy each entry of f stands for
    std::vector<std::map<int, int>> from(segments_.size());  // per segment: tail b -> head a
    std::vector<std::map<std::pair<int, int>, const Solved*>> solved(segments_.size());
    IlpStatus worst = IlpStatus::optimal;
    for (size_t k = 0; k < segments_.size(); ++k) {
      const Segment& s = segments_[k];
      const std::vector<int> tails = s.tail >= 0 ? choices(s.tail) : std::vector<int>{-1};
      std::vector<double> next(tails.size(), kNone);
      for (size_t j = 0; j < tails.size(); ++j) {
        for (size_t i = 0; i < f.size(); ++i) {
          if (f[i] == kNone) continue;
          const Solved& r = solve(s, f_index[i], tails[j]);
          if (r.time == kNone) continue;
          if (r.status == IlpStatus::feasible) worst = IlpStatus::feasible;
          if (f[i] + r.time < next[j]) {
            next[j] = f[i] + r.time;
            from[k][tails[j]] = f_index[i];
            solved[k][{f_index[i], tails[j]}] = &r;
          }
        }
      }
      f = std::move(next);
      f_index = tails;
    }
    ShardingSolution out;
    size_t best = 0;
    for (size_t j = 1; j < f.size(); ++j)
      if (f[j] < f[best]) best = j;
    if (f.empty() || f[best] == kNone) {
      out.status = IlpStatus::infeasible;
      return out;
    }
    out.status = worst;
    out.time_s = out.bound_s = f[best];
    out.chosen.resize(size_t(g_.size()));
    out.index.assign(size_t(g_.size()), -1);
    int tail = f_index[best];
    for (size_t k = segments_.size(); k-- > 0;) {
      const int head = from[k].at(tail);
      const Solved& r = *solved[k].at({head, tail});
      const Segment& s = segments_[k];
      for (size_t i = 0; i < s.nodes.size(); ++i) {
        const int v = s.nodes[i];
        out.index[size_t(v)] = r.index[i];
        out.chosen[size_t(v)] = options_[size_t(v)][size_t(r.index[i])];
      }
      tail = head;
    }
    return out;
  }

  const std::vector<std::vector<OpStrategy>>& options() const { return options_; }

 private:
  std::vector<int> choices(int v) const {
    if (!(*allowed_)[size_t(v)].empty()) return (*allowed_)[size_t(v)];
    std::vector<int> all;
    for (int i = 0; i < int(options_[size_t(v)].size()); ++i) all.push_back(i);
    return all;
  }

  // What makes two segments' programmes the same: their nodes (as the programme sees them), the
  // links between them relative to the segment, the strategies allowed, and head and tail.
  std::string signature(const Segment& s, int a, int b) const {
    std::map<int, int> at;
    if (s.head >= 0) at[s.head] = -1;
    for (size_t i = 0; i < s.nodes.size(); ++i) at[s.nodes[i]] = int(i);
    std::string key = fmt::format("{}|{}|{}|{}", t_, s.head >= 0 ? node_key(s.head) : "", a, b);
    for (int v : s.nodes) {
      key += "|" + node_key(v) + ":";
      for (int u : g_.node(v).inputs) {
        auto it = at.find(u);
        key += it == at.end() ? "x," : fmt::format("{},", it->second);
      }
      const int w = g_.node(v).weights_of;
      if (w >= 0) key += fmt::format("w{}", at.contains(w) ? at.at(w) : -2);
      key += fmt::format("a{}", fmt::join((*allowed_)[size_t(v)], "."));
    }
    return key;
  }

  std::string node_key(int v) const {
    const OpNode& n = g_.node(v);
    return fmt::format(
        "{}[{}]{}w{}d{}", int(n.kind), fmt::join(n.shape, ","), n.flops,
        n.weights.size() > 0 ? fmt::format("{}", fmt::join(n.weights[0], ",")) : std::string(),
        fmt::join(n.dim_of, ","));
  }

  const Solved& solve(const Segment& s, int a, int b) {
    const std::string key = signature(s, a, b);
    if (auto it = cache_.find(key); it != cache_.end()) {
      ++stats_.reused;
      return it->second;
    }
    ShardingProblem p;
    p.active.assign(size_t(g_.size()), 0);
    p.allowed = *allowed_;
    p.uncosted.assign(size_t(g_.size()), 0);
    for (int v : s.nodes) p.active[size_t(v)] = 1;
    if (s.head >= 0) {
      p.active[size_t(s.head)] = 1;
      p.allowed[size_t(s.head)] = {a};
      p.uncosted[size_t(s.head)] = 1;  // the segment before counts it
    }
    if (s.tail >= 0) p.allowed[size_t(s.tail)] = {b};
    const ShardingSolution r = solve_sharding(g_, t_, c_, o_, p);
    ++stats_.programmes;
    if (r.status == IlpStatus::optimal) ++stats_.optimal_programmes;
    Solved out;
    out.status = r.status;
    if (!r.index.empty()) {
      out.time = r.time_s;
      for (int v : s.nodes) out.index.push_back(r.index[size_t(v)]);
    }
    return cache_.emplace(key, std::move(out)).first->second;
  }

  const OpGraph& g_;
  const int t_;
  const ShardingCosts& c_;
  const IlpOptions& o_;
  GraphShardingStats& stats_;
  std::vector<Segment> segments_;
  std::vector<std::vector<OpStrategy>> options_;
  const std::vector<std::vector<int>>* allowed_ = nullptr;
  std::map<std::string, Solved> cache_;
};

}  // namespace

double state_bytes(const OpGraph& g, const ShardingSolution& s, const ShardingCosts& costs) {
  double bytes = 0;
  for (int v = 0; v < g.size() && size_t(v) < s.chosen.size(); ++v)
    if (g.node(v).weights_of < 0)  // a tied reader's weights are its owner's
      bytes += s.chosen[size_t(v)].weight_elements * costs.state_bytes_per_weight;
  return bytes;
}

ShardingSolution shard_graph(const OpGraph& g, int t, const ShardingCosts& costs,
                             const IlpOptions& options, GraphShardingStats* stats,
                             int whole_up_to) {
  const auto t0 = std::chrono::steady_clock::now();
  GraphShardingStats local;
  GraphShardingStats& st = stats != nullptr ? *stats : local;
  st = GraphShardingStats{};
  if (g.size() <= whole_up_to) {
    // Small enough for one programme, which beats a programme per segment and pair of boundary
    // strategies (a 70-operator exported GPT-2: 1 s against 92 programmes in 22 s) and keeps the
    // memory row whole.
    ShardingSolution r = solve_sharding(g, t, costs, options);
    st.segments = 1;
    st.programmes = 1;
    st.optimal_programmes = r.status == IlpStatus::optimal ? 1 : 0;
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
  // The DP at one memory price (costs.memory_price), no memory row in the programmes.
  auto decomposed = [&](const ShardingCosts& c) {
    Planner planner(g, t, c, options, st);
    const auto& opts = planner.options();
    // A weight read by nodes in different segments: one DP per layout of it.
    std::vector<std::pair<int, int>> ties;  // (owner, reader)
    for (int v = 0; v < g.size(); ++v)
      if (g.node(v).weights_of >= 0) ties.push_back({g.node(v).weights_of, v});
    std::vector<std::vector<int>> allowed(size_t(g.size()));
    ShardingSolution best;
    best.status = IlpStatus::infeasible;
    if (ties.empty()) {
      best = planner.run(allowed);
    } else {
      // The owners' weight layouts (one owner in the transformer graphs; several are tried
      // independently of each other, so this is exact for one and a heuristic beyond).
      std::set<std::pair<int, int>> layouts;  // (kind, dim)
      const int owner = ties.front().first;
      for (const auto& s : opts[size_t(owner)])
        layouts.insert({int(s.weights.front().kind), s.weights.front().dim});
      for (const auto& [kind, dim] : layouts) {
        const Shard layout{Shard::Kind(kind), dim};
        std::vector<std::vector<int>> limited(size_t(g.size()));
        bool possible = true;
        for (const auto& [o, r] : ties) {
          for (int v : {o, r}) {
            limited[size_t(v)].clear();
            for (int i = 0; i < int(opts[size_t(v)].size()); ++i)
              if (opts[size_t(v)][size_t(i)].weights.front() == layout)
                limited[size_t(v)].push_back(i);
            possible &= !limited[size_t(v)].empty();
          }
        }
        if (!possible) continue;
        ShardingSolution r = planner.run(limited);
        if (!r.index.empty() && (best.index.empty() || r.time_s < best.time_s)) best = std::move(r);
      }
    }
    return best;
  };
  ShardingCosts free = costs;
  free.memory_bytes = std::numeric_limits<double>::infinity();
  free.memory_price = 0;
  ShardingSolution best = decomposed(free);
  const double budget = costs.memory_bytes;
  if (std::isfinite(budget) && !best.index.empty() && state_bytes(g, best, costs) > budget) {
    // The budget couples the segments, which a programme per segment cannot see: priced instead
    // (Lagrangian relaxation). A price p adds p x its state bytes to every strategy; the least
    // price whose DP fits is searched by doubling, then bisection, keeping the fastest plan that
    // fits. Not proven optimal: the status says feasible.
    // Each priced optimum less price x budget bounds the true optimum from below (weak
    // duality): the best of them is the solution's bound.
    double bound = 0;
    auto priced = [&](double price) {
      ShardingCosts c = free;
      c.memory_price = price;
      ShardingSolution r = decomposed(c);
      if (r.index.empty()) return r;
      if (r.status == IlpStatus::optimal) bound = std::max(bound, r.time_s - price * budget);
      r.time_s -= price * state_bytes(g, r, costs);
      return r;
    };
    auto fits = [&](const ShardingSolution& r) {
      return !r.index.empty() && state_bytes(g, r, costs) <= budget;
    };
    // Every node in its leanest strategy: below that, nothing fits.
    double least = 0;
    for (int v = 0; v < g.size(); ++v) {
      if (g.node(v).weights_of >= 0) continue;
      double lean = std::numeric_limits<double>::infinity();
      for (const auto& s : op_strategies(g, v, t)) lean = std::min(lean, s.weight_elements);
      least += lean * costs.state_bytes_per_weight;
    }
    double lo = 0, hi = best.time_s / state_bytes(g, best, costs);
    ShardingSolution fitting;
    for (int i = 0; least <= budget && i < 40 && !fits(fitting = priced(hi)); ++i) lo = hi, hi *= 4;
    if (!fits(fitting)) {
      best = ShardingSolution{};
      best.status = IlpStatus::infeasible;
    } else {
      for (int i = 0; i < 6; ++i) {
        const double mid = lo > 0 ? std::sqrt(lo * hi) : hi / 4;
        ShardingSolution r = priced(mid);
        if (fits(r)) {
          hi = mid;
          if (r.time_s < fitting.time_s) fitting = std::move(r);
        } else {
          lo = mid;
        }
      }
      best = std::move(fitting);
      best.bound_s = std::min(bound, best.time_s);
      if (best.status == IlpStatus::optimal) best.status = IlpStatus::feasible;
    }
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  best.solve_s = st.seconds;
  return best;
}

}  // namespace tessel::planner
