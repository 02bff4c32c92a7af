#include "tessel/planner/segment_sharding.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

namespace tessel::planner {

namespace {

constexpr double kNone = std::numeric_limits<double>::infinity();
constexpr int kFree = -2;  // a head or tail the programme chooses itself (a bound's programme)

struct Segment {
  int head = -1;           // the critical node before it (-1: the graph's start)
  int tail = -1;           // its last node, critical (-1: the last segment's, chosen freely)
  std::vector<int> nodes;  // computing nodes after head, through tail, in topological order
};

struct Solved {
  double time = kNone;   // the programme's solution (kNone: none)
  double bound = kNone;  // a proven lower bound on its optimum (kNone: infeasible)
  IlpStatus status = IlpStatus::no_solution;
  std::vector<int> index;  // per segment node
};

class Planner {
 public:
  Planner(const OpGraph& g, const StrategySpace& space, const std::string& key, const IlpOptions& o,
          GraphShardingStats& stats)
      : g_(g), space_(space), key_(key), o_(o), stats_(stats) {
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
  }

  // The DP over the critical nodes' strategies, every node limited to `allowed` (empty: all).
  Programme run(const std::vector<std::vector<int>>& allowed) {
    allowed_ = &allowed;
    // f[i]: the best time of everything before and including the current head in strategy
    // f_index[i] (-1: no head).
    std::vector<double> f = {0};
    std::vector<int> f_index = {-1};
    std::vector<std::map<int, int>> from(segments_.size());  // per segment: tail b -> head a
    std::vector<std::map<std::pair<int, int>, const Solved*>> solved(segments_.size());
    IlpStatus worst = IlpStatus::optimal;
    for (size_t k = 0; k < segments_.size(); ++k) {
      const Segment& s = segments_[k];
      const std::vector<int> tails = s.tail >= 0 ? choices(s.tail) : std::vector<int>{-1};
      // Heads cheapest first, so that each tail's best is found early and bounds prune the rest.
      std::vector<size_t> heads;
      for (size_t i = 0; i < f.size(); ++i)
        if (f[i] != kNone) heads.push_back(i);
      std::stable_sort(heads.begin(), heads.end(), [&](size_t x, size_t y) { return f[x] < f[y]; });
      const bool bounded = heads.size() * tails.size() >= 4 * (heads.size() + tails.size());
      std::vector<double> head_bound(f.size(), 0), tail_bound(tails.size(), 0);
      if (bounded) {
        for (size_t i : heads) head_bound[i] = solve(s, f_index[i], kFree).bound;
        for (size_t j = 0; j < tails.size(); ++j) tail_bound[j] = solve(s, kFree, tails[j]).bound;
      }
      std::vector<double> next(tails.size(), kNone);
      for (size_t j = 0; j < tails.size(); ++j) {
        for (size_t i : heads) {
          if (f[i] + std::max(head_bound[i], tail_bound[j]) >= next[j]) {
            ++stats_.pruned;
            continue;
          }
          const Solved& r = solve(s, f_index[i], tails[j]);
          if (r.time == kNone) continue;
          if (r.status != IlpStatus::optimal) worst = IlpStatus::feasible;
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
    Programme out;
    const auto best = std::min_element(f.begin(), f.end());
    if (f.empty() || *best == kNone) {
      out.status = IlpStatus::infeasible;
      return out;
    }
    out.status = worst;
    out.time_s = out.bound_s = *best;
    out.index.assign(size_t(g_.size()), -1);
    int tail = f_index[size_t(best - f.begin())];
    for (size_t k = segments_.size(); k-- > 0;) {
      const int head = from[k].at(tail);
      const Solved& r = *solved[k].at({head, tail});
      const Segment& s = segments_[k];
      for (size_t i = 0; i < s.nodes.size(); ++i) out.index[size_t(s.nodes[i])] = r.index[i];
      tail = head;
    }
    return out;
  }

 private:
  std::vector<int> choices(int v) const {
    if (!(*allowed_)[size_t(v)].empty()) return (*allowed_)[size_t(v)];
    std::vector<int> all(size_t(space_.count(v)));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }

  // What makes two segments' programmes the same: their nodes (as the programme sees them), the
  // links between them relative to the segment, the strategies allowed, and head and tail.
  std::string signature(const Segment& s, int a, int b) const {
    std::map<int, int> at;
    if (s.head >= 0) at[s.head] = -1;
    for (size_t i = 0; i < s.nodes.size(); ++i) at[s.nodes[i]] = int(i);
    std::string key = fmt::format("{}|{}|{}|{}", key_, s.head >= 0 ? node_key(s.head) : "", a, b);
    if (s.head >= 0) key += fmt::format("h{}", fmt::join((*allowed_)[size_t(s.head)], "."));
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

  // Head strategy a (-1: no head; kFree: any allowed) and tail strategy b (-1: the last
  // segment's, free; kFree: any allowed).
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
      if (a != kFree) p.allowed[size_t(s.head)] = {a};
      p.uncosted[size_t(s.head)] = 1;  // the segment before counts it
    }
    if (s.tail >= 0 && b != kFree) p.allowed[size_t(s.tail)] = {b};
    const Programme r = solve_programme(g_, space_, kNone, o_, p);
    ++stats_.programmes;
    if (r.status == IlpStatus::optimal) ++stats_.optimal_programmes;
    Solved out;
    out.status = r.status;
    // Costs are never negative: 0 bounds any programme whose solver proved nothing better.
    out.bound = r.status == IlpStatus::infeasible ? kNone
                : r.status == IlpStatus::optimal  ? std::min(r.time_s, std::max(r.bound_s, 0.0))
                                                  : std::max(r.bound_s, 0.0);
    if (!r.index.empty()) {
      out.time = r.time_s;
      for (int v : s.nodes) out.index.push_back(r.index[size_t(v)]);
    }
    return cache_.emplace(key, std::move(out)).first->second;
  }

  const OpGraph& g_;
  const StrategySpace& space_;
  const std::string& key_;
  const IlpOptions& o_;
  GraphShardingStats& stats_;
  std::vector<Segment> segments_;
  const std::vector<std::vector<int>>* allowed_ = nullptr;
  std::map<std::string, Solved> cache_;
};

// The training state per device of a plan's nodes (a tied reader's weights are its owner's).
double state_bytes(const OpGraph& g, const StrategySpace& space, const std::vector<int>& index) {
  double bytes = 0;
  for (int v = 0; v < g.size() && size_t(v) < index.size(); ++v)
    if (g.node(v).weights_of < 0 && index[size_t(v)] >= 0)
      bytes += space.state_bytes(v, index[size_t(v)]);
  return bytes;
}

}  // namespace

Programme shard_by_segments(const OpGraph& g, const SpaceAtPrice& space_at,
                            const std::string& space_key, double memory_bytes,
                            const IlpOptions& options, GraphShardingStats& st, int whole_up_to) {
  const auto t0 = std::chrono::steady_clock::now();
  st = GraphShardingStats{};
  const std::unique_ptr<StrategySpace> free_space = space_at(0);
  if (g.size() <= whole_up_to) {
    // Small enough for one programme, which beats a programme per segment and pair of boundary
    // strategies (a 70-operator exported GPT-2: 1 s against 92 programmes in 22 s) and keeps the
    // memory row whole.
    Programme r = solve_programme(g, *free_space, memory_bytes, options, ShardingProblem{});
    st.segments = 1;
    st.programmes = 1;
    st.optimal_programmes = r.status == IlpStatus::optimal ? 1 : 0;
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
  // A weight read by nodes in different segments: one DP per layout of it.
  std::vector<std::pair<int, int>> ties;  // (owner, reader)
  for (int v = 0; v < g.size(); ++v)
    if (g.node(v).weights_of >= 0) ties.push_back({g.node(v).weights_of, v});
  // The DP at one memory price, no memory row in the programmes.
  auto decomposed = [&](const StrategySpace& space) {
    Planner planner(g, space, space_key, options, st);
    std::vector<std::vector<int>> allowed(size_t(g.size()));
    if (ties.empty()) return planner.run(allowed);
    // The owner's weight layouts, one representative strategy each (one owner in the transformer
    // graphs; several are tried independently of each other, so this is exact for one and a
    // heuristic beyond).
    const int owner = ties.front().first;
    std::vector<int> layouts;
    for (int a = 0; a < space.count(owner); ++a)
      if (std::none_of(layouts.begin(), layouts.end(),
                       [&](int r) { return space.same_weights(owner, r, owner, a); }))
        layouts.push_back(a);
    Programme best;
    best.status = IlpStatus::infeasible;
    for (const int layout : layouts) {
      std::vector<std::vector<int>> limited(size_t(g.size()));
      bool possible = true;
      for (const auto& [o, r] : ties) {
        for (int v : {o, r}) {
          limited[size_t(v)].clear();
          for (int i = 0; i < space.count(v); ++i)
            if (space.same_weights(owner, layout, v, i)) limited[size_t(v)].push_back(i);
          possible &= !limited[size_t(v)].empty();
        }
      }
      if (!possible) continue;
      Programme r = planner.run(limited);
      if (!r.index.empty() && (best.index.empty() || r.time_s < best.time_s)) best = std::move(r);
    }
    return best;
  };
  Programme best = decomposed(*free_space);
  if (std::isfinite(memory_bytes) && !best.index.empty() &&
      state_bytes(g, *free_space, best.index) > memory_bytes) {
    // The budget couples the segments, which a programme per segment cannot see: priced instead
    // (Lagrangian relaxation). A price p adds p x its state bytes to every strategy; the least
    // price whose DP fits is searched by doubling, then bisection, keeping the fastest plan that
    // fits. Not proven optimal: the status says feasible.
    // Each priced optimum less price x budget bounds the true optimum from below (weak
    // duality): the best of them is the solution's bound.
    double bound = 0;
    auto priced = [&](double price) {
      const std::unique_ptr<StrategySpace> space = space_at(price);
      Programme r = decomposed(*space);
      if (r.index.empty()) return r;
      if (r.status == IlpStatus::optimal) bound = std::max(bound, r.time_s - price * memory_bytes);
      r.time_s -= price * state_bytes(g, *free_space, r.index);
      return r;
    };
    auto fits = [&](const Programme& r) {
      return !r.index.empty() && state_bytes(g, *free_space, r.index) <= memory_bytes;
    };
    // Every node in its leanest strategy: below that, nothing fits.
    double least = 0;
    for (int v = 0; v < g.size(); ++v) {
      if (g.node(v).weights_of >= 0) continue;
      double lean = kNone;
      for (int s = 0; s < free_space->count(v); ++s)
        lean = std::min(lean, free_space->state_bytes(v, s));
      least += lean;
    }
    double lo = 0, hi = best.time_s / state_bytes(g, *free_space, best.index);
    Programme fitting;
    for (int i = 0; least <= memory_bytes && i < 40 && !fits(fitting = priced(hi)); ++i)
      lo = hi, hi *= 4;
    if (!fits(fitting)) {
      best = Programme{};
      best.status = IlpStatus::infeasible;
    } else {
      for (int i = 0; i < 6; ++i) {
        const double mid = lo > 0 ? std::sqrt(lo * hi) : hi / 4;
        Programme r = priced(mid);
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
