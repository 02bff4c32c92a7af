// TransferPlan: how to turn the training state laid out by one StateLayout into another.
//
// Processes. A transition involves *processes*, each with an integer id: old rank i of layout
// `from` is process old_ids[i], new rank j of `to` is process new_ids[j]. A process in both lists
// survives (it keeps its old buffers until the transition ends); one only in old_ids leaves (it
// only sends), one only in new_ids joins (it only receives). Each process runs on a host; hosts
// are integers too, and a surviving process must keep its host.
//
// Lost state. After a failure some old ranks' buffers are gone (the process died, or its state
// is not valid): old_ids[i] == TransferPlan::kLost says so. A lost old rank is no process of the
// transition and never a source; its host entry is ignored. The plan then takes every element
// from the surviving copies (dp replicas, tp-replicated tensors, tied copies); when some element
// has none, build() throws ConfigError saying the state was lost, and lost_state() below lists
// all of it (e.g. to decide between resharding and restoring a checkpoint before building).
// A process may be alive yet have lost its old rank's state: give kLost for that rank and the
// process's id only among the new ones -- it then joins (receives all it needs).
//
// What the plan guarantees (the property tests check all of it element by element):
//   - every element of every new buffer is written exactly once, from an old copy of the same
//     (tensor, kind, element) -- so A -> B reproduces exactly the state B would hold;
//   - a process never receives an element it already holds (in any old buffer): such data is a
//     local copy, or nothing at all when a whole new buffer is laid out exactly like one of the
//     process's old buffers (kept_from: the runtime may keep that buffer as it is);
//   - so the bytes sent between processes are the least any exact plan moves: the elements each
//     new process needs and does not hold, once each.
// Sources. For each new piece (largest first), the old copies are tried in order: the same
// process (all of its copies), then copies on the same host, then the rest; within a tier the
// least-loaded sender (bytes it sends so far) goes first, ties to the lower old rank. Each copy
// takes what it holds of what is still missing. Building is deterministic: every process builds
// the same plan from the same arguments.
// Messages. All transfers from one process to another travel as ONE message: the transfers'
// boxes packed back to back in transfer order (Message::transfers), float32 row-major.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tessel/layout/state_layout.h"
#include "tessel/tensor/strided_region.h"

namespace tessel::reshard {

using layout::StateKind;

// One box of one tensor's state, copied from an old buffer to a new one.
struct Transfer {
  int tensor = 0;  // index into the model spec
  StateKind kind = StateKind::param;
  Box global;                        // the box of the tensor
  int src_rank = 0, src_buffer = 0;  // old rank and its buffer
  StridedRegion src;
  int dst_rank = 0, dst_buffer = 0;  // new rank and its buffer
  StridedRegion dst;
  int src_process = 0, dst_process = 0;

  int64_t numel() const { return global.volume(); }
};

// Everything one process sends to another (src != dst).
struct Message {
  int src_process = 0, dst_process = 0;
  std::vector<int> transfers;  // indices into TransferPlan::transfers(), in packing order
  int64_t numel = 0;           // floats
  int64_t bytes() const { return numel * int64_t(sizeof(float)); }
};

struct TransferStats {
  int64_t bytes_moved = 0;           // between processes (sum of message sizes)
  int64_t bytes_cross_host = 0;      // part of bytes_moved between different hosts
  int64_t max_send_bytes = 0;        // most bytes one process sends
  int64_t max_recv_bytes = 0;        // most bytes one process receives
  int64_t min_bytes = 0;             // the bytes new processes need but do not hold (lower bound)
  int64_t min_cross_host_bytes = 0;  // of those, what no copy on the receiver's host holds
  int64_t local_copy_bytes = 0;      // copied within a process between different places
  int64_t kept_bytes = 0;            // in buffers a process keeps unchanged
  int64_t total_bytes = 0;           // the new layout's state, all ranks together
  int64_t messages = 0;
};

class TransferPlan {
 public:
  // old_ids[i] == kLost: old rank i's state is not available (see "Lost state" above).
  static constexpr int kLost = -1;

  // Throws ConfigError when the layouts describe different models, `to` holds a kind `from`
  // lacks, a list has the wrong length, process or host ids are negative (old ids may be kLost;
  // a lost rank's host is not looked at), process ids repeat within a list, a surviving process
  // changes host, or an element `to` needs has no copy on an old rank that is not lost (the
  // message names the tensor, kind, box and the lost old ranks that held it).
  static TransferPlan build(const layout::StateLayout& from, const layout::StateLayout& to,
                            const std::vector<int>& host_of_old_rank,
                            const std::vector<int>& host_of_new_rank,
                            const std::vector<int>& old_ids, const std::vector<int>& new_ids);
  // Same processes: old rank i and new rank i are process i (the world may grow or shrink).
  static TransferPlan build(const layout::StateLayout& from, const layout::StateLayout& to,
                            const std::vector<int>& host_of_old_rank,
                            const std::vector<int>& host_of_new_rank);

  // Every process of the transition, ascending: the members of the union world (executor.h);
  // process processes()[u] is rank u of that world. Lost old ranks contribute none.
  const std::vector<int>& processes() const { return processes_; }
  // Rank of `process` in the union world; throws InvalidArgumentError for a stranger.
  int union_rank(int process) const;
  // The process's old / new rank, -1 when it has none (joining / leaving; a process whose old
  // rank was lost has none).
  int old_rank_of(int process) const;
  int new_rank_of(int process) const;
  // kLost for a lost old rank.
  int process_of_old_rank(int rank) const { return old_ids_.at(size_t(rank)); }
  int process_of_new_rank(int rank) const { return new_ids_.at(size_t(rank)); }
  int old_world() const { return int(old_ids_.size()); }
  // The host of a process of the transition; throws InvalidArgumentError for a stranger.
  int host_of(int process) const { return hosts_[size_t(union_rank(process))]; }
  int new_world() const { return int(new_ids_.size()); }

  // Buffer sizes (floats) per old / new rank, as the layouts say (lost old ranks included).
  const std::vector<int64_t>& old_buffer_sizes(int old_rank) const;
  const std::vector<int64_t>& new_buffer_sizes(int new_rank) const;

  const std::vector<Transfer>& transfers() const { return transfers_; }
  // Ordered by (src_process, dst_process).
  const std::vector<Message>& messages() const { return messages_; }
  // The transfers within `process` (old buffer -> new buffer), in order.
  std::vector<int> local_transfers(int process) const;
  // For new rank j's buffer b: the old buffer of the same process holding exactly its contents
  // in exactly its layout (no transfer writes that buffer), or -1.
  int kept_from(int new_rank, int buffer) const;

  const TransferStats& stats() const { return stats_; }

  // The part of this plan made of the transfers `keep` accepts (same processes and buffers;
  // messages regrouped, traffic recounted, min_bytes and kept_bytes as the whole plan's). Without
  // `with_kept`, no buffer counts as kept, so executing the part copies none: parts that run one
  // after the other (a live switch moves the optimizer state after the parameters) copy the
  // kept buffers once.
  TransferPlan part(const std::function<bool(const Transfer&)>& keep, bool with_kept) const;

 private:
  std::vector<int> processes_, old_ids_, new_ids_;
  std::vector<int> hosts_;  // by union rank
  std::vector<std::vector<int64_t>> old_sizes_, new_sizes_;
  std::vector<std::vector<int>> kept_;  // [new rank][buffer]
  std::vector<Transfer> transfers_;
  std::vector<Message> messages_;
  TransferStats stats_;
};

// A part of the state of an old layout that no available old rank holds.
struct LostPiece {
  int tensor = 0;  // index into the layout's spec
  StateKind kind = StateKind::param;
  Box box;
  bool operator==(const LostPiece&) const = default;
};

// The parts of the state of `from` held only by old ranks that are not available (available[r]
// false), as disjoint boxes per (tensor, kind), ordered by tensor then kind (all kinds of
// `from`). Empty when every element has a surviving copy: a TransferPlan from `from` with those
// ranks lost then builds for any `to` (same model, kinds `from` has); otherwise it throws for
// every `to` holding a kind listed here (a layout holds every element of its kinds). Throws
// InvalidArgumentError when `available` does not have one entry per rank of `from`.
std::vector<LostPiece> lost_state(const layout::StateLayout& from,
                                  const std::vector<bool>& available);

// A one-line summary for logs and errors: "3 pieces, 1.2 MB: <tensor> (adam_m) [0:64, 0:192],
// ... and 1 more" -- at most `max_items` pieces named; "nothing" for an empty list. `layout`
// names the tensors (any layout of the same model).
std::string describe(const std::vector<LostPiece>& lost, const layout::StateLayout& layout,
                     size_t max_items = 4);

}  // namespace tessel::reshard
