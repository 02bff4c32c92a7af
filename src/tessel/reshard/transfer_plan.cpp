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

// The build steps, in the order TransferPlan::build runs them.

// Rejects every inconsistent argument before any work, so a bad call fails with a message that
// names the argument at fault, and the steps below may index the lists without checks.
void check_arguments(const StateLayout& from, const StateLayout& to,
                     const std::vector<int>& host_of_old_rank,
                     const std::vector<int>& host_of_new_rank, const std::vector<int>& old_ids,
                     const std::vector<int>& new_ids) {
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
  for (size_t i = 0; i < old_ids.size(); ++i) {
    TESSEL_CHECK(old_ids[i] == TransferPlan::kLost || host_of_old_rank[i] >= 0, ConfigError,
                 "host ids must be >= 0 (got {})", host_of_old_rank[i]);
  }
  for (int h : host_of_new_rank)
    TESSEL_CHECK(h >= 0, ConfigError, "host ids must be >= 0 (got {})", h);
}

// Every process of the transition once, ascending (survivors are in both lists, lost old ranks in
// neither): the members of the union world the executor communicates in, whose ranks index the
// per-process tables below.
std::vector<int> union_of_processes(const std::vector<int>& old_ids,
                                    const std::vector<int>& new_ids) {
  std::vector<int> processes;
  for (int id : old_ids)
    if (id != TransferPlan::kLost) processes.push_back(id);
  processes.insert(processes.end(), new_ids.begin(), new_ids.end());
  std::sort(processes.begin(), processes.end());
  processes.erase(std::unique(processes.begin(), processes.end()), processes.end());
  return processes;
}

// The host of each process by union rank, which the choice of sources (same host first) and the
// cross-host statistics need. A survivor appears in both lists: it must name the same host
// twice, since a process cannot move. `P` already knows its processes.
std::vector<int> hosts_by_union_rank(const TransferPlan& P,
                                     const std::vector<int>& host_of_old_rank,
                                     const std::vector<int>& host_of_new_rank) {
  std::vector<int> host(P.processes().size(), -1);
  for (int i = 0; i < P.old_world(); ++i) {
    const int p = P.process_of_old_rank(i);
    if (p != TransferPlan::kLost) host[size_t(P.union_rank(p))] = host_of_old_rank[size_t(i)];
  }
  for (int j = 0; j < P.new_world(); ++j) {
    const int q = P.process_of_new_rank(j);
    int& h = host[size_t(P.union_rank(q))];
    TESSEL_CHECK(h < 0 || h == host_of_new_rank[size_t(j)], ConfigError,
                 "process {} is old rank {} on host {} but new rank {} on host {}; a surviving "
                 "process keeps its host",
                 q, P.old_rank_of(q), h, j, host_of_new_rank[size_t(j)]);
    h = host_of_new_rank[size_t(j)];
  }
  return host;
}

// Each rank's buffer sizes (floats), kept in the plan so the executor can size and check the
// buffers without the layouts.
std::vector<std::vector<int64_t>> buffer_sizes(const StateLayout& L) {
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < L.world(); ++r) {
    std::vector<int64_t> sizes;
    for (const auto& b : L.buffers(r)) sizes.push_back(b.numel);
    out.push_back(std::move(sizes));
  }
  return out;
}

// For each new buffer, the old buffer of the same process that already holds exactly its contents
// in exactly its layout, or -1: such a buffer needs no transfer at all (the runtime may keep it as
// it is), which is what makes an unchanged layout move nothing. Adds their bytes to kept_bytes.
std::vector<std::vector<int>> kept_buffers(const TransferPlan& P, const StateLayout& from,
                                           const StateLayout& to, int64_t& kept_bytes) {
  std::vector<std::vector<int>> kept(size_t(to.world()));
  for (int j = 0; j < to.world(); ++j) {
    kept[size_t(j)].assign(to.buffers(j).size(), -1);
    const int i = P.old_rank_of(P.process_of_new_rank(j));
    if (i < 0) continue;
    const auto old_pieces = pieces_by_buffer(from, i);
    const auto new_pieces = pieces_by_buffer(to, j);
    for (size_t b = 0; b < new_pieces.size(); ++b) {
      const auto& nb = to.buffers(j)[b];
      for (size_t ob = 0; ob < old_pieces.size(); ++ob) {
        const auto& o = from.buffers(i)[ob];
        if (o.kind == nb.kind && o.numel == nb.numel &&
            same_contents(old_pieces[ob], new_pieces[b])) {
          kept[size_t(j)][b] = int(ob);
          kept_bytes += nb.numel * int64_t(sizeof(float));
          break;
        }
      }
    }
  }
  return kept;
}

// The new pieces that transfers must write (those outside kept buffers), largest first: the
// greedy balancing of senders works best when the big items are placed first. Adds the bytes of
// every new piece, kept or not, to total_bytes.
std::vector<const StatePiece*> pieces_to_write(const StateLayout& to,
                                               const std::vector<std::vector<int>>& kept,
                                               int64_t& total_bytes) {
  std::vector<const StatePiece*> dests;
  for (int j = 0; j < to.world(); ++j) {
    for (const StatePiece& p : to.pieces(j)) {
      total_bytes += p.global.volume() * int64_t(sizeof(float));
      if (kept[size_t(j)][size_t(p.buffer)] < 0) dests.push_back(&p);
    }
  }
  std::stable_sort(dests.begin(), dests.end(), [](const StatePiece* a, const StatePiece* b) {
    return a->global.volume() > b->global.volume();
  });
  return dests;
}

// Chooses the sources of the new pieces, one piece at a time in the order given (see "Sources"
// in the header), and records the transfers. It carries what the pieces share: the bytes each
// process sends so far (the load the choice balances) and the transfers made.
class SourceChooser {
 public:
  SourceChooser(const TransferPlan& P, const StateLayout& from, const StateLayout& to)
      : P_(P), from_(from), to_(to), load_(P.processes().size(), 0) {}

  // Writes new piece `d`: first from the receiving process's own old copies (a local copy moves
  // nothing between processes), then from the best other copy until nothing is missing. Adds to
  // min_bytes what the process must receive (no exact plan moves less). Throws ConfigError when
  // some element has no copy on an old rank that is not lost.
  void write(const StatePiece& d, int64_t& min_bytes) {
    const int q = P_.process_of_new_rank(d.rank);
    // Copies on lost ranks do not exist any more.
    auto cands = from_.replicas(d.tensor, d.kind, d.global);
    std::erase_if(cands, [&](const StatePiece* c) { return lost(c->rank); });
    remaining_.assign(1, d.global);
    for (const StatePiece* c : cands) {
      if (P_.process_of_old_rank(c->rank) == q) take(d, *c);
    }
    for (const Box& r : remaining_) min_bytes += r.volume() * int64_t(sizeof(float));
    min_cross_host_bytes_ += cross_host_minimum(cands, q);
    while (!remaining_.empty()) {
      const StatePiece* best = best_remote_copy(cands, q);
      if (best == nullptr) throw_lost(d);
      const int u = P_.union_rank(P_.process_of_old_rank(best->rank));
      load_[size_t(u)] += take(d, *best) * int64_t(sizeof(float));
    }
  }

  std::vector<Transfer> transfers() && { return std::move(transfers_); }
  int64_t min_cross_host_bytes() const { return min_cross_host_bytes_; }

 private:
  bool lost(int old_rank) const { return P_.process_of_old_rank(old_rank) == TransferPlan::kLost; }

  // Moves what copy `c` holds of the boxes of `d` still missing into transfers, one per box it
  // meets, and leaves the rest missing; returns the elements taken.
  int64_t take(const StatePiece& d, const StatePiece& c) {
    int64_t taken = 0;
    next_.clear();
    for (const Box& r : remaining_) {
      const Box part = r.intersect(c.global);
      if (part.empty()) {
        next_.push_back(r);
        continue;
      }
      Transfer t;
      t.tensor = d.tensor;
      t.kind = d.kind;
      t.global = part;
      t.src_rank = c.rank;
      t.src_buffer = c.buffer;
      t.src = c.region(part);
      t.dst_rank = d.rank;
      t.dst_buffer = d.buffer;
      t.dst = d.region(part);
      t.src_process = P_.process_of_old_rank(c.rank);
      t.dst_process = P_.process_of_new_rank(d.rank);
      taken += part.volume();
      transfers_.push_back(std::move(t));
      subtract(r, part, next_);
    }
    remaining_.swap(next_);
    return taken;
  }

  // The bytes of what is still missing that no copy on the receiver's host holds: they must
  // cross hosts whatever the sources (the placement's bound, against which the chosen sources'
  // traffic is measured).
  int64_t cross_host_minimum(const std::vector<const StatePiece*>& cands, int q) const {
    std::vector<Box> missing = remaining_, next;
    const int hq = P_.host_of(q);
    for (const StatePiece* c : cands) {
      if (P_.host_of(P_.process_of_old_rank(c->rank)) != hq) continue;
      next.clear();
      for (const Box& r : missing) {
        const Box part = r.intersect(c->global);
        if (part.empty())
          next.push_back(r);
        else
          subtract(r, part, next);
      }
      missing.swap(next);
    }
    int64_t bytes = 0;
    for (const Box& r : missing) bytes += r.volume() * int64_t(sizeof(float));
    return bytes;
  }

  // Among the other processes' copies holding something still missing: one on the receiver's
  // host before one elsewhere (cross-host links are the slow ones), then the least-loaded sender
  // (so no sender becomes the bottleneck), then the lower old rank (so every process builds the
  // same plan). Null when no such copy exists.
  const StatePiece* best_remote_copy(const std::vector<const StatePiece*>& cands, int q) const {
    const int hq = P_.host_of(q);
    const StatePiece* best = nullptr;
    std::tuple<bool, int64_t, int> best_key;
    for (const StatePiece* c : cands) {
      const int p = P_.process_of_old_rank(c->rank);
      if (p == q) continue;
      const bool overlaps = std::any_of(remaining_.begin(), remaining_.end(), [&](const Box& r) {
        return !r.intersect(c->global).empty();
      });
      if (!overlaps) continue;
      const int u = P_.union_rank(p);
      const std::tuple<bool, int64_t, int> key{P_.host_of(p) != hq, load_[size_t(u)], c->rank};
      if (best == nullptr || key < best_key) {
        best = c;
        best_key = key;
      }
    }
    return best;
  }

  // Every copy of the first missing box of `d` was on a lost rank (or, for inconsistent layouts,
  // nowhere): the error says which, so the caller can decide to restore a checkpoint instead.
  [[noreturn]] void throw_lost(const StatePiece& d) const {
    const Box& missing = remaining_.front();
    std::vector<int> holders;
    for (const StatePiece* c : from_.replicas(d.tensor, d.kind, missing))
      if (lost(c->rank)) holders.push_back(c->rank);
    TESSEL_CHECK(holders.empty(), ConfigError,
                 "the state {} of '{}' ({}) that the new layout ({}) needs was lost: only "
                 "old rank(s) {} of the old layout ({}) held it and their state is not "
                 "available; restore it from a checkpoint (lost_state() lists all that was "
                 "lost)",
                 missing.str(), from_.spec()[size_t(d.tensor)].name,
                 layout::state_kind_name(d.kind), to_.plan().describe(), fmt::join(holders, ", "),
                 from_.plan().describe());
    TESSEL_THROW(ConfigError,
                 "the old layout ({}) holds no copy of {} of '{}' ({}) that the new layout "
                 "({}) needs",
                 from_.plan().describe(), missing.str(), from_.spec()[size_t(d.tensor)].name,
                 layout::state_kind_name(d.kind), to_.plan().describe());
  }

  const TransferPlan& P_;
  const StateLayout& from_;
  const StateLayout& to_;
  std::vector<int64_t> load_;          // bytes each process sends so far, by union rank
  std::vector<Box> remaining_, next_;  // what the current piece still misses
  std::vector<Transfer> transfers_;
  int64_t min_cross_host_bytes_ = 0;
};

// The transfers between processes grouped into one message per (sender, receiver) pair, ordered
// by the pair: the executor sends each message as one buffer, so a pair pays one latency.
// Transfers within a process are no message; their bytes go to local_copy_bytes.
std::vector<Message> group_into_messages(const std::vector<Transfer>& transfers,
                                         int64_t& local_copy_bytes) {
  std::map<std::pair<int, int>, Message> by_pair;
  for (size_t t = 0; t < transfers.size(); ++t) {
    const Transfer& tr = transfers[t];
    if (tr.src_process == tr.dst_process) {
      local_copy_bytes += tr.numel() * int64_t(sizeof(float));
      continue;
    }
    Message& m = by_pair[{tr.src_process, tr.dst_process}];
    m.src_process = tr.src_process;
    m.dst_process = tr.dst_process;
    m.transfers.push_back(int(t));
    m.numel += tr.numel();
  }
  std::vector<Message> messages;
  for (auto& [pair, m] : by_pair) messages.push_back(std::move(m));
  return messages;
}

// The traffic statistics of the messages (bytes moved, across hosts, the most one process sends
// and receives), which callers log and use to choose between plans.
void count_traffic(const TransferPlan& P, TransferStats& stats) {
  const size_t U = P.processes().size();
  std::vector<int64_t> sent(U, 0), received(U, 0);
  for (const Message& m : P.messages()) {
    stats.bytes_moved += m.bytes();
    if (P.host_of(m.src_process) != P.host_of(m.dst_process)) stats.bytes_cross_host += m.bytes();
    sent[size_t(P.union_rank(m.src_process))] += m.bytes();
    received[size_t(P.union_rank(m.dst_process))] += m.bytes();
  }
  stats.messages = int64_t(P.messages().size());
  for (size_t u = 0; u < U; ++u) {
    stats.max_send_bytes = std::max(stats.max_send_bytes, sent[u]);
    stats.max_recv_bytes = std::max(stats.max_recv_bytes, received[u]);
  }
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
  check_arguments(from, to, host_of_old_rank, host_of_new_rank, old_ids, new_ids);
  TransferPlan P;
  P.old_ids_ = old_ids;
  P.new_ids_ = new_ids;
  P.processes_ = union_of_processes(old_ids, new_ids);
  P.hosts_ = hosts_by_union_rank(P, host_of_old_rank, host_of_new_rank);
  P.old_sizes_ = buffer_sizes(from);
  P.new_sizes_ = buffer_sizes(to);
  P.kept_ = kept_buffers(P, from, to, P.stats_.kept_bytes);
  SourceChooser sources(P, from, to);
  for (const StatePiece* d : pieces_to_write(to, P.kept_, P.stats_.total_bytes))
    sources.write(*d, P.stats_.min_bytes);
  P.stats_.min_cross_host_bytes = sources.min_cross_host_bytes();
  P.transfers_ = std::move(sources).transfers();
  P.messages_ = group_into_messages(P.transfers_, P.stats_.local_copy_bytes);
  count_traffic(P, P.stats_);
  return P;
}

TransferPlan TransferPlan::part(const std::function<bool(const Transfer&)>& keep,
                                bool with_kept) const {
  TransferPlan P;
  P.processes_ = processes_;
  P.old_ids_ = old_ids_;
  P.new_ids_ = new_ids_;
  P.hosts_ = hosts_;
  P.old_sizes_ = old_sizes_;
  P.new_sizes_ = new_sizes_;
  P.kept_ = kept_;
  if (!with_kept)
    for (auto& buffers : P.kept_) std::fill(buffers.begin(), buffers.end(), -1);
  for (const Transfer& tr : transfers_)
    if (keep(tr)) P.transfers_.push_back(tr);
  P.stats_.min_bytes = stats_.min_bytes;
  P.stats_.min_cross_host_bytes = stats_.min_cross_host_bytes;
  P.stats_.kept_bytes = stats_.kept_bytes;
  P.stats_.total_bytes = stats_.total_bytes;
  P.messages_ = group_into_messages(P.transfers_, P.stats_.local_copy_bytes);
  count_traffic(P, P.stats_);
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
