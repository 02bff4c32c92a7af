#include "tessel/comm/full_mesh.h"

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "tessel/comm/abort_signal.h"
#include "tessel/comm/signed_store.h"
#include "tessel/comm/tcp_context.h"
#include "tessel/core/check.h"

namespace tessel::comm::detail {

namespace {

// A gloo::Context over a transport context connected here. Its device and transport context are
// protected members, which gloo::rendezvous::Context sets the same way at the end of its
// connectFullMesh; everything else (buffers, closeConnections, timeouts) is gloo::Context's own.
class MeshContext final : public gloo::Context {
 public:
  MeshContext(int rank, int size, std::shared_ptr<gloo::transport::Device> device,
              std::shared_ptr<gloo::transport::Context> transport)
      : gloo::Context(rank, size) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

// Which pair's handshake the connecting thread is in, as the abort callback sees it.
class Handshakes {
 public:
  explicit Handshakes(std::shared_ptr<gloo::transport::Context> transport)
      : transport_(std::move(transport)) {}

  // Called by the connecting thread around each Pair::connect. enter() throws instead when the
  // signal has fired: checked under the lock the callback takes, either the callback sees this
  // handshake or this check sees the signal.
  void enter(int peer, const std::shared_ptr<AbortSignal>& signal);
  void leave() noexcept;

  // The abort callback: gives the handshake in progress kHandshakeGrace to complete, then closes
  // its pair, which wakes it (full_mesh.h says why nothing else is closed).
  void abort() noexcept;

 private:
  const std::shared_ptr<gloo::transport::Context> transport_;
  std::mutex mu_;
  std::condition_variable left_;
  int peer_ = -1;  // the peer of the handshake in progress, -1: none
};

void throw_if_aborted(const std::shared_ptr<AbortSignal>& signal, const char* when) {
  if (signal && signal->aborted()) {
    throw gloo::IoException(std::string("rendezvous aborted ") + when + ": " + signal->reason());
  }
}

void Handshakes::enter(int peer, const std::shared_ptr<AbortSignal>& signal) {
  std::lock_guard<std::mutex> lock(mu_);
  throw_if_aborted(signal, "before connecting to a peer");
  peer_ = peer;
}

void Handshakes::leave() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    peer_ = -1;
  }
  left_.notify_all();
}

void Handshakes::abort() noexcept {
  try {
    std::unique_lock<std::mutex> lock(mu_);
    const int peer = peer_;
    if (peer < 0 || left_.wait_for(lock, kHandshakeGrace, [&] { return peer_ != peer; })) return;
    // Still blocked: no connection is half taken in (or the peer never dials). The pair outlives
    // this call: the connect unwinds only after the Registration running it is gone.
    auto& pair = transport_->getPair(peer);
    if (pair) pair->close();
  } catch (...) {
    // Best effort: a handshake that cannot be woken ends at its own timeout.
  }
}

// The addresses rank `peer` published. get() waits for the key within the store's timeout (and
// ends on an abort). A refusal of its entry (the control store verifies it when the job has a
// secret) says which rank it was.
std::vector<char> read_addresses(gloo::rendezvous::Store& store, int peer) {
  std::vector<char> published;
  try {
    published = store.get(std::to_string(peer));
  } catch (const MembershipError& e) {
    // Not TESSEL_THROW: the message already says where it was thrown.
    throw MembershipError(fmt::format("rank {}'s rendezvous entry is refused: {}", peer, e.what()));
  }
  // Signed but not unwrapped: the job has a secret and this process was given none.
  TESSEL_CHECK(!looks_signed(std::string_view(published.data(), published.size())), MembershipError,
               "rank {}'s rendezvous entry is signed with the job's secret and this process has "
               "none: start it with the job's token file (--token-file), as every other process",
               peer);
  return published;
}

}  // namespace

std::shared_ptr<gloo::Context> connect_full_mesh(
    gloo::rendezvous::Store& store, int rank, int size,
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds pair_timeout,
    const std::shared_ptr<AbortSignal>& abort_signal,
    std::vector<std::vector<char>>* peer_addresses) {
  // Pairs that survive a peer resetting a connection in the middle of its handshake
  // (tcp_context.h).
  auto transport = create_tcp_context(device, rank, size);
  transport->setTimeout(pair_timeout);  // each pair takes it when created

  // Listen: one pair per peer, their addresses published in one key.
  std::vector<char> addresses;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const auto bytes = transport->createPair(p)->address().bytes();
    addresses.insert(addresses.end(), bytes.begin(), bytes.end());
  }

  // From here until this returns, an abort wakes a blocked handshake; the store's waits see the
  // signal themselves. Declared after `handshakes`, so it is unregistered (waiting for a running
  // callback) before `handshakes` goes away.
  Handshakes handshakes(transport);
  AbortSignal::Registration wakes_handshake;
  if (abort_signal) {
    wakes_handshake =
        abort_signal->on_abort([&handshakes](const std::string&) { handshakes.abort(); });
  }
  throw_if_aborted(abort_signal, "before publishing this rank's addresses");
  store.set(std::to_string(rank), addresses);

  const size_t address_bytes = addresses.size() / size_t(size - 1);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const auto published = read_addresses(store, p);
    TESSEL_CHECK(published.size() == address_bytes * size_t(size - 1), ConfigError,
                 "rendezvous: rank {} published {} bytes of addresses, {} expected for a group of "
                 "{}: do all members agree on the group's size?",
                 p, published.size(), address_bytes * size_t(size - 1), size);
    // Peer p listed its pairs for every rank but itself, in rank order.
    const size_t slot = size_t(rank > p ? rank - 1 : rank);
    const std::vector<char> address(published.begin() + ptrdiff_t(slot * address_bytes),
                                    published.begin() + ptrdiff_t((slot + 1) * address_bytes));
    if (peer_addresses != nullptr) {
      peer_addresses->resize(size_t(size));
      (*peer_addresses)[size_t(p)] = address;
    }
    handshakes.enter(p, abort_signal);
    try {
      transport->getPair(p)->connect(address);
    } catch (...) {
      handshakes.leave();
      throw;
    }
    handshakes.leave();
    // A pair the abort closed wakes its connect as if it had connected.
    throw_if_aborted(abort_signal, "while connecting to a peer");
  }
  return std::make_shared<MeshContext>(rank, size, device, std::move(transport));
}

}  // namespace tessel::comm::detail
