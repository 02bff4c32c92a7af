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
//     Gloo does wake when the pair fails; it polls them, and when the peer of the current wait
//     has failed and the wait is still blocked after a short grace period, it aborts the wait.
// The grace period lets a transfer that completed just before the peer went away (a peer that
// finished the last collective and exited) be consumed normally instead of being aborted.
// A peer loss never fails an operation that does not depend on that peer; it fails the next
// operation at its start, and the failing rank closes its connections so the peers that were
// waiting on it fail in turn.
//
// abort() (Communicator::abort, or the callback a StoreOptions::abort_signal runs on the thread
// that fires it) is the one entry point used from a thread other than the user thread. It only
// touches what mu_ guards (the verdict, the aborted flag, the current wait) and then closes the
// connections, which Gloo serializes per pair; the user thread's own fields (failure_kind, failure,
// next_tag, scratch) stay single-threaded. A wait registered after the abort throws at once, a wait
// registered before it is aborted, so no wait blocks after abort.
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
  // through attach_shm, used by the user thread, aborted with the connections.
  std::unique_ptr<ShmTransport> shm;

  // Set by the user thread when a call fails; later calls rethrow this kind.
  FailureKind failure_kind = FailureKind::kNone;
  std::string failure;

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

  // "<op> on group '<name>' (rank r of n[, peer rank p])".
  std::string where(const char* op, int peer) const;

  // Throws if this communicator is broken: the kind of its earlier failure, or PeerLostError
  // when the watchdog saw a peer's connection fail since, or abort() ran (which also breaks it).
  void ensure_healthy(const char* op);

  // Records the failure, closes every connection (not while mesh_settling) so peers blocked on
  // this rank fail fast, and throws the matching tessel error. Unless this rank timed out itself,
  // a peer loss the watchdog saw takes precedence over the symptom the user thread met (an
  // aborted wait, a closed pair).
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
  // verdict unless there is one, aborts the user thread's current wait, makes every later wait
  // throw at once, and closes every connection (not while mesh_settling: see settled()).
  // Idempotent.
  void abort(const std::string& reason) noexcept;

 private:
  struct Wait {
    gloo::transport::UnboundBuffer* buf = nullptr;
    bool is_recv = false;
    std::vector<int> peers;
    uint64_t seq = 0;
  };
  int wait(gloo::transport::UnboundBuffer& buf, bool is_recv, const int* peers, size_t npeers,
           Clock::time_point deadline);
  void watchdog_loop();
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
  Wait wait_;                      // the user thread's current wait (buf null when none)
  uint64_t next_seq_ = 1;
  uint64_t stuck_seq_ = 0;  // the wait first seen depending on a failed peer, and when
  Clock::time_point stuck_since_;
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
