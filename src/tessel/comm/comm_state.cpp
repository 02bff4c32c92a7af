#include "tessel/comm/comm_state.h"

#include <gloo/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cctype>

#include "tessel/core/check.h"

namespace tessel::comm::detail {

namespace {

// How often the watchdog looks at the sentinels, and how long a wait on a failed peer may stay
// blocked before the watchdog aborts it (see the header: a completion that raced with the
// failure gets this long to be consumed; 20 ms was too short on a loaded 2-core machine, where
// a peer that finished and exited failed the others now and then).
constexpr auto kPollInterval = std::chrono::milliseconds(5);
constexpr auto kGrace = std::chrono::milliseconds(100);

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

// Gloo reports every transport failure as gloo::IoException and tells the causes apart only in
// the message text: "Timed out waiting N ms for recv operation", "Read timeout", "Connect
// timeout", "Wait timeout ..." (our store), and "Application timeout caused pair closure" (what
// the other pairs of a context see after a local timeout) versus "Connection closed by peer",
// "Read error ...: Connection reset by peer", "Socket closed", "writev ...: Broken pipe",
// "connect ...: Connection refused", and our own "... aborted" from the watchdog.
FailureKind classify_gloo_message(const std::string& message) {
  const auto m = lower(message);
  if (m.find("timeout") != std::string::npos || m.find("timed out") != std::string::npos) {
    return FailureKind::kTimeout;
  }
  return FailureKind::kPeerLost;
}

CommState::~CommState() {
  if (watchdog_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
  }
  // Tear down in dependency order: the shared-memory channels (and their threads), buffers, then
  // the connections, then the device (and its I/O thread).
  shm.reset();
  sentinels_.clear();
  context.reset();
  device.reset();
}

void CommState::start_watchdog() {
  sentinel_bytes_.assign(size_t(size), 0);
  sentinels_.resize(size_t(size));
  failed_.assign(size_t(size), false);
  // The user thread, one arrival thread per pipeline neighbour, room to spare.
  waits_.reserve(8);
  const uint64_t slot = make_slot(kSentinelSlotPrefix, 0);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    // Nobody ever sends on this slot: the receive stays pending until the pair fails, and a
    // failing pair wakes every receive pending on it.
    sentinels_[p] = context->createUnboundBuffer(&sentinel_bytes_[p], 1);
    sentinels_[p]->recv(p, slot);
  }
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void CommState::attach_shm(std::unique_ptr<ShmTransport> transport) {
  bool aborted = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shm = std::move(transport);
    aborted = aborted_;
  }
  if (aborted && shm) shm->abort("the communicator was aborted");
}

void CommState::watchdog_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<bool> failed = failed_;
  while (!stopping_) {
    cv_.wait_for(lock, kPollInterval, [&] { return stopping_; });
    if (stopping_) break;

    // Poll the sentinels of the pairs still believed healthy. Aborting first makes the wait
    // return at once ("aborted") unless the pair has failed, in which case it throws the pair's
    // error. The wait's own timeout never runs out (an expiring wait would make Gloo close the
    // whole context).
    lock.unlock();
    std::vector<std::pair<int, std::string>> lost;
    for (int p = 0; p < size; ++p) {
      if (!sentinels_[p] || failed[p]) continue;
      sentinels_[p]->abortWaitRecv();
      try {
        sentinels_[p]->waitRecv(nullptr, std::chrono::hours(1));
      } catch (const std::exception& e) {
        failed[p] = true;
        lost.emplace_back(p, e.what());
      }
    }
    lock.lock();
    for (const auto& [p, what] : lost) {
      failed_[p] = true;
      if (peer_failure_.empty()) {
        peer_failure_ = fmt::format("connection to peer rank {} failed: {}", p, what);
      }
    }

    // Abort each wait once it has depended on a failed peer for the grace period; the others
    // (of other threads, on healthy peers) go on until this rank's own failure closes them.
    const auto now = Clock::now();
    for (Wait* w : waits_) {
      bool depends = false;
      for (size_t i = 0; i < w->npeers; ++i) depends = depends || failed_[size_t(w->peers[i])];
      if (!depends) continue;
      if (!w->stuck) {
        w->stuck = true;
        w->stuck_since = now;
      } else if (now - w->stuck_since >= kGrace) {
        w->is_recv ? w->buf->abortWaitRecv() : w->buf->abortWaitSend();
      }
    }
  }
}

int CommState::wait(gloo::transport::UnboundBuffer& buf, bool is_recv, const int* peers,
                    size_t npeers, Clock::time_point deadline) {
  auto describe = [&] {
    std::string who;
    for (size_t i = 0; i < npeers; ++i) who += (i ? "/" : "") + std::to_string(peers[i]);
    return fmt::format("{} with peer rank {}", is_recv ? "receive" : "send", who);
  };
  Wait w;
  w.buf = &buf;
  w.is_recv = is_recv;
  w.peers = peers;
  w.npeers = npeers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Checked under the lock abort() and fail() take: either they see this wait and abort it, or
    // this wait sees the flag; it cannot slip in between and block.
    if (aborted_) {
      throw gloo::IoException(describe() + " not started: the communicator was aborted");
    }
    if (failure_kind_ != FailureKind::kNone) {
      throw gloo::IoException(describe() + " not started: the communicator had failed");
    }
    waits_.push_back(&w);
  }
  struct Unregister {
    CommState& s;
    Wait* w;
    ~Unregister() {
      std::lock_guard<std::mutex> lock(s.mu_);
      auto it = std::find(s.waits_.begin(), s.waits_.end(), w);
      *it = s.waits_.back();
      s.waits_.pop_back();
    }
  } unregister{*this, &w};

  // Gloo reads 0 ms as "no timeout"; keep at least 1 ms so an expired deadline still fires.
  const auto left =
      std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
               std::chrono::milliseconds(1));
  int peer = -1;
  const bool done = is_recv ? buf.waitRecv(&peer, left) : buf.waitSend(&peer, left);
  if (!done) {
    const char* why = "the peer's connection failed";
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) {
        why = "the communicator was aborted";
      } else if (failure_kind_ != FailureKind::kNone) {
        why = "the communicator failed in another call";
      }
    }
    throw gloo::IoException(describe() + " aborted: " + why);
  }
  return peer;
}

int CommState::wait_recv(gloo::transport::UnboundBuffer& buf, std::initializer_list<int> peers,
                         Clock::time_point deadline) {
  return wait(buf, true, peers.begin(), peers.size(), deadline);
}

int CommState::wait_send(gloo::transport::UnboundBuffer& buf, std::initializer_list<int> peers,
                         Clock::time_point deadline) {
  return wait(buf, false, peers.begin(), peers.size(), deadline);
}

int CommState::wait_send(gloo::transport::UnboundBuffer& buf, const std::vector<int>& peers,
                         Clock::time_point deadline) {
  return wait(buf, false, peers.data(), peers.size(), deadline);
}

void CommState::abort_waits() {
  // The buffers stay valid while registered (unregistering takes mu_). An abort that lands before
  // a thread entered Gloo's wait is kept by the buffer and ends that wait at once.
  for (Wait* w : waits_) w->is_recv ? w->buf->abortWaitRecv() : w->buf->abortWaitSend();
}

std::string CommState::verdict(bool* from_abort) {
  std::lock_guard<std::mutex> lock(mu_);
  if (from_abort != nullptr) *from_abort = aborted_ && (verdict_is_abort_ || peer_failure_.empty());
  // Empty only when abort() could not allocate its message; the flag alone still breaks it.
  if (peer_failure_.empty() && aborted_) return "aborted by this process";
  return peer_failure_;
}

std::string CommState::peer_failure() {
  return verdict(nullptr);
}

void CommState::abort(const std::string& reason) noexcept {
  std::string message;
  try {
    message = "aborted by this process: " + reason;
  } catch (...) {
    // Out of memory: the flag set below breaks the communicator all the same (see verdict()).
  }
  try {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    if (peer_failure_.empty() && !message.empty()) {
      peer_failure_.swap(message);
      verdict_is_abort_ = true;
    }
    abort_waits();
  } catch (...) {
    // Only a broken mutex could throw here; nothing sensible is left to do.
  }
  // Outside the lock: closing unregisters the sockets from Gloo's I/O thread and waits for it.
  // Gloo closes each pair under the pair's own lock, so this is safe against the calling threads'
  // sends and receives and against a concurrent close from fail().
  close_connections();
}

void CommState::settled() {
  mesh_settling = false;
  bool aborted = false;
  {
    // abort() sets aborted_ under this lock before it looks at mesh_settling: either it saw the
    // flag cleared and closed the connections itself, or this sees aborted_.
    std::lock_guard<std::mutex> lock(mu_);
    aborted = aborted_;
  }
  if (aborted) close_connections();
}

std::string CommState::where(const char* op, int peer) const {
  std::string s = fmt::format("{} on group '{}' (rank {} of {}", op, name, rank, size);
  if (peer >= 0) s += fmt::format(", peer rank {}", peer);
  return s + ")";
}

void CommState::throw_kind(FailureKind kind, const std::string& message) const {
  switch (kind) {
    case FailureKind::kTimeout:
      throw TimeoutError(message);
    case FailureKind::kPeerLost:
      throw PeerLostError(message);
    default:
      throw IoError(message);
  }
}

std::string CommState::recorded_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void CommState::ensure_healthy(const char* op) {
  FailureKind kind = FailureKind::kNone;
  std::string earlier;
  {
    // One lock for the common case, a healthy communicator (no string is copied then).
    std::lock_guard<std::mutex> lock(mu_);
    kind = failure_kind_;
    if (kind == FailureKind::kNone && peer_failure_.empty() && !aborted_) return;
    if (kind != FailureKind::kNone) earlier = failure_;
  }
  if (kind == FailureKind::kNone) fail(op, -1, FailureKind::kPeerLost, timeout, "");
  throw_kind(kind, where(op, -1) + ": communicator is unusable after an earlier failure (" +
                       earlier + "); reconnect under a new store generation");
}

void CommState::close_connections() noexcept {
  ShmTransport* transport = nullptr;
  try {
    std::lock_guard<std::mutex> lock(mu_);
    transport = shm.get();
  } catch (...) {
  }
  // Peers blocked on a channel with this rank fail at once, as they do on a closed connection.
  if (transport != nullptr) transport->abort("the communicator failed or was aborted");
  if (!context || mesh_settling.load()) return;
  try {
    context->closeConnections();
  } catch (...) {
    // Best effort: the connections may already be gone.
  }
}

void CommState::fail(const char* op, int peer, FailureKind kind, std::chrono::milliseconds t,
                     const std::string& gloo_message) {
  std::string detail = gloo_message;
  bool aborted = false;
  if (kind != FailureKind::kTimeout) {
    const std::string v = verdict(&aborted);
    if (!v.empty()) {
      kind = FailureKind::kPeerLost;
      // After abort() the symptom (an aborted wait, a closed pair) only repeats the verdict.
      detail = detail.empty() || aborted ? v : v + " (then: " + detail + ")";
    }
  }
  std::string what;
  switch (kind) {
    case FailureKind::kTimeout:
      what = fmt::format("timed out after {} ms", t.count());
      break;
    case FailureKind::kPeerLost:
      what = aborted ? "failed"
                     : "lost a peer (a connection closed or reset: the peer died, or gave up after "
                       "its own failure)";
      break;
    default:
      what = "failed inside Gloo";
      break;
  }
  std::string message = where(op, peer) + " " + what + ": " + detail;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_kind_ == FailureKind::kNone) {
      failure_kind_ = kind;
      failure_ = message;
      // Closing the connections below does not wake this rank's own waits on them (Gloo wakes
      // waits when a pair fails, not when it is closed): the other threads' waits end here.
      abort_waits();
    } else {
      // Another thread's call failed first (this one's symptom, say a wait that its closing of
      // the connections ended, is usually the consequence): every thread reports that failure.
      kind = failure_kind_;
      message = where(op, peer) + " failed: the communicator had failed meanwhile (" + failure_ +
                ")" + (detail.empty() || aborted ? "" : "; then: " + detail);
    }
  }
  close_connections();
  throw_kind(kind, message);
}

}  // namespace tessel::comm::detail
