// Internal: the Gloo TCP transport context a group's mesh is connected in (full_mesh.h), with
// pairs whose connection handshake cannot kill the process.
//
// Why. Gloo's tcp::Pair completes a handshake on the device's I/O thread: the listening side
// accept()s, the dialling side reads SO_ERROR, and both then ask getpeername() for the peer's
// address under GLOO_ENFORCE. When the peer resets the connection before that (a listener that
// closes with the connection still in its accept queue, or a dialler that closes with SO_LINGER 0,
// as an aborted or failed rendezvous does on its way out), getpeername() fails with ENOTCONN, the
// enforce throws on the I/O thread, nothing catches it, and the process dies in std::terminate
// (SIGABRT). connect_abort_test's race test hit it in 2 of 53 runs (a rank dialling a peer whose
// connect was aborted), and a peer that resets a connection the listener has not accepted yet
// hits it every time (ConnectAbort.AConnectionResetBeforeItIsAcceptedFailsConnectWithPeerLost).
//
// So the pairs of this context (a subclass of tcp::Pair, relying on its protected members as
// documented for gloo 0.0~git20220518.5b14351, the Debian package) complete the handshake
// themselves, as Gloo does but without any enforce: a connection found reset fails the pair
// ("Connection reset by peer during the handshake"), which wakes Pair::connect with a
// gloo::IoException as any other failed connect. Once connected, events go to Gloo's own
// handling; an exception escaping it (an enforce on the I/O thread) fails the pair too instead of
// terminating the process. Everything else is Gloo's tcp::Context and tcp::Pair unchanged.
#pragma once

#include <memory>

namespace gloo::transport {
class Context;
class Device;
}  // namespace gloo::transport

namespace tessel::comm::detail {

// A transport context for `rank` of `size` on `device` (a gloo::transport::tcp device; any other
// device gets its own createContext). Throws what Gloo throws.
std::shared_ptr<gloo::transport::Context> create_tcp_context(
    const std::shared_ptr<gloo::transport::Device>& device, int rank, int size);

}  // namespace tessel::comm::detail
