// Internal: the rendezvous that connects one group's full mesh of Gloo TCP pairs, abortable from
// another thread (Communicator::connect runs it).
//
// Why not gloo::rendezvous::Context::connectFullMesh: its transport context and pairs are local
// to that call until it returns, so nothing can reach a pair blocked in its TCP handshake (with a
// peer that published its address and then froze, or whose host vanished: Gloo's tcp::Pair
// waits up to 5x its timeout there). Here the pairs live in a transport context the abort
// callback can reach, and an abort closes the pair whose handshake blocks the connect.
//
// The protocol is Gloo's (so its reasoning about deadlocks carries over): every rank creates one
// listening pair per peer, publishes their addresses under the key "<rank>" (the addresses of the
// pairs for ranks 0..size-1 without itself, in rank order, each Address::bytes() long), then,
// peer by peer in rank order, reads the peer's key and connects that pair; the side with the
// larger address dials, the other waits for the accept, which Gloo's I/O thread does without the
// peer's user thread, so the rank-ordered loop cannot deadlock. Gloo's "rank_<r>" hostname keys
// are not written: they only feed Pair::setLocalRank, which the TCP transport does not use.
//
// What an abort closes, and why so little. Gloo's Pair::close() resets the connection (SO_LINGER
// 0). With Gloo's own pairs, a peer whose I/O thread had not yet taken in its end of a reset
// connection (its accept of it still queued) failed a GLOO_ENFORCE on getpeername() on that
// thread and std::terminate()d; the pairs here (tcp_context.h) fail cleanly instead, but the peer
// then reports a reset connection rather than the abort. Pairs destroyed normally close
// gracefully (FIN; the peer fails cleanly with "connection closed"). So the abort closes only the
// pair this rank's connect is blocked on, and only after kHandshakeGrace: a handshake that is
// merely completing finishes within the grace, the connect returns and then sees the signal; a
// handshake still blocked after it has no connection to reset (a dial whose SYN goes unanswered)
// or waits for a peer that never dials. Every other pair, and that one, is released when the
// failed connect unwinds.
//
// Relies on these properties of Gloo's tcp::Pair (checked against the Debian package's source,
// gloo 0.0~git20220518.5b14351, and by connect_abort_test.cpp):
//   - Pair::close() may be called from any thread while Pair::connect waits (it takes the pair's
//     lock, which the wait releases); it wakes the wait, and Pair::connect then RETURNS (a closed
//     pair counts as past "connected"), so the caller looks at the signal after every connect;
//   - a pair's address and its table entry in the transport context are written when it is
//     created, before any abort can look at them (the lock below orders it).
// Destroying a listening pair resets connections still queued in its backlog (the kernel does
// that on any close, and on exit). With Gloo's own pairs the peer that dialled crashed when the
// reset landed between two system calls of its I/O thread (getsockopt, getpeername): a window of
// microseconds, but connect_abort_test's race test hit it in 2 of 53 runs (SIGABRT in
// Pair::handleConnected). The pairs of tcp_context.h fail the pair cleanly there too.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

namespace gloo {
class Context;
}
namespace gloo::rendezvous {
class Store;
}
namespace gloo::transport {
class Device;
}

namespace tessel::comm {
class AbortSignal;
}

namespace tessel::comm::detail {

// How long an abort lets a pair handshake in progress complete before it closes the pair (see
// above). Bounds the extra time AbortSignal::abort spends in this callback.
inline constexpr std::chrono::milliseconds kHandshakeGrace{100};

// Connects `rank` of `size` (>= 2) to every other rank through `store` (its waits bounded and
// ended by the abort signal in the store itself, store.h) on `device`, and returns the connected
// context (its own timeout is Gloo's default; the caller sets it). Each pair's handshake waits
// at most 5 * pair_timeout (Gloo's rule). Throws what the store and Gloo throw (gloo::IoException,
// gloo::EnforceNotMet, tessel errors from the control store), and ConfigError when a peer
// published a number of addresses that does not fit `size` (the members disagree on the group's
// size). When `abort_signal` (may be null) fires, throws gloo::IoException "rendezvous aborted
// ..." within about one store poll, or kHandshakeGrace plus a pair close (or whatever the abort
// made a Gloo call throw): callers look at the signal to tell an abort from a failure. Throws
// MembershipError naming the peer when the store refuses a peer's entry (a SignedStore under it:
// written without the job's secret), or when an entry is signed and this process has no secret.
// When `peer_addresses` is given, it receives by rank the address each peer published for this
// rank's pair (empty for this rank), for messages.
std::shared_ptr<gloo::Context> connect_full_mesh(
    gloo::rendezvous::Store& store, int rank, int size,
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds pair_timeout,
    const std::shared_ptr<AbortSignal>& abort_signal,
    std::vector<std::vector<char>>* peer_addresses = nullptr);

}  // namespace tessel::comm::detail
