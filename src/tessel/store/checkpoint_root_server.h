// Serves every checkpoint under one directory, a host's checkpoint root, over HTTP: how hosts read
// the pieces of a checkpoint they do not hold from the hosts that do (remote_pieces.h), and copy
// whole rank files to keep a second copy (checkpoint_store.h, "Many hosts").
//
//   GET /v1/checkpoints/<rel>/tensors                  -> JSON list, as GET /v1/tensors
//   GET /v1/checkpoints/<rel>/tensors/<name>[?box=...][&format=raw|npy][&dtype=...]
//        as GET /v1/tensors/<name> (http_server.h: same query, body, headers, streaming and
//        errors), from the checkpoint ROOT/<rel> opened as a partial reader (this host may hold
//        only some of its rank files); a box needing a piece of a file this host does not hold
//        gets 404 with {"error", "missing_files": [...]}
//   GET /v1/checkpoints/<rel>/files/<rank file>        -> the raw bytes of ROOT/<rel>/<rank file>
//        (application/octet-stream), for copies; <rel> may also be a staging directory
//        (DIR.tmp-<id>), so a copy can be made before the commit. Only names rank_file_name
//        gives; any other name is 400, an absent file 404. Not bound by max_response_bytes:
//        streamed from one open descriptor, a chunk at a time.
//
// <rel> is a relative path of one or more components of [A-Za-z0-9._-], none "." or "..", and it
// must resolve (symbolic links followed) inside ROOT; anything else is 400, before any file
// access. A tensor name may hold '/', so the path is split at the first "tensors" or "files"
// component after which <rel> names an existing directory.
//
// Readers are opened on first use and cached (at most max_open_checkpoints, least recently used
// dropped first). Each request compares the checkpoint directory and its manifest.json with what
// the cached reader saw (device and inode of both; size, modification and change times of the
// manifest), so a save published over it (a new directory, renamed into place) opens a new
// reader; and a box needing a file the reader lacks reopens it when that file has appeared since
// (a copy made after the commit). Responses in flight finish from the reader they started with.
//
// Token rules, guards and limits are StoreServer's (StoreServerOptions, net::GuardedServer):
// loopback unless a token file is given, and then every request carries the token.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "tessel/store/http_server.h"

namespace tessel::store {

struct CheckpointRootServerOptions {
  StoreServerOptions server;
  // Checkpoints kept open at once (each holds one descriptor per rank file it has).
  size_t max_open_checkpoints = 16;
};

class CheckpointRootServer {
 public:
  // Throws IoError when `root` is not a directory, ConfigError as StoreServer does.
  CheckpointRootServer(const std::string& root, CheckpointRootServerOptions options = {});
  ~CheckpointRootServer();  // stop()
  CheckpointRootServer(const CheckpointRootServer&) = delete;
  CheckpointRootServer& operator=(const CheckpointRootServer&) = delete;

  // As StoreServer's.
  int start();
  void stop();
  int port() const;
  const std::string& host() const;
  bool requires_token() const;
  // Readers opened so far (first opens and reopens after a change), for tests and metrics.
  size_t readers_opened() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::store
