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
// for a response above the size limit, 500 when stored bytes fail their checksum.
//
// Binds 127.0.0.1 unless told otherwise: the server has no authentication, so exposing it is an
// explicit choice. Reads use CheckpointReader, so every byte served was checksum-verified.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tessel/store/checkpoint_store.h"

namespace tessel::store {

class StoreServer {
 public:
  // Opens (and validates) the checkpoint; throws as CheckpointReader does.
  explicit StoreServer(const std::string& dir, std::string host = "127.0.0.1", int port = 0);
  ~StoreServer();  // stop()
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // Binds and starts serving on a background thread; returns the bound port (any free one when
  // the port given was 0). Throws IoError when the address cannot be bound, TimeoutError when
  // the server does not come up within 5 s.
  int start();
  // Stops accepting, finishes the requests in flight and joins the threads. Idle keep-alive
  // connections delay this by at most the 1 s keep-alive timeout. Safe to call twice.
  void stop();

  int port() const;
  const std::string& host() const;
  const CheckpointReader& reader() const;
  // Largest response body served (default 1 GiB); larger requests get 413.
  void set_max_response_bytes(uint64_t n);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::store
