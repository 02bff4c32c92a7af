// Internal: the Communicator's shared-memory transport between the ranks of a group that run on
// the same host (Gloo has none; TCP stays for the other pairs).
//
// Built at the end of Communicator::connect, over the group's connected Gloo mesh: every rank
// publishes its host identity (shm_host_id) with an all-gather; every two ranks with the same
// identity, both with TransportOptions::shared_memory on, get a pair of ShmChannels (one each
// way, shm_channel.h), created by their senders, named to the receivers by an all-gather_v, and
// opened; a last all-gather tells everyone whether every rank managed, and if one did not the
// whole group keeps to TCP (a warning says why), so the ranks always agree on the transport.
//
// On the channels, messages are framed: 16 bytes (slot, byte count), the payload, zero padding
// to 8 bytes, so every payload starts aligned for the reductions that read it in place. The slot
// is the Gloo slot the TCP path would use (comm_state.h's prefixes and tags), so point-to-point
// messages match receives by (peer, tag) in posting order exactly as there, and a collective's
// messages never match a point-to-point receive.
//
// Progress. Sends never block the caller beyond copying into a ring with room: a message that
// fits the free space is copied at once (the caller's Request is then already complete), a
// larger one is queued to the channel's sender thread (one per outgoing channel, started on the
// first such message), which streams it while the receiver drains it. The caller's own thread
// receives: a receive is matched when the caller waits for it (or for a collective's message
// from that peer, or for a send while receives are posted), in stream order; a message nobody
// has posted a receive for yet is copied aside ("stashed") and handed to the receive posted
// later. So two ranks that wait for their sends to each other, each with the receive posted, do
// not deadlock on full rings. Steady state allocates nothing: the queues reuse their storage,
// and nothing is stashed when receives are posted before the peer's messages arrive.
//
// Threads (communicator.h's contract): point-to-point calls may come from several threads at
// once, the receives from one peer from one thread at a time; collectives from one thread with
// nothing else running. Each incoming channel has a mutex held by whoever reads it or touches its
// posted receives and stash: the thread posting or waiting for a receive from that peer, or a
// thread waiting for a send, which pumps the channels with posted receives (pump_ready) but skips
// a channel whose mutex another thread holds (that thread is reading it, so the ring drains, and
// a send wait never blocks behind a receive wait). Each outgoing channel has its own mutex
// (Outgoing::mu), so sends, send waits and the sender thread go on beside the receives.
//
// Failures: the channels' TimeoutError and PeerLostError (a dead peer is noticed from its pid
// within ShmChannel::kLivenessSlice, an aborted one at once) propagate to the Communicator,
// which breaks itself as for any failure; abort() (from CommState::abort / close_connections,
// any thread) aborts every channel, so peers blocked on this rank fail at once too. Before an
// unfinished send's Request is given up, release_send() makes sure the sender thread no longer
// reads the caller's buffer.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/shm_channel.h"

namespace tessel::comm {
class Communicator;
struct TransportOptions;
}  // namespace tessel::comm

namespace tessel::comm::detail {

// What two processes must share for a ShmChannel to connect them: the kernel instance
// (boot_id), the pid namespace (the opener finds the creator in /proc) and the network namespace
// (processes in different network namespaces are different hosts to the rest of tessel, e.g. the
// multi-host tests), plus the hostname. Empty when it cannot be determined (then no shared memory).
std::string shm_host_id();

// A FIFO over a vector that keeps its storage: no allocation once it has grown to its peak.
template <typename T>
class ReusedQueue {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return items_[head_]; }
  T& operator[](size_t i) { return items_[(head_ + i) % items_.size()]; }
  void push_back(const T& v) {
    if (size_ == items_.size()) grow();
    items_[(head_ + size_) % items_.size()] = v;
    ++size_;
  }
  void pop_front() {
    head_ = (head_ + 1) % items_.size();
    --size_;
  }
  void clear() { head_ = size_ = 0; }

 private:
  void grow() {
    std::vector<T> bigger(std::max<size_t>(8, items_.size() * 2));
    for (size_t i = 0; i < size_; ++i) bigger[i] = (*this)[i];
    items_.swap(bigger);
    head_ = 0;
  }
  std::vector<T> items_;
  size_t head_ = 0;
  size_t size_ = 0;
};

class ShmTransport {
 public:
  using Clock = std::chrono::steady_clock;

  // Runs the exchange described above on `comm` (whose collectives must still go over Gloo:
  // call it before the transport is attached). Every rank of the group calls it. Returns null
  // when no two ranks share a host with shared memory on, or some rank failed to set it up.
  // Throws what comm's collectives throw.
  static std::unique_ptr<ShmTransport> connect(Communicator& comm, const TransportOptions& options,
                                               std::chrono::milliseconds timeout);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Whether messages with `peer` go through shared memory.
  bool reaches(int peer) const {
    return peer >= 0 && size_t(peer) < incoming_.size() && incoming_[size_t(peer)] != nullptr;
  }
  // Whether every other rank of the group does (collectives then run here entirely).
  bool reaches_all() const { return reaches_all_; }
  // Ring bytes per channel, for messages.
  size_t ring_bytes() const { return ring_bytes_; }

  // Point-to-point. post_* return a ticket for wait_*/release_send. post_send throws
  // PeerLostError when the channel is already broken; post_recv when the stashed message for it
  // has another size (InvalidArgumentError).
  uint64_t post_send(int peer, uint64_t slot, const void* data, size_t bytes);
  uint64_t post_recv(int peer, uint64_t slot, void* data, size_t bytes);
  bool send_done(int peer, uint64_t ticket);
  void wait_send(int peer, uint64_t ticket, Clock::time_point deadline);
  void wait_recv(int peer, uint64_t ticket, Clock::time_point deadline);
  // Returns once the sender thread no longer touches the buffer of send `ticket`: at once when it
  // completed, else after aborting the transport (the caller gives the send up). Never throws.
  void release_send(int peer, uint64_t ticket) noexcept;

  // A collective's receive from `peer`: the message with `slot`, of `bytes` bytes, handed to
  // `consume` in spans of whole `granule`s, in place in the ring.
  void recv_with(int peer, uint64_t slot, size_t bytes, size_t granule, Clock::time_point deadline,
                 FunctionRef<void(const std::byte*, size_t)> consume);

  // The Communicator's ring schedules (communicator.cpp) over the channels, for groups whose
  // ranks all share memory (reaches_all()). Reduce-scatter: the same chunks in the same order,
  // each received chunk added into place as it streams out of the ring (dst = dst + incoming, the
  // TCP path's arithmetic, so the results are bit-identical to it) while the channel's sender
  // thread streams this rank's next chunk. All-gather: received chunks copied straight into
  // place. `counts` / `bytes` are per rank; empty chunks are not sent.
  template <typename T>
  void ring_reduce_scatter(T* data, const std::vector<size_t>& counts, uint64_t slot,
                           Clock::time_point deadline);
  void ring_all_gather(void* data, const std::vector<size_t>& bytes, uint64_t slot,
                       Clock::time_point deadline);

  // Breaks every channel (see the header comment). Any thread; idempotent; never throws.
  void abort(const std::string& reason) noexcept;

 private:
  struct SendOp {
    uint64_t slot = 0;
    const std::byte* data = nullptr;
    size_t bytes = 0;
  };
  struct Outgoing {
    std::unique_ptr<ShmChannel> ch;
    std::mutex mu;  // guards everything below
    std::condition_variable cv;
    ReusedQueue<SendOp> queue;  // front: being written by the thread
    uint64_t posted = 0;        // tickets handed out
    uint64_t completed = 0;     // sends whose bytes are all in the ring (they finish in order)
    uint64_t retired = 0;       // sends whose buffer is no longer read (completed or dropped)
    std::string error;          // the sender thread's failure
    bool timed_out = false;     // ... which was a TimeoutError
    bool aborted = false;
    bool stop = false;
    std::thread thread;
  };
  struct PostedRecv {
    uint64_t ticket = 0;
    uint64_t slot = 0;
    std::byte* data = nullptr;
    size_t bytes = 0;
    bool done = false;
  };
  struct Stashed {
    uint64_t slot = 0;
    std::vector<std::byte> bytes;
  };
  struct Incoming {
    std::unique_ptr<ShmChannel> ch;  // the reading side: under mu (abort() excepted)
    std::mutex mu;                   // guards the reading side of ch and everything below
    ReusedQueue<PostedRecv> posted;  // by ticket; front: the oldest not yet known done
    uint64_t next_ticket = 0;
    std::deque<Stashed> stash;
  };
  struct CollectiveTarget {
    uint64_t slot;
    size_t bytes;
    size_t granule;
    FunctionRef<void(const std::byte*, size_t)> consume;
  };

  ShmTransport(int rank, int size, size_t ring_bytes, std::string group);
  void run_sender(Outgoing& out);
  void write_frame(ShmChannel& ch, const SendOp& op, Clock::time_point deadline);
  // Reads the next message from `in` and delivers it (the target, a posted receive, or the
  // stash). Returns whether it was the target. The caller holds in.mu.
  bool pump(int peer, Incoming& in, Clock::time_point deadline, CollectiveTarget* target);
  // Pumps every incoming channel that has a message waiting and a receive posted, skipping those
  // another thread holds. Returns whether it delivered anything.
  bool pump_ready(Clock::time_point deadline);
  std::string abort_reason();

  int rank_;
  int size_;
  size_t ring_bytes_;
  std::string group_;
  bool reaches_all_ = false;
  std::vector<std::unique_ptr<Outgoing>> outgoing_;  // by peer rank; null: not on this host
  std::vector<std::unique_ptr<Incoming>> incoming_;
  // Receives posted and not yet known done, over every peer: a send wait pumps while any are.
  std::atomic<size_t> posted_recvs_{0};

  std::mutex abort_mu_;  // guards abort_reason_
  std::string abort_reason_;
};

}  // namespace tessel::comm::detail
