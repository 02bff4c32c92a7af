// Executing a TransferPlan: moving the training state from the old layout to the new one.
//
// The transition world. Resharding needs every process that holds old state or will hold new
// state, leaving and joining ones included, in ONE communicator: the union world. Its members
// are TransferPlan::processes() (ascending process ids); process processes()[u] is its rank u.
// It is formed in the NEW generation's store (StoreOptions::generation = the new world's
// generation) under the group name kTransitionGroup, by every member calling
// connect_transition_world with the same plan -- leaving processes take part in the new
// generation only for this. After execute() the union world may be dropped; the new world's own
// process groups (over the new ranks) are formed separately.
//
// execute() on each member, all at once:
//   0. agrees whether same-host messages are read directly from the sender (ExecuteOptions),
//   1. posts a receive for every other message addressed to it (TransferPlan::messages()),
//   2. packs and sends every message it owes (one per receiving peer, boxes back to back),
//   3. meanwhile does its local transfers (old buffer -> new buffer within the process) and
//      copies kept buffers (none when the caller passes the old buffer itself as the new one),
//   4. reads its direct messages, waits for and unpacks its receives, then waits for its sends,
//   5. ends with a barrier of the union world, so nobody (a leaving process in particular) goes
//      away while a peer may still need its connection.
// Every wait is bounded by the communicator's timeout: a dead or hung peer surfaces as
// PeerLostError / TimeoutError (communicator.h), never a hang. A failure leaves the new buffers
// partly written; the caller must treat the transition as failed (the old buffers are intact).
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/layout/training_state.h"
#include "tessel/reshard/transfer_plan.h"

namespace tessel::reshard {

inline constexpr const char* kTransitionGroup = "reshard";
inline constexpr uint32_t kReshardTag = 0x52534844;  // "RSHD"

// Joins the union world of `plan` as `process`. `store.generation` must be the new
// generation. Throws like Communicator::connect, and InvalidArgumentError when `process` takes
// no part in the plan.
std::unique_ptr<comm::Communicator> connect_transition_world(
    const comm::StoreOptions& store, const TransferPlan& plan, int process,
    std::chrono::milliseconds timeout = comm::kDefaultTimeout,
    const comm::TransportOptions& transport = {});

// More communicators of the same union world, "lanes" (named kTransitionGroup + ".lane<k>",
// k = 1..lanes): each is a TCP connection per pair with its own transport thread, so a large move
// between two hosts runs on several streams -- one stream is bound by one core (measured between
// two network namespaces of a 2-core VM: 2.1 GiB/s on one stream, 4.7 on two). Collective over
// the plan's processes, like connect_transition_world; every one must ask for as many.
std::vector<std::unique_ptr<comm::Communicator>> connect_transition_lanes(
    const comm::StoreOptions& store, const TransferPlan& plan, int process, int lanes,
    std::chrono::milliseconds timeout = comm::kDefaultTimeout,
    const comm::TransportOptions& transport = {});

// Buffers of one process: its old rank's buffers (empty for a joining process, and for one whose
// old rank is lost: it has none in the plan) and its new
// rank's (empty for a leaving one), as many and as large as the plan's buffer sizes (a buffer may
// be longer). New buffers must not overlap old ones, except that a new buffer the plan keeps
// (kept_from) may BE its old buffer (same data pointer and size): it is then left alone.
struct ProcessBuffers {
  std::vector<std::span<const float>> old_buffers;
  std::vector<std::span<float>> new_buffers;
};

struct ExecuteOptions {
  // Within a host, a receiver copies its messages straight out of the sender's buffers (Linux
  // cross-memory attach, process_vm_readv: one copy, no socket buffers, no staging) instead of
  // over the network. Used only when every receiver can read every same-host sender it needs
  // (probed at the start, agreed in a collective); otherwise everything goes over the network.
  // Every process of a transition must pass the same value.
  bool same_host_direct = true;
  // Lanes of the union world (connect_transition_lanes): a network message's large contiguous
  // transfers are spread over the world and its lanes, balanced by bytes, so each pair of
  // processes moves on 1 + lanes.size() streams. Every process must pass as many.
  std::vector<comm::Communicator*> lanes;
};

// Runs the plan's part of `process` over the union world `world` (see above). Throws
// InvalidArgumentError when the world or the buffers do not match the plan, and the
// communicator's TimeoutError / PeerLostError when a peer fails (PeerLostError also when a
// sender being read directly vanishes).
struct ExecuteStats {
  int64_t bytes_read_directly = 0;  // by this process, out of same-host senders' memory
  int64_t bytes_received = 0;       // by this process, over the network
};
ExecuteStats execute(const TransferPlan& plan, int process, comm::Communicator& world,
                     const ProcessBuffers& buffers, const ExecuteOptions& options = {});

// The replicated scalar state for every member of the union world: the process of the lowest
// old rank that is not lost (TransferPlan::kLost) broadcasts its `mine` (which must then be
// non-null); the others' `mine` is ignored. Collective over `world`. Throws InvalidArgumentError
// (on every member, before communicating) when every old rank is lost: nobody holds the scalar
// state then, and the caller must provide it (e.g. from a checkpoint).
layout::ScalarState share_scalar_state(const TransferPlan& plan, int process,
                                       comm::Communicator& world, const layout::ScalarState* mine);

// The same movement without a network, for tests and single-process tools: buffers indexed by
// old / new rank (a lost old rank's entry is not looked at: it may be empty). Packs and unpacks
// every message exactly as execute() does.
void execute_in_memory(const TransferPlan& plan,
                       const std::vector<std::vector<std::span<const float>>>& old_by_rank,
                       const std::vector<std::vector<std::span<float>>>& new_by_rank);

// The building blocks: a message's floats packed from the sender's old buffers (m.numel floats
// into `out`), and unpacked into the receiver's new buffers.
void pack_message(const TransferPlan& plan, const Message& m,
                  const std::vector<std::span<const float>>& old_buffers, float* out);
void unpack_message(const TransferPlan& plan, const Message& m, const float* in,
                    const std::vector<std::span<float>>& new_buffers);

}  // namespace tessel::reshard
