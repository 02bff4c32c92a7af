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
// server closes at the moment the client sends on it would fail that request, and idle
// connections would hold server threads and delay stopping. Requests run on a pool of at most
// kMaxThreads threads; a watch holds one while it runs and notices within kWatchPoll that the
// server stops or that its client went away.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>

#include "tessel/comm/memory_store.h"

namespace httplib {
class Server;
}

namespace tessel::comm {

class StoreServer {
 public:
  // Requests served at once; more wait for a thread. Each open watch holds one.
  static constexpr size_t kMaxThreads = 128;
  // How often a quiet watch looks for shutdown and sends a keep-alive newline (etcd's clients
  // skip blank lines) through which it notices a client that went away.
  static constexpr std::chrono::milliseconds kWatchPoll{50};

  // Listens on host:port (port 0: a free port) and serves `store` from a background thread.
  // Throws IoError naming the address when it cannot listen.
  explicit StoreServer(std::shared_ptr<MemoryStore> store, std::string host = "127.0.0.1",
                       int port = 0);
  ~StoreServer();  // stops serving; open watch streams end
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  std::string endpoint() const;  // "http://127.0.0.1:PORT"
  MemoryStore& store();

 private:
  std::shared_ptr<MemoryStore> store_;
  std::string host_;
  int port_ = 0;
  std::unique_ptr<httplib::Server> server_;
  std::thread listener_;
};

}  // namespace tessel::comm
