// StoreServer: serves a MemoryStore to other processes over HTTP, speaking the subset of etcd's
// v3 JSON gateway that EtcdStore uses, so EtcdStore is the single client for both. It is the
// embedded control store of a single-host job: no etcd to install or run, the same protocol.
//
// Served (POST, JSON bodies, keys and values base64, 64-bit integers as strings, as etcd's
// gateway writes them): /v3/kv/put, /v3/kv/range (one key, or [key, range_end) for a prefix),
// /v3/kv/deleterange (one key), /v3/kv/txn (the compare-and-set shape EtcdStore sends), the
// /v3/lease/grant and /v3/lease/keepalive of etcd's gateway and its /v3/kv/lease/revoke, and the
// streaming /v3/watch (a chunked reply, one JSON object per line: the "created" acknowledgement,
// then one per batch of events). Errors come back as etcd's do: {"error","message","code"} with
// the gRPC code's HTTP status ("etcdserver: requested lease not found" for a dead lease; a watch
// behind the kept history is cancelled with compact_revision). A request with a field this
// server does not implement is refused (HTTP 501) rather than half-served.
//
// Where it differs from etcd, invisibly to EtcdStore: headers carry only the revision; key-values
// have no create_revision or version; lease ids count up from 1; a range's header revision is
// read just before its keys (a key written in between may be newer than the header, which makes a
// watch from the header revision report it again rather than miss it).
//
// Every connection serves one request ("Connection: close"): a reused idle connection that the
// server closes at the moment the client sends on it would fail that request. Requests run on a
// pool of at most kMaxThreads threads; a watch holds one while it runs and notices within
// kWatchPoll that the server stops or that its client went away.
//
// Guards (net::GuardedServer, docs/security.md): loopback unless told otherwise, and any other
// host only with a token file, whose token every request must then carry ("Authorization: Bearer
// <token>"; EtcdStore sends it); each request must arrive whole within 10 s (the read of a
// watch's request, not the watch, which runs as long as its client wants), bodies up to 2 MiB,
// at most 512 connections and max_watches open watches (more: 429, etcd's RESOURCE_EXHAUSTED).
// The gate's own answers (401, 408, 411, 413, 431, 503) are etcd-shaped errors too.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "tessel/comm/memory_store.h"
#include "tessel/net/server_options.h"

namespace tessel::net {
class GuardedServer;
}

namespace tessel::comm {

// The embedded control store's defaults: net::ServerLimits with bodies up to 2 MiB,
// StoreServer::kMaxThreads threads and 512 connections (all of which may come from loopback).
net::ServerLimits control_store_limits();

struct StoreServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  // The shared secret (net/bearer_token.h); required for a host other than loopback.
  std::string token_file;
  net::ServerLimits limits = control_store_limits();
  // Watches open at once; below limits.threads, so other requests always find a thread.
  size_t max_watches = 96;
};

class StoreServer {
 public:
  // Requests served at once; more wait for a thread. Each open watch holds one.
  static constexpr size_t kMaxThreads = 128;
  // How often a quiet watch looks for shutdown and sends a keep-alive newline (etcd's clients
  // skip blank lines) through which it notices a client that went away.
  static constexpr std::chrono::milliseconds kWatchPoll{50};

  // Listens on host:port (port 0: a free port) and serves `store` from background threads.
  // Throws IoError naming the address when it cannot listen, ConfigError for a non-loopback host
  // without a token file, a token file others can read, or limits that cannot work.
  StoreServer(std::shared_ptr<MemoryStore> store, StoreServerOptions options);
  explicit StoreServer(std::shared_ptr<MemoryStore> store, std::string host = "127.0.0.1",
                       int port = 0);
  ~StoreServer();  // stops serving; open watch streams end
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  std::string endpoint() const;  // "http://127.0.0.1:PORT"
  bool requires_token() const;
  MemoryStore& store();

 private:
  std::shared_ptr<MemoryStore> store_;
  std::unique_ptr<net::GuardedServer> server_;
};

}  // namespace tessel::comm
