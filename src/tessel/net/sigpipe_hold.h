// Holds SIGPIPE off the calling thread while it lives and discards one raised meanwhile.
// cpp-httplib sends without MSG_NOSIGNAL and OpenSSL writes to its sockets with write(2), so a
// request (or the close_notify of a TLS connection) to a peer that closed or reset its end would
// otherwise end a process that does not ignore SIGPIPE -- tessel's workers do not -- instead of
// failing the call. Every HTTP client call of tessel's runs under one (comm/etcd_store.cpp,
// store/remote_pieces.cpp).
#pragma once

#include <signal.h>

namespace tessel::net {

class SigpipeHold {
 public:
  SigpipeHold();
  ~SigpipeHold();
  SigpipeHold(const SigpipeHold&) = delete;
  SigpipeHold& operator=(const SigpipeHold&) = delete;

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false;
};

}  // namespace tessel::net
