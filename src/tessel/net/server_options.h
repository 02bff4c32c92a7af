// What a GuardedServer (guarded_server.h) listens on and the limits it holds its clients to; a
// header of its own so an endpoint's options can name them without pulling in httplib.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace tessel::net {

struct ServerLimits {
  // The whole request, head and body, must arrive within this (see guarded_server.h).
  std::chrono::milliseconds request_timeout{10'000};
  // Each write of a response: a client that stops reading is disconnected after this.
  std::chrono::milliseconds write_timeout{5'000};
  // Request line and headers; beyond: 431. (httplib answers a request line over 8 KiB with 414.)
  size_t max_head_bytes = size_t(16) << 10;
  // Body of a POST/PUT/PATCH/DELETE; beyond: 413. 0: no body is accepted. GET never has one.
  size_t max_body_bytes = 0;
  // Connections open at once, from all clients and from one address; beyond: 503.
  size_t max_connections = 64;
  size_t max_connections_per_client = 8;
  // Requests answered at once (complete requests wait for a worker).
  size_t threads = 8;
  // Requests served on one kept-alive connection; 1: "Connection: close" on every response.
  size_t max_requests_per_connection = 100;
  // The kernel's queue of connections not accepted yet (httplib's own is 5).
  int listen_backlog = 512;
};

struct ServerOptions {
  // Names the endpoint in errors and logs: "the tensor store".
  std::string name = "the server";
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  // A file holding the shared secret (bearer_token.h: owner-only, printable); empty: none, and
  // then only a loopback host is allowed.
  std::string token_file;
  // How a user of this endpoint gives the token file, named in the error for a non-loopback host
  // without one: "--token-file FILE".
  std::string token_hint = "a token file";
  ServerLimits limits;
  // The body (JSON) of the answers the server gives itself (401, 408, 411, 413, 431, 503).
  // Default: {"error": message}.
  std::function<std::string(int status, const std::string& message)> error_body;
};

}  // namespace tessel::net
