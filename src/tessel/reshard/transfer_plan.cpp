#include "tessel/reshard/transfer_plan.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>

#include <fmt/ranges.h>

#include "tessel/core/check.h"

namespace tessel::reshard {

using layout::StateLayout;
using layout::StatePiece;

namespace {

// a minus b (b inside a or not) as disjoint boxes: peel a's parts below and above b per dimension.
void subtract(const Box& a, const Box& cut, std::vector<Box>& out) {
  std::vector<int64_t> lo = a.lo(), hi = a.hi();
  for (size_t d = 0; d < a.rank(); ++d) {
    if (lo[d] < cut.lo(d)) {
      std::vector<int64_t> h = hi;
      h[d] = cut.lo(d);
      out.emplace_back(lo, std::move(h));
      lo[d] = cut.lo(d);
    }
    if (hi[d] > cut.hi(d)) {
      std::vector<int64_t> l = lo;
      l[d] = cut.hi(d);
      out.emplace_back(std::move(l), hi);
      hi[d] = cut.hi(d);
    }
  }
}

void check_same_model(const StateLayout& from, const StateLayout& to) {
  const auto& a = from.spec();
  const auto& b = to.spec();
  bool same = a.size() == b.size();
  for (size_t i = 0; same && i < a.size(); ++i)
    same = a[i].name == b[i].name && a[i].shape == b[i].shape;
  TESSEL_CHECK(same, ConfigError,
               "cannot reshard between layouts of different models ('{}', {} tensors and '{}', "
               "{} tensors); both layouts must be built from the same model config",
               from.config().name, a.size(), to.config().name, b.size());
}

// Ids must be >= 0 and distinct; with `lost_ok`, kLost entries are allowed (and not compared).
void check_ids(const std::vector<int>& ids, const char* what, bool lost_ok) {
  std::vector<int> sorted;
  for (int id : ids)
    if (!(lost_ok && id == TransferPlan::kLost)) sorted.push_back(id);
  std::sort(sorted.begin(), sorted.end());
  TESSEL_CHECK(sorted.empty() || sorted.front() >= 0, ConfigError,
               "{} process ids must be >= 0{} (got {})", what,
               lost_ok ? " or TransferPlan::kLost (-1) for a rank whose state is lost" : "",
               sorted.empty() ? 0 : sorted.front());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TESSEL_CHECK(dup == sorted.end(), ConfigError,
               "process id {} is given to two {} ranks; a process holds at most one rank of a "
               "layout",
               dup == sorted.end() ? 0 : *dup, what);
}

// Whether two buffers hold the same state in the same places.
bool same_contents(std::span<const StatePiece> a, std::span<const StatePiece> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].tensor != b[i].tensor || a[i].kind != b[i].kind || a[i].global != b[i].global ||
        a[i].offset != b[i].offset || a[i].strides != b[i].strides)
      return false;
  }
  return true;
}

// Rank r's pieces split by buffer.
std::vector<std::span<const StatePiece>> pieces_by_buffer(const StateLayout& L, int rank) {
  std::vector<std::span<const StatePiece>> out(L.buffers(rank).size());
  const auto all = L.pieces(rank);
  size_t i = 0;
  for (size_t b = 0; b < out.size(); ++b) {
    size_t j = i;
    while (j < all.size() && all[j].buffer == int(b)) ++j;
    out[b] = all.subspan(i, j - i);
    i = j;
  }
  return out;
}

}  // namespace

TransferPlan TransferPlan::build(const StateLayout& from, const StateLayout& to,
                                 const std::vector<int>& host_of_old_rank,
                                 const std::vector<int>& host_of_new_rank) {
  std::vector<int> old_ids(size_t(from.world())), new_ids(size_t(to.world()));
  std::iota(old_ids.begin(), old_ids.end(), 0);
  std::iota(new_ids.begin(), new_ids.end(), 0);
  return build(from, to, host_of_old_rank, host_of_new_rank, old_ids, new_ids);
}

TransferPlan TransferPlan::build(const StateLayout& from, const StateLayout& to,
                                 const std::vector<int>& host_of_old_rank,
                                 const std::vector<int>& host_of_new_rank,
                                 const std::vector<int>& old_ids, const std::vector<int>& new_ids) {
  check_same_model(from, to);
  for (StateKind k : to.kinds()) {
    TESSEL_CHECK(from.has_kind(k), ConfigError,
                 "the new layout holds '{}' state that the old layout lacks; build both layouts "
                 "with the same state kinds",
                 layout::state_kind_name(k));
  }
  TESSEL_CHECK(int(old_ids.size()) == from.world() && int(host_of_old_rank.size()) == from.world(),
               ConfigError,
               "the old layout has {} ranks but {} process ids and {} hosts were given",
               from.world(), old_ids.size(), host_of_old_rank.size());
  TESSEL_CHECK(int(new_ids.size()) == to.world() && int(host_of_new_rank.size()) == to.world(),
               ConfigError,
               "the new layout has {} ranks but {} process ids and {} hosts were given", to.world(),
               new_ids.size(), host_of_new_rank.size());
  check_ids(old_ids, "old", true);
  check_ids(new_ids, "new", false);
  auto lost = [&](int old_rank) { return old_ids[size_t(old_rank)] == kLost; };
  for (int i = 0; i < from.world(); ++i) {
    TESSEL_CHECK(lost(i) || host_of_old_rank[size_t(i)] >= 0, ConfigError,
                 "host ids must be >= 0 (got {})", host_of_old_rank[size_t(i)]);
  }
  for (int h : host_of_new_rank)
    TESSEL_CHECK(h >= 0, ConfigError, "host ids must be >= 0 (got {})", h);

  TransferPlan P;
  P.old_ids_ = old_ids;
  P.new_ids_ = new_ids;
  for (int id : old_ids)
    if (id != kLost) P.processes_.push_back(id);
  P.processes_.insert(P.processes_.end(), new_ids.begin(), new_ids.end());
  std::sort(P.processes_.begin(), P.processes_.end());
  P.processes_.erase(std::unique(P.processes_.begin(), P.processes_.end()), P.processes_.end());
  const size_t U = P.processes_.size();
  std::vector<int> host(U, -1);
  for (int i = 0; i < from.world(); ++i)
    if (!lost(i)) host[size_t(P.union_rank(old_ids[size_t(i)]))] = host_of_old_rank[size_t(i)];
  for (int j = 0; j < to.world(); ++j) {
    int& h = host[size_t(P.union_rank(new_ids[size_t(j)]))];
    TESSEL_CHECK(h < 0 || h == host_of_new_rank[size_t(j)], ConfigError,
                 "process {} is old rank {} on host {} but new rank {} on host {}; a surviving "
                 "process keeps its host",
                 new_ids[size_t(j)], P.old_rank_of(new_ids[size_t(j)]), h, j,
                 host_of_new_rank[size_t(j)]);
    h = host_of_new_rank[size_t(j)];
  }

  P.hosts_ = host;

  for (int i = 0; i < from.world(); ++i) {
    std::vector<int64_t> sizes;
    for (const auto& b : from.buffers(i)) sizes.push_back(b.numel);
    P.old_sizes_.push_back(std::move(sizes));
  }
  for (int j = 0; j < to.world(); ++j) {
    std::vector<int64_t> sizes;
    for (const auto& b : to.buffers(j)) sizes.push_back(b.numel);
    P.new_sizes_.push_back(std::move(sizes));
  }

  // Buffers a surviving process holds already, exactly as the new layout wants them.
  P.kept_.resize(size_t(to.world()));
  for (int j = 0; j < to.world(); ++j) {
    P.kept_[size_t(j)].assign(to.buffers(j).size(), -1);
    const int i = P.old_rank_of(new_ids[size_t(j)]);
    if (i < 0) continue;
    const auto old_pieces = pieces_by_buffer(from, i);
    const auto new_pieces = pieces_by_buffer(to, j);
    for (size_t b = 0; b < new_pieces.size(); ++b) {
      const auto& nb = to.buffers(j)[b];
      for (size_t ob = 0; ob < old_pieces.size(); ++ob) {
        const auto& o = from.buffers(i)[ob];
        if (o.kind == nb.kind && o.numel == nb.numel &&
            same_contents(old_pieces[ob], new_pieces[b])) {
          P.kept_[size_t(j)][b] = int(ob);
          P.stats_.kept_bytes += nb.numel * int64_t(sizeof(float));
          break;
        }
      }
    }
  }

  // The pieces to write, largest first (greedy balancing works best on big items first).
  std::vector<const StatePiece*> dests;
  for (int j = 0; j < to.world(); ++j) {
    for (const StatePiece& p : to.pieces(j)) {
      P.stats_.total_bytes += p.global.volume() * int64_t(sizeof(float));
      if (P.kept_[size_t(j)][size_t(p.buffer)] < 0) dests.push_back(&p);
    }
  }
  std::stable_sort(dests.begin(), dests.end(), [](const StatePiece* a, const StatePiece* b) {
    return a->global.volume() > b->global.volume();
  });

  std::vector<int64_t> load(U, 0);  // bytes each process sends so far
  std::vector<Box> remaining, next;
  for (const StatePiece* d : dests) {
    const int q = new_ids[size_t(d->rank)];
    const int hq = host[size_t(P.union_rank(q))];
    // Copies on lost ranks do not exist any more.
    auto cands = from.replicas(d->tensor, d->kind, d->global);
    std::erase_if(cands, [&](const StatePiece* c) { return lost(c->rank); });
    remaining.assign(1, d->global);
    // Moves what `c` holds of the remaining boxes into transfers; returns the elements taken.
    auto take = [&](const StatePiece& c) {
      int64_t taken = 0;
      next.clear();
      for (const Box& r : remaining) {
        const Box part = r.intersect(c.global);
        if (part.empty()) {
          next.push_back(r);
          continue;
        }
        Transfer t;
        t.tensor = d->tensor;
        t.kind = d->kind;
        t.global = part;
        t.src_rank = c.rank;
        t.src_buffer = c.buffer;
        t.src = c.region(part);
        t.dst_rank = d->rank;
        t.dst_buffer = d->buffer;
        t.dst = d->region(part);
        t.src_process = old_ids[size_t(c.rank)];
        t.dst_process = q;
        taken += part.volume();
        P.transfers_.push_back(std::move(t));
        subtract(r, part, next);
      }
      remaining.swap(next);
      return taken;
    };
    for (const StatePiece* c : cands) {
      if (old_ids[size_t(c->rank)] == q) take(*c);
    }
    for (const Box& r : remaining) P.stats_.min_bytes += r.volume() * int64_t(sizeof(float));
    while (!remaining.empty()) {
      const StatePiece* best = nullptr;
      std::tuple<bool, int64_t, int> best_key;
      for (const StatePiece* c : cands) {
        const int p = old_ids[size_t(c->rank)];
        if (p == q) continue;
        const bool overlaps = std::any_of(remaining.begin(), remaining.end(), [&](const Box& r) {
          return !r.intersect(c->global).empty();
        });
        if (!overlaps) continue;
        const int u = P.union_rank(p);
        const std::tuple<bool, int64_t, int> key{host[size_t(u)] != hq, load[size_t(u)], c->rank};
        if (best == nullptr || key < best_key) {
          best = c;
          best_key = key;
        }
      }
      if (best == nullptr) {
        // Every copy of this box was on a lost rank (or, for inconsistent layouts, nowhere).
        const Box& missing = remaining.front();
        std::vector<int> holders;
        for (const StatePiece* c : from.replicas(d->tensor, d->kind, missing))
          if (lost(c->rank)) holders.push_back(c->rank);
        TESSEL_CHECK(holders.empty(), ConfigError,
                     "the state {} of '{}' ({}) that the new layout ({}) needs was lost: only "
                     "old rank(s) {} of the old layout ({}) held it and their state is not "
                     "available; restore it from a checkpoint (lost_state() lists all that was "
                     "lost)",
                     missing.str(), from.spec()[size_t(d->tensor)].name,
                     layout::state_kind_name(d->kind), to.plan().describe(),
                     fmt::join(holders, ", "), from.plan().describe());
        TESSEL_THROW(ConfigError,
                     "the old layout ({}) holds no copy of {} of '{}' ({}) that the new layout "
                     "({}) needs",
                     from.plan().describe(), missing.str(), from.spec()[size_t(d->tensor)].name,
                     layout::state_kind_name(d->kind), to.plan().describe());
      }
      const int u = P.union_rank(old_ids[size_t(best->rank)]);
      load[size_t(u)] += take(*best) * int64_t(sizeof(float));
    }
  }

  // One message per (sender, receiver) pair.
  std::map<std::pair<int, int>, Message> by_pair;
  for (size_t t = 0; t < P.transfers_.size(); ++t) {
    const Transfer& tr = P.transfers_[t];
    if (tr.src_process == tr.dst_process) {
      P.stats_.local_copy_bytes += tr.numel() * int64_t(sizeof(float));
      continue;
    }
    Message& m = by_pair[{tr.src_process, tr.dst_process}];
    m.src_process = tr.src_process;
    m.dst_process = tr.dst_process;
    m.transfers.push_back(int(t));
    m.numel += tr.numel();
  }
  std::vector<int64_t> sent(U, 0), received(U, 0);
  for (auto& [pair, m] : by_pair) {
    P.stats_.bytes_moved += m.bytes();
    const size_t s = size_t(P.union_rank(m.src_process)), r = size_t(P.union_rank(m.dst_process));
    if (host[s] != host[r]) P.stats_.bytes_cross_host += m.bytes();
    sent[s] += m.bytes();
    received[r] += m.bytes();
    P.messages_.push_back(std::move(m));
  }
  P.stats_.messages = int64_t(P.messages_.size());
  for (size_t u = 0; u < U; ++u) {
    P.stats_.max_send_bytes = std::max(P.stats_.max_send_bytes, sent[u]);
    P.stats_.max_recv_bytes = std::max(P.stats_.max_recv_bytes, received[u]);
  }
  return P;
}

int TransferPlan::union_rank(int process) const {
  auto it = std::lower_bound(processes_.begin(), processes_.end(), process);
  TESSEL_CHECK(it != processes_.end() && *it == process, InvalidArgumentError,
               "process {} takes no part in this transition", process);
  return int(it - processes_.begin());
}

int TransferPlan::old_rank_of(int process) const {
  if (process == kLost) return -1;  // not a process: the marker of lost ranks
  auto it = std::find(old_ids_.begin(), old_ids_.end(), process);
  return it == old_ids_.end() ? -1 : int(it - old_ids_.begin());
}

int TransferPlan::new_rank_of(int process) const {
  auto it = std::find(new_ids_.begin(), new_ids_.end(), process);
  return it == new_ids_.end() ? -1 : int(it - new_ids_.begin());
}

const std::vector<int64_t>& TransferPlan::old_buffer_sizes(int old_rank) const {
  TESSEL_CHECK(old_rank >= 0 && old_rank < old_world(), InvalidArgumentError,
               "old rank {} is outside [0, {})", old_rank, old_world());
  return old_sizes_[size_t(old_rank)];
}

const std::vector<int64_t>& TransferPlan::new_buffer_sizes(int new_rank) const {
  TESSEL_CHECK(new_rank >= 0 && new_rank < new_world(), InvalidArgumentError,
               "new rank {} is outside [0, {})", new_rank, new_world());
  return new_sizes_[size_t(new_rank)];
}

std::vector<int> TransferPlan::local_transfers(int process) const {
  std::vector<int> out;
  for (size_t t = 0; t < transfers_.size(); ++t) {
    if (transfers_[t].src_process == process && transfers_[t].dst_process == process)
      out.push_back(int(t));
  }
  return out;
}

int TransferPlan::kept_from(int new_rank, int buffer) const {
  TESSEL_CHECK(new_rank >= 0 && new_rank < new_world() && buffer >= 0 &&
                   size_t(buffer) < kept_[size_t(new_rank)].size(),
               InvalidArgumentError, "no buffer {} on new rank {}", buffer, new_rank);
  return kept_[size_t(new_rank)][size_t(buffer)];
}

std::vector<LostPiece> lost_state(const StateLayout& from, const std::vector<bool>& available) {
  TESSEL_CHECK(int(available.size()) == from.world(), InvalidArgumentError,
               "the layout has {} ranks but availability was given for {}", from.world(),
               available.size());
  // Per (tensor, kind): what lost ranks hold that no available rank does. Each lost piece is
  // cut by the available copies and by what earlier lost ranks already reported (two lost
  // replicas of a box report it once).
  std::map<std::pair<int, StateKind>, std::vector<Box>> found;
  std::vector<Box> rest, next;
  for (int r = 0; r < from.world(); ++r) {
    if (available[size_t(r)]) continue;
    for (const StatePiece& p : from.pieces(r)) {
      if (p.global.empty()) continue;
      auto& reported = found[{p.tensor, p.kind}];
      rest.assign(1, p.global);
      auto cut = [&](const Box& c) {
        next.clear();
        for (const Box& b : rest) {
          const Box part = b.intersect(c);
          if (part.empty()) {
            next.push_back(b);
          } else {
            subtract(b, part, next);
          }
        }
        rest.swap(next);
      };
      for (const StatePiece* c : from.replicas(p.tensor, p.kind, p.global)) {
        if (available[size_t(c->rank)]) cut(c->global);
        if (rest.empty()) break;
      }
      for (size_t i = 0, n = reported.size(); i < n && !rest.empty(); ++i) cut(reported[i]);
      reported.insert(reported.end(), rest.begin(), rest.end());
    }
  }
  std::vector<LostPiece> out;
  for (auto& [key, boxes] : found) {
    for (Box& b : boxes) out.push_back({key.first, key.second, std::move(b)});
  }
  return out;
}

std::string describe(const std::vector<LostPiece>& lost, const StateLayout& layout,
                     size_t max_items) {
  if (lost.empty()) return "nothing";
  int64_t bytes = 0;
  for (const LostPiece& p : lost) bytes += p.box.volume() * int64_t(sizeof(float));
  std::string s = fmt::format("{} piece{}, {:.1f} MB:", lost.size(), lost.size() == 1 ? "" : "s",
                              double(bytes) / 1e6);
  for (size_t i = 0; i < lost.size() && i < max_items; ++i) {
    const LostPiece& p = lost[i];
    s += fmt::format("{} {} ({}) {}", i == 0 ? "" : ",", layout.spec()[size_t(p.tensor)].name,
                     layout::state_kind_name(p.kind), p.box.str());
  }
  if (lost.size() > max_items) s += fmt::format(", ... and {} more", lost.size() - max_items);
  return s;
}

}  // namespace tessel::reshard
