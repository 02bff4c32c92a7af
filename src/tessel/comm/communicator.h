// A communicator for one process group, over Gloo's TCP transport, and shared memory between the
// ranks on one host (TransportOptions below, shm_transport.h).
//
// Every member of a group calls connect() with the same store options, group name and size and
// its own rank; after that the members call the same collectives in the same order with matching
// sizes (nothing can check this cheaply: mismatched sizes across ranks corrupt data, time out, or
// trip an assertion in Gloo's I/O thread that aborts the process).
//
// Threads. Point-to-point calls (send, recv, Request::wait/~Request) may come from several threads
// at once, provided the receives from one peer are posted and waited by one thread at a time.
// Collectives must not overlap anything else on the communicator, and neither must set_timeout.
// abort() may come from any thread at any time. A Request is used by one thread at a time (it may
// be moved to another). The pipeline's pattern: one thread per neighbour receives from it, while
// another thread sends to the neighbours and waits for its sends (also while receives run). A
// failure on one thread breaks the communicator for all: the waits blocked on other threads end at
// once with the same kind of error, and every thread's later calls throw the kind of the first
// failure.
//
// Gloo provides the transport (TCP pairs, unbound buffers); the rendezvous that connects a group's
// full mesh of pairs is tessel's (full_mesh.h: Gloo's protocol, but abortable), and the
// collectives are scheduled here on top of the pairs (ring reduce-scatter/all-gather/all-reduce,
// binomial-tree broadcast) so that every blocking wait can be reached by the watchdog described
// in comm_state.h. All of them work in place on the caller's memory, without staging copies.
//
// Failure contract. Every blocking call is bounded by a timeout: the communicator's (settable,
// default 60 s) or a per-call override; the timeout bounds the whole call. A call that fails
// throws
//   - TimeoutError   when this rank waited longer than its timeout, and
//   - PeerLostError  when a connection to a peer closed or reset (the peer died, or gave up
//                    after its own failure, or left),
// with a message naming the group, the operation, this rank and the peer when known. A lost
// peer is noticed within milliseconds even while no call runs (failure() reports it); it fails
// the running call if that call waits on the lost peer, and every later call. Any failure is
// fatal for the communicator: after a local timeout Gloo closes every connection of the context,
// and after any other failure this class does (and aborts its shared-memory channels), so peers
// blocked on this rank fail fast with PeerLostError instead of waiting out their own timeout. Later
// calls throw the same kind of error again. Recover by connecting new communicators under a new
// store generation.
//
// Aborting a generation. StoreOptions::abort_signal (abort_signal.h), when set, covers a
// communicator's whole life: firing it while connect() runs makes connect() throw PeerLostError
// (see connect), and firing it later breaks the communicator exactly as abort(reason) does. So a
// thread that learns the world is lost (the elastic runtime's control-store watcher) stops every
// group of the generation, connecting or connected, with one call.
//
// Process-wide side effect: connecting a group of size > 1 sets SIGPIPE to SIG_IGN when it still
// has its default action, because Gloo writes to sockets without MSG_NOSIGNAL and a write to a
// dead peer would otherwise kill this process instead of raising PeerLostError.
//
// Each connected group (size > 1) owns a Gloo device with its I/O thread and a watchdog thread,
// and, with shared memory, a sender thread per channel that once had to stream a message larger
// than the ring's free space.
// Size-1 groups never touch the network: collectives are no-ops or local copies. Zero-length
// buffers are accepted everywhere (null pointers are fine when the length is 0).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessel/comm/abort_signal.h"
#include "tessel/comm/store.h"

namespace gloo::transport {
class UnboundBuffer;
}

namespace tessel::comm {

inline constexpr std::chrono::milliseconds kDefaultTimeout{60000};

// Element types the sum collectives reduce.
template <typename T>
concept ReduceElement = std::same_as<T, float> || std::same_as<T, double> ||
    std::same_as<T, int32_t> || std::same_as<T, int64_t>;

// Element types the data-movement collectives move (the reducible ones plus raw bytes).
template <typename T>
concept Element = ReduceElement<T> || std::same_as<T, uint8_t>;

// Where this process listens for its peers. The default keeps everything on loopback (one host);
// multi-host jobs set `hostname` to an address the peers can reach, or `iface` to a network
// interface name (which wins when set).
//
// Shared memory: ranks of a group that run on the same host (same kernel, pid and network
// namespace) move point-to-point messages through shared-memory rings instead of TCP, and so do
// all_reduce_sum, reduce_scatter_sum, all_gather and all_gather_v when every rank of the group is
// on one host (shm_transport.h); broadcast, barrier and every pair on different hosts stay on
// TCP. Timeouts and error kinds are the same. Ranks decide together at connect: a pair uses it
// only when both have it on, and if any rank fails to set it up the whole group stays on TCP
// (with a warning). The environment variable TESSEL_SHARED_MEMORY=0 turns it off in a process
// whatever these options say.
struct TransportOptions {
  std::string hostname = "127.0.0.1";
  std::string iface;
  bool shared_memory = true;
  // Ring size of each channel (one per ordered pair of ranks on a host, fully allocated), in
  // [4096, 1 GiB] (else connect throws ConfigError).
  size_t shm_ring_bytes = size_t(1) << 20;
};

namespace detail {
struct CommState;
}

// A pending point-to-point transfer. wait() must be called before the buffer is reused or freed;
// destroying a Request that was not waited for waits for it (bounded by the communicator's
// timeout) and, if that fails, breaks the communicator instead of throwing. One thread at a time
// (see the threads paragraph at the top).
class Request {
 public:
  Request(Request&&) noexcept;
  Request& operator=(Request&&) noexcept;
  ~Request();

  // Blocks until the transfer completed. Throws TimeoutError / PeerLostError as described above.
  void wait();
  void wait(std::chrono::milliseconds timeout);
  bool completed() const { return done_; }

 private:
  friend class Communicator;
  Request(std::shared_ptr<detail::CommState> state, bool is_send, int peer, uint32_t tag,
          size_t bytes, std::unique_ptr<gloo::transport::UnboundBuffer> buffer);
  // A transfer through shared memory (shm_transport.h), identified by its ticket.
  Request(std::shared_ptr<detail::CommState> state, bool is_send, int peer, uint32_t tag,
          size_t bytes, uint64_t shm_ticket);
  void finish(std::chrono::milliseconds timeout);
  void abandon() noexcept;  // waits for an unfinished transfer, swallowing (but recording) errors

  std::shared_ptr<detail::CommState> state_;
  bool is_send_ = false;
  int peer_ = -1;
  uint32_t tag_ = 0;
  size_t bytes_ = 0;
  bool done_ = true;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  bool on_shm_ = false;
  uint64_t shm_ticket_ = 0;
};

class Communicator {
 public:
  using Timeout = std::optional<std::chrono::milliseconds>;  // nullopt: the communicator's

  // Joins group `group_name` as `rank` of `size` through the store described by `store`
  // (a directory or the control store, prefix store_prefix(store, group_name); see store.h).
  // Blocks until all `size` members are connected to each other (it ends with a barrier);
  // rendezvous is bounded by store.timeout (each wait for the store, each pair's TCP handshake,
  // the final barrier), and `timeout` becomes the communicator's default timeout for every later
  // call. Throws ConfigError for bad arguments or a (job, generation, group, rank) already
  // registered in the store, TimeoutError when peers do not show up in time, PeerLostError when
  // a peer disappears during the handshake.
  //
  // With store.secret set (store.h), only the job's processes take part: the control store's
  // rendezvous entries are signed, and right after the mesh connects every pair runs the pair
  // handshake (pair_handshake.h), within store.timeout, before the final barrier. Throws
  // MembershipError naming the group and the peer (its rank, and its address once known) when a
  // peer's entry or its proof was made without the secret; with another secret every rank fails
  // so, after the exchange, none waits for the others. A peer without any secret never answers
  // the handshake: TimeoutError at store.timeout, saying so.
  //
  // With store.abort_signal set: when the signal has fired before the call, or fires during it
  // (another thread calls abort), connect throws PeerLostError "connect on group '<g>' (rank r of
  // n) failed: rendezvous aborted by this process: <reason>" within a fraction of a second,
  // whatever it was waiting for: the store (polled, or waited on in slices of
  // kAbortableWaitSlice, control_rendezvous.h), a peer's TCP handshake (closed after
  // kHandshakeGrace, full_mesh.h, during which abort() waits), the final barrier. The connections
  // it had are closed as it unwinds, so peers connecting with this rank fail fast too. A signal
  // firing just as connect completes may instead leave the returned communicator broken as by
  // abort(reason): its next call throws PeerLostError. Once connected, the communicator stays
  // registered with the signal until it is destroyed.
  static std::unique_ptr<Communicator> connect(const StoreOptions& store,
                                               const std::string& group_name, int rank, int size,
                                               std::chrono::milliseconds timeout = kDefaultTimeout,
                                               const TransportOptions& transport = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  const std::string& name() const;
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);  // > 0
  // The error that broke this communicator, empty while it is healthy.
  std::string failure() const;
  // Whether messages with `peer` go through shared memory (TransportOptions::shared_memory), and
  // whether the collectives that can do so do (every other rank shares memory with this one).
  bool shares_memory_with(int peer) const;
  bool collectives_share_memory() const;

  // Breaks this communicator on purpose, e.g. because another communicator of this process lost
  // a peer and the whole process must drop out of the step at once. Safe to call from any thread,
  // also while another thread is inside a call or a Request wait on this communicator:
  //   - a wait running on another thread returns at once and its call throws PeerLostError;
  //   - every later call, and every later Request::wait() or Request destruction, throws (or, for
  //     the destructor, records) PeerLostError at once, without waiting; the message names the
  //     group and operation as usual and "aborted by this process: <reason>";
  //   - every connection is closed, so peers with pending or later operations with this rank fail
  //     fast with PeerLostError instead of waiting out their timeout (they see a reset connection;
  //     `reason` stays local).
  // Precedence: when the communicator had already failed (a timeout, a lost peer), later calls
  // keep reporting that first failure. Size-1 groups have no connections, but are broken all the
  // same: their later calls throw PeerLostError too, so every group of an aborted process behaves
  // alike. Idempotent (the first reason is kept); never throws. The Communicator must outlive the
  // call (do not race it with the destructor). Firing the StoreOptions::abort_signal it was
  // connected with calls this (the destructor unregisters first, so that one may race).
  void abort(const std::string& reason) noexcept;

  // In place: every rank ends with the element-wise sum over ranks of data[0, n). Ring
  // reduce-scatter then ring all-gather on `data` (the algorithm of Gloo's ring all-reduce): each
  // rank sends and receives 2(size-1)/size of the buffer.
  template <ReduceElement T>
  void all_reduce_sum(T* data, size_t n, Timeout timeout = {});

  // In-place reduce-scatter. `counts` (same on every rank, one entry per rank) splits data into
  // consecutive chunks; chunk r starts at offset counts[0] + ... + counts[r-1]. On return, chunk
  // `rank()` of data holds the element-wise sum over ranks of that chunk, AT ITS OWN OFFSET;
  // the other chunks of data hold unspecified partial sums. A ring algorithm: each rank sends and
  // receives (size-1)/size of the buffer.
  template <ReduceElement T>
  void reduce_scatter_sum(T* data, const std::vector<size_t>& counts, Timeout timeout = {});

  // out[r*n, (r+1)*n) = rank r's `mine` (n elements), for every r. `mine` may alias
  // out + rank()*n (in place); otherwise the ranges must not overlap.
  template <Element T>
  void all_gather(const T* mine, size_t n, T* out, Timeout timeout = {});

  // Uneven all-gather: rank r contributes counts[r] elements (counts same on every rank), placed
  // at offset counts[0] + ... + counts[r-1] of `out`. `mine` may alias its own slot of `out`.
  template <Element T>
  void all_gather_v(const T* mine, const std::vector<size_t>& counts, T* out, Timeout timeout = {});

  // data[0, n) of rank `root` is copied into data on every rank.
  template <Element T>
  void broadcast(T* data, size_t n, int root, Timeout timeout = {});
  void broadcast_bytes(void* data, size_t bytes, int root, Timeout timeout = {});

  // Returns once every rank has entered the barrier.
  void barrier(Timeout timeout = {});

  // Asynchronous point-to-point transfer of `bytes` bytes with `peer` (!= rank()). A send with
  // tag t matches the receive with tag t posted by the peer; several transfers with the same
  // (peer, tag) match in posting order. Sizes must agree on both sides. The buffer must stay
  // valid until the Request was waited for. Tags are separate from the collectives' traffic.
  Request send(const void* data, size_t bytes, int peer, uint32_t tag);
  Request recv(void* data, size_t bytes, int peer, uint32_t tag);

 private:
  explicit Communicator(std::shared_ptr<detail::CommState> state);
  // Makes `signal` (if any) abort this communicator from now on; at once if it has fired.
  void follow(const std::shared_ptr<AbortSignal>& signal);

  std::shared_ptr<detail::CommState> state_;
  // Destroyed before state_: a callback running on another thread is waited for.
  AbortSignal::Registration abort_registration_;
};

// Splits n elements into `parts` chunks whose sizes differ by at most one (the first n % parts
// chunks get the extra element). Throws InvalidArgumentError when parts < 1.
std::vector<size_t> even_counts(size_t n, int parts);

}  // namespace tessel::comm
