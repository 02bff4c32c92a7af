// GuardedServer: an httplib::Server that a slow, greedy or unauthorised client cannot hold up.
// Both HTTP endpoints (the tensor store, the embedded control store) are one.
//
// How a connection is served:
//   accept    -> admitted, or refused at once with 503 when its address already has
//                max_connections_per_client open, or the server max_connections;
//   the gate  -> one thread reads every admitted connection's request without blocking: its head
//                (at most max_head_bytes, else 431) and its body (only for methods that take
//                one, only with a Content-Length, at most max_body_bytes, else 411/413). The whole
//                request must arrive within request_timeout of the connection being ready for it
//                (accepted, or its previous response sent), whatever the client's pace, else 408
//                and the connection is closed. With a token, a request without
//                "Authorization: Bearer <token>" gets 401 here. These answers are JSON
//                (ServerOptions::error_body) and close the connection.
//   a worker  -> a complete request goes to one of `threads` workers, where httplib parses it
//                from memory and runs the handler; each write of the response has
//                write_timeout. A kept-alive connection goes back to the gate for its next
//                request, so idle and slow connections never hold a thread.
// So slow clients cost a socket and a buffer each, never a thread: the server answers others
// while max_connections of them drip bytes. Long responses (a watch stream, a large tensor) hold
// a worker while they run; the endpoint bounds how many of those it starts.
//
// Binding: loopback (127.0.0.0/8, ::1, localhost) unless told otherwise, and any other address
// only with a token (ServerOptions::token_file), which every request must then carry.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <memory>
#include <string>

#include "tessel/net/server_options.h"

namespace tessel::net {

class GuardedServer : private httplib::Server {
 public:
  // Checks the options and reads the token file: throws ConfigError for a non-loopback host
  // without a token file, a token file others can read, or limits that are zero.
  explicit GuardedServer(ServerOptions options);
  ~GuardedServer() override;  // stop()
  GuardedServer(const GuardedServer&) = delete;
  GuardedServer& operator=(const GuardedServer&) = delete;

  // Routes, as httplib::Server's; register them before start().
  using httplib::Server::Get;
  using httplib::Server::Post;
  using httplib::Server::set_exception_handler;

  // Binds and serves on background threads; returns the bound port. Throws IoError when the
  // address cannot be bound, TimeoutError when the server does not come up within 5 s.
  int start();
  // Stops accepting, ends the connections waiting for their request, lets the responses in
  // flight finish (each write has write_timeout; streams see the stop between their writes) and
  // joins the threads. Safe to call twice.
  void stop();

  int port() const;
  const std::string& host() const;
  bool requires_token() const;
  const ServerLimits& limits() const;
  // True once stop() began: long-running response writers end their streams.
  bool stopping() const;
  // Connections open now (admitted and not closed).
  size_t open_connections() const;

 private:
  struct Impl;
  bool process_and_close_socket(socket_t sock) override;
  // httplib's parsing, routing and response writing of one request on `stream`.
  bool serve_request(httplib::Stream& stream, bool close_connection, bool& connection_closed);

  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::net
