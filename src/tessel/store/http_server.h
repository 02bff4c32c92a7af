// Serves a checkpoint's tensors, or boxes of them, over HTTP (cpp-httplib).
//
//   GET /v1/tensors                      -> JSON list [{"name", "dtype", "shape", "bytes"}]
//   GET /v1/tensors/<name>[?box=0:512,:][&format=raw|npy][&dtype=f32]
//        raw (default): the box's elements, little-endian, C order, application/octet-stream,
//                       headers X-Tessel-Dtype ("f32", "bf16", ...) and X-Tessel-Shape
//                       ("512,768"; empty for a scalar)
//        npy:           a .npy v1.0 file of the box (bf16 has no NumPy dtype: add dtype=f32)
//        dtype:         convert the elements first (f32, bf16, f16, i32, i64, u8, u16)
// Errors are JSON {"error": "..."}: 404 for a name the index does not hold (names are looked up
// in index.json only, never joined to a path, and names with "..", "\" or a leading "/" are
// refused outright), 400 for a malformed or out-of-range box, an unknown format or dtype, 413
// for a response above the size limit, 500 when stored bytes fail their checksum. The guards of
// net::GuardedServer answer the rest: 401 without the token, 408 for a request slower than the
// limit, 413 for a request with a body, 431 for oversized headers, 503 over the connection caps.
//
// Responses are streamed: the box is read, converted and sent a slab of whole rows at a time
// (at most chunk_bytes of stored and of converted elements each), so a response costs that much
// memory whatever its size. Reads use CheckpointReader::read_box, which verifies every checksum
// chunk it reads, every time: every byte served was verified just before it was sent. The price
// of streaming: the status goes out before the later slabs are read, so damage found in a later
// slab cannot become a 500 any more; the server logs it and closes the connection before the
// promised Content-Length, which every HTTP client reports as an error. A response of one slab
// is read whole first and still gets its 500. (Verifying a whole tensor once and caching the
// verdict would instead read every byte of it for any box, and miss damage appearing later.)
//
// Binds 127.0.0.1 unless told otherwise; any other address needs a token file, and every request
// must then carry "Authorization: Bearer <token>" (docs/security.md).
//
// CheckpointRootServer (checkpoint_root_server.h) serves every checkpoint under a directory the
// same way (http_endpoint.h holds what the two share), for hosts reading each other's pieces.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tessel/net/server_options.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::store {

struct StoreServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  // The shared secret (net/bearer_token.h); required for a host other than loopback.
  std::string token_file;
  // Request time, sizes, connection caps and threads: net::ServerLimits' defaults (10 s per
  // request, 8 connections per client, 64 in all, 8 threads, no request body).
  net::ServerLimits limits;
  // Largest response body served; larger requests get 413.
  uint64_t max_response_bytes = uint64_t(1) << 30;
  // Memory of one streamed response: elements read (and converted) per slab.
  uint64_t chunk_bytes = uint64_t(4) << 20;
};

class StoreServer {
 public:
  // Opens (and validates) the checkpoint; throws as CheckpointReader does, and ConfigError for a
  // non-loopback host without a token file or a token file others can read.
  StoreServer(const std::string& dir, StoreServerOptions options);
  explicit StoreServer(const std::string& dir, std::string host = "127.0.0.1", int port = 0);
  ~StoreServer();  // stop()
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // Binds and starts serving on background threads; returns the bound port (any free one when
  // the port given was 0). Throws IoError when the address cannot be bound, TimeoutError when
  // the server does not come up within 5 s.
  int start();
  // Stops accepting, finishes the requests in flight and joins the threads. Safe to call twice.
  void stop();

  int port() const;
  const std::string& host() const;
  bool requires_token() const;
  const CheckpointReader& reader() const;
  // Largest response body served (default 1 GiB); larger requests get 413.
  void set_max_response_bytes(uint64_t n);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::store
