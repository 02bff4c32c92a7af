// Internal: the state a Communicator shares with its Requests, Gloo error mapping, the blocking
// waits every operation goes through, and the watchdog that turns a lost peer into a prompt
// PeerLostError.
//
// Why a watchdog. Gloo's TCP pairs notice a dead peer (EOF or reset on the socket) and wake the
// operations queued on that pair, but not an operation whose bytes are already moving: a send
// whose data sits half-written in the pair's transmit queue, or a receive the I/O thread has
// started reading into. A rank waiting on such a transfer sleeps until its timeout although the
// peer is long gone (reproduced with Debian's Gloo: a SIGKILLed peer left its partner waiting
// the full timeout, in both directions). So:
//   - every wait goes through wait_recv()/wait_send() below, which register which peers the wait
//     depends on (that is why tessel runs its own ring/tree schedules on Gloo's unbound buffers
//     instead of calling Gloo's collectives, whose internal waits cannot be reached);
//   - the watchdog keeps one never-satisfied receive ("sentinel") posted on every pair, which
//     Gloo does wake when the pair fails; it polls them, and when a peer a registered wait
//     depends on has failed and the wait is still blocked after a short grace period, it aborts
//     the wait.
// The grace period lets a transfer that completed just before the peer went away (a peer that
// finished the last collective and exited) be consumed normally instead of being aborted.
// A peer loss never fails an operation that does not depend on that peer; it fails the next
// operation at its start, and the failing rank closes its connections so the peers that were
// waiting on it fail in turn.
//
// Threads (communicator.h's contract): point-to-point calls and Request waits may run on several
// threads at once, collectives never overlap anything else. So every field a wait or a failure
// touches is shared: mu_ guards the verdict, the aborted flag, the recorded failure
// (failure_kind_/failure_: the first one recorded wins, every later call on any thread rethrows its
// kind) and the set of registered waits, one per waiting thread. The watchdog aborts each wait
// that depends on a failed peer once the grace period is over; abort() (Communicator::abort, or
// the callback a StoreOptions::abort_signal runs on the thread that fires it) aborts every
// registered wait and then closes the connections, which Gloo serializes per pair; the first
// failure fail() records does the same (closing a pair does not wake this rank's own waits on it,
// so another thread's wait would otherwise sleep until its timeout). A wait registered after the
// abort or failure throws at once, a wait registered before it is aborted, so no wait of any
// thread blocks after either. Only the collectives' fields (next_tag, scratch) and `timeout`
// (set_timeout) stay unguarded: the contract keeps collectives and set_timeout apart from every
// other call.
#pragma once

#include <gloo/common/error.h>
#include <gloo/common/logging.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/comm/shm_transport.h"

namespace gloo {
class Context;
}
namespace gloo::transport {
class Device;
}

namespace tessel::comm::detail {

enum class FailureKind { kNone, kTimeout, kPeerLost, kOther };

// Slot prefixes for the traffic tessel schedules itself (top byte of a 64-bit slot, tag in bits
// 24-55, the layout of gloo::Slot::build); Gloo's collectives use 0x01-0x08.
inline constexpr uint8_t kReduceScatterSlotPrefix = 0x21;
inline constexpr uint8_t kPointToPointSlotPrefix = 0x22;
inline constexpr uint8_t kSentinelSlotPrefix = 0x23;
inline constexpr uint8_t kAllGatherSlotPrefix = 0x24;
inline constexpr uint8_t kBroadcastSlotPrefix = 0x25;
inline constexpr uint8_t kHandshakeSlotPrefix = 0x26;  // pair_handshake.h
inline uint64_t make_slot(uint8_t prefix, uint32_t tag) {
  return (uint64_t(prefix) << 56) | (uint64_t(tag) << 24);
}

using Clock = std::chrono::steady_clock;

struct CommState {
  std::string name;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout = kDefaultTimeout;
  std::shared_ptr<gloo::transport::Device> device;  // null for size-1 groups
  std::shared_ptr<gloo::Context> context;           // null for size-1 groups
  uint32_t next_tag = 0;               // collectives issued so far (the same on every rank)
  std::vector<unsigned char> scratch;  // reduce-scatter receive segments
  // The shared-memory channels to the peers on this host (null: none); set once by connect
  // through attach_shm (before any other thread can use the communicator), used by the calling
  // threads, aborted with the connections.
  std::unique_ptr<ShmTransport> shm;

  // True while Communicator::connect runs its final barrier: until everyone passed it, a peer's
  // I/O thread may not have taken in its end of every connection yet, and Gloo crashes that peer
  // when such a connection is reset (full_mesh.h). So meanwhile fail() and abort() leave the
  // connections open (abort() still ends the wait and every later one); a connect that fails
  // then releases them gracefully as it unwinds, and one that succeeds calls settled().
  std::atomic<bool> mesh_settling{false};
  // Ends mesh_settling, and closes the connections if abort() ran meanwhile (after the abort,
  // peers must still learn of it at once).
  void settled();

  ~CommState();

  // Posts the sentinels and starts the watchdog; called once the context is connected.
  void start_watchdog();

  // Installs the shared-memory transport (aborted at once when abort() already ran).
  void attach_shm(std::unique_ptr<ShmTransport> transport);

  // The message of the first failure fail() recorded, empty while none was (any thread).
  std::string recorded_failure();

  // "<op> on group '<name>' (rank r of n[, peer rank p])".
  std::string where(const char* op, int peer) const;

  // Throws if this communicator is broken: the kind of its earlier failure, or PeerLostError
  // when the watchdog saw a peer's connection fail since, or abort() ran (which also breaks it).
  void ensure_healthy(const char* op);

  // Records the failure, closes every connection (not while mesh_settling) so peers blocked on
  // this rank fail fast, and throws the matching tessel error. Unless this rank timed out itself,
  // a peer loss the watchdog saw takes precedence over the symptom the calling thread met (an
  // aborted wait, a closed pair). When another thread recorded a failure first, that one wins:
  // this call throws its kind, naming it (the symptom seen here is usually its consequence).
  [[noreturn]] void fail(const char* op, int peer, FailureKind kind, std::chrono::milliseconds t,
                         const std::string& gloo_message);

  // Runs `body`, mapping a Gloo exception escaping it onto a tessel error via fail().
  template <typename F>
  void guarded(const char* op, int peer, std::chrono::milliseconds t, F&& body);

  // Blocks until one receive (send) posted on `buf` completed, at most until `deadline`.
  // `peers` are the ranks that receive (send) can be with. Returns the peer it completed with.
  // Throws gloo::IoException on timeout, on a failed pair, when the watchdog or abort() aborted
  // the wait, and at once (without waiting) once abort() ran.
  int wait_recv(gloo::transport::UnboundBuffer& buf, std::initializer_list<int> peers,
                Clock::time_point deadline);
  int wait_send(gloo::transport::UnboundBuffer& buf, std::initializer_list<int> peers,
                Clock::time_point deadline);
  int wait_send(gloo::transport::UnboundBuffer& buf, const std::vector<int>& peers,
                Clock::time_point deadline);

  // The first verdict: the watchdog's ("connection to peer rank p failed: ...") or abort()'s
  // ("aborted by this process: <reason>"); empty while every pair is healthy and nobody aborted.
  std::string peer_failure();

  // Breaks the communicator on purpose, from any thread (see Communicator::abort): records the
  // verdict unless there is one, aborts every registered wait, makes every later wait throw at
  // once, and closes every connection (not while mesh_settling: see settled()). Idempotent.
  void abort(const std::string& reason) noexcept;

 private:
  // One thread's blocking wait, on that thread's stack while registered in waits_ (the fields
  // are read, and stuck/stuck_since written, under mu_).
  struct Wait {
    gloo::transport::UnboundBuffer* buf = nullptr;
    bool is_recv = false;
    const int* peers = nullptr;  // the caller's ranks, valid while the wait is registered
    size_t npeers = 0;
    bool stuck = false;  // the watchdog saw it depending on a failed peer, first at stuck_since
    Clock::time_point stuck_since;
  };
  int wait(gloo::transport::UnboundBuffer& buf, bool is_recv, const int* peers, size_t npeers,
           Clock::time_point deadline);
  void watchdog_loop();
  void abort_waits();  // every registered wait; the caller holds mu_
  [[noreturn]] void throw_kind(FailureKind kind, const std::string& message) const;
  void close_connections() noexcept;
  std::string verdict(bool* from_abort);

  std::vector<unsigned char> sentinel_bytes_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sentinels_;  // by peer rank
  std::thread watchdog_;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<bool> failed_;  // by peer rank: its pair failed
  std::string peer_failure_;
  bool verdict_is_abort_ = false;  // peer_failure_ came from abort()
  bool aborted_ = false;           // abort() ran: no wait may block any more
  // The first failure a call met (fail()); later calls on every thread rethrow this kind.
  FailureKind failure_kind_ = FailureKind::kNone;
  std::string failure_;
  // The waits blocked right now, one per waiting thread (storage reused: registering allocates
  // only when more threads wait at once than ever before).
  std::vector<Wait*> waits_;
};

FailureKind classify_gloo_message(const std::string& message);

template <typename F>
void CommState::guarded(const char* op, int peer, std::chrono::milliseconds t, F&& body) {
  ensure_healthy(op);
  try {
    body();
  } catch (const gloo::IoException& e) {
    fail(op, peer, classify_gloo_message(e.what()), t, e.what());
  } catch (const gloo::EnforceNotMet& e) {
    fail(op, peer, FailureKind::kOther, t, e.what());
  } catch (const gloo::Exception& e) {
    fail(op, peer, FailureKind::kOther, t, e.what());
  }
}

}  // namespace tessel::comm::detail
