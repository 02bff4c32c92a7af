#include "tessel/comm/store_server.h"

#include <fcntl.h>
#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/comm/etcd_json.h"
#include "tessel/core/base64.h"
#include "tessel/core/check.h"

namespace tessel::comm {
namespace {

using json = nlohmann::json;

// A connection's request must arrive this soon after it connects (httplib counts whole seconds).
constexpr time_t kRequestWaitSeconds = 5;
// Reading a request and writing a reply (or the next line of a watch) to a client.
constexpr std::chrono::seconds kIoTimeout{5};
// Control-plane values are small; this only stops a runaway client from filling the memory.
constexpr size_t kMaxRequestBytes = size_t(64) << 20;
// httplib 0.11 listens with a backlog of 5, compiled into Debian's library: with a connection per
// request, a burst of clients would overflow it and wait a second for TCP to retry.
constexpr int kListenBacklog = 512;
// etcd's largest lease TTL, in seconds (it refuses longer ones).
constexpr int64_t kMaxLeaseSeconds = 9'000'000'000;

// ---------------------------------------------------------------------------------------------
// Threads

// httplib's task queue, with threads started as connections need them, up to a bound: an idle
// server holds a few threads, a busy one (many open watches) never more than the bound, and the
// connections beyond it wait for a thread.
class WorkerPool final : public httplib::TaskQueue {
 public:
  explicit WorkerPool(size_t max_threads) : max_threads_(max_threads) {}
  ~WorkerPool() override { shutdown(); }

  void enqueue(std::function<void()> job) override {
    std::lock_guard lock(mu_);
    jobs_.push_back(std::move(job));
    if (jobs_.size() > idle_ && threads_.size() < max_threads_) {
      try {
        threads_.emplace_back([this] { run(); });
      } catch (const std::system_error&) {
        // No thread to be had (a resource limit): the job waits for a running one.
      }
    }
    cv_.notify_one();
  }

  // Runs the queued jobs (httplib stopped accepting; they end at once) and joins every thread.
  void shutdown() override {
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      threads.swap(threads_);
    }
    cv_.notify_all();
    for (auto& t : threads) t.join();
  }

 private:
  void run() {
    // A write to a client that went away must fail with EPIPE instead of killing the process:
    // httplib 0.11 writes without MSG_NOSIGNAL, and Linux raises SIGPIPE in the writing thread.
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    std::unique_lock lock(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      --idle_;
      if (jobs_.empty()) return;
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      try {
        job();
      } catch (...) {
        // httplib's connection code failed (out of memory, most likely): this connection is lost,
        // the server goes on (an escaping exception would end the process).
      }
      lock.lock();
    }
  }

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

// httplib::Server with a listen backlog fit for a connection per request.
class HttpServer final : public httplib::Server {
 public:
  // After binding: Linux lets listen() again update the backlog of a listening socket.
  bool raise_backlog(int backlog) { return ::listen(svr_sock_, backlog) == 0; }
};

// ---------------------------------------------------------------------------------------------
// etcd's JSON

// JSON text; error messages may quote keys that are not UTF-8.
std::string text(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The fields of a request object, refusing those this server does not implement: a client that
// sets one expects its effect, which it would silently not get.
const json& fields(const json& j, const char* what, std::initializer_list<std::string_view> known) {
  TESSEL_CHECK(j.is_object(), InvalidArgumentError, "{}: expected a JSON object, got {:.200}", what,
               text(j));
  for (const auto& item : j.items()) {
    TESSEL_CHECK(std::find(known.begin(), known.end(), item.key()) != known.end(), UnsupportedError,
                 "the embedded control store does not implement field '{}' of {} (it serves what "
                 "EtcdStore sends; extend store_server.cpp for more)",
                 item.key(), what);
  }
  return j;
}

// A number field of a request (absent: 0).
int64_t integer(const json& j, const char* field) {
  const auto v = gateway_integer(j, field);
  TESSEL_CHECK(v.has_value(), InvalidArgumentError, "field '{}' is not an integer: {:.100}", field,
               text(j.at(field)));
  return *v;
}

bool flag(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return false;
  TESSEL_CHECK(it->is_boolean(), InvalidArgumentError, "field '{}' is not a boolean: {:.100}",
               field, text(*it));
  return it->get<bool>();
}

// A key or value: base64 in etcd's JSON (a bad one throws CorruptDataError, a bad request too).
std::string bytes(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return {};
  TESSEL_CHECK(it->is_string(), InvalidArgumentError, "field '{}' is not a base64 string: {:.100}",
               field, text(*it));
  return base64_decode(it->get<std::string>());
}

json header(int64_t revision) {
  return {{"revision", std::to_string(revision)}};
}

// Zero and empty fields are left out, as etcd's gateway does.
json kv_json(const KeyValue& kv) {
  json j = {{"key", base64_encode(kv.key)}, {"mod_revision", std::to_string(kv.revision)}};
  if (!kv.value.empty()) j["value"] = base64_encode(kv.value);
  if (kv.lease != 0) j["lease"] = std::to_string(kv.lease);
  return j;
}

json event_json(const WatchEvent& event) {
  json j = {{"kv", kv_json(event.kv)}};
  // PUT is the protocol's default type, which etcd leaves out.
  if (event.kind == WatchEvent::Kind::erase) j["type"] = "DELETE";
  return j;
}

void reply(httplib::Response& res, const json& body) {
  res.set_content(text(body), "application/json");
}

// etcd's error reply: the gRPC code and the HTTP status the gateway maps it to.
void error_reply(httplib::Response& res, int status, int code, const std::string& message) {
  res.status = status;
  reply(res, {{"error", message}, {"message", message}, {"code", code}});
}

// ---------------------------------------------------------------------------------------------
// Keys

// The keys [key, range_end) of a request, as etcd reads them: no range_end is the one key, a
// range_end of "\0" every key from `key` on.
struct KeyRange {
  std::string key, end;

  // What MemoryStore lists or watches to find them: every key under it, filtered by contains().
  std::string prefix() const {
    if (end.empty()) return key;
    if (end == std::string(1, '\0')) return {};
    size_t n = 0;
    while (n < key.size() && n < end.size() && key[n] == end[n]) ++n;
    return key.substr(0, n);
  }
  bool contains(const std::string& k) const {
    if (end.empty()) return k == key;
    return k >= key && (end == std::string(1, '\0') || k < end);
  }
};

KeyRange key_range(const json& request) {
  KeyRange range{bytes(request, "key"), bytes(request, "range_end")};
  TESSEL_CHECK(!range.key.empty(), InvalidArgumentError, "etcdserver: key is not provided");
  return range;
}

std::vector<KeyValue> read_range(MemoryStore& store, const KeyRange& range) {
  if (range.end.empty()) {
    auto kv = store.get(range.key);
    return kv ? std::vector<KeyValue>{*kv} : std::vector<KeyValue>{};
  }
  auto kvs = store.list(range.prefix());
  std::erase_if(kvs, [&](const KeyValue& kv) { return !range.contains(kv.key); });
  return kvs;
}

json range_reply(int64_t revision, const std::vector<KeyValue>& kvs, bool count_only) {
  json reply = {{"header", header(revision)}};
  if (kvs.empty()) return reply;
  if (!count_only) {
    json list = json::array();
    for (const auto& kv : kvs) list.push_back(kv_json(kv));
    reply["kvs"] = std::move(list);
  }
  reply["count"] = std::to_string(kvs.size());
  return reply;
}

// ---------------------------------------------------------------------------------------------
// Requests

void put(MemoryStore& store, const json& request, httplib::Response& res) {
  fields(request, "/v3/kv/put", {"key", "value", "lease"});
  const int64_t revision =
      store.set(bytes(request, "key"), bytes(request, "value"), integer(request, "lease"));
  reply(res, {{"header", header(revision)}});
}

void range(MemoryStore& store, const json& request, httplib::Response& res) {
  fields(request, "/v3/kv/range", {"key", "range_end", "count_only"});
  const KeyRange keys = key_range(request);
  // Read before the keys, so it never claims a change the keys do not show yet (see the header).
  const int64_t revision = store.revision();
  reply(res, range_reply(revision, read_range(store, keys), flag(request, "count_only")));
}

void delete_range(MemoryStore& store, const json& request, httplib::Response& res) {
  fields(request, "/v3/kv/deleterange", {"key"});
  const std::string key = bytes(request, "key");
  TESSEL_CHECK(!key.empty(), InvalidArgumentError, "etcdserver: key is not provided");
  const bool deleted = store.erase(key);
  json body = {{"header", header(store.revision())}};
  if (deleted) body["deleted"] = "1";
  reply(res, body);
}

// The one txn EtcdStore sends: compare a key's mod_revision, put it on success (MemoryStore's
// compare-and-set, atomic), read a key on failure (after the failed compare: the reader retries
// with what it read, so it need not be atomic with the compare).
void txn(MemoryStore& store, const json& request, httplib::Response& res) {
  static constexpr const char* kShape =
      "the embedded control store serves a txn of one MOD EQUAL compare, one put of the compared "
      "key on success and at most one range on failure (what EtcdStore sends)";
  fields(request, "/v3/kv/txn", {"compare", "success", "failure"});
  const json none = json::array();
  const json& compare = request.contains("compare") ? request["compare"] : none;
  const json& success = request.contains("success") ? request["success"] : none;
  const json& failure = request.contains("failure") ? request["failure"] : none;
  TESSEL_CHECK(compare.is_array() && compare.size() == 1 && success.is_array() &&
                   success.size() == 1 && failure.is_array() && failure.size() <= 1,
               UnsupportedError, "{}", kShape);
  const json& cmp =
      fields(compare[0], "a txn compare", {"key", "target", "result", "mod_revision"});
  // The gateway leaves out enum defaults: an absent result is EQUAL, an absent target VERSION.
  TESSEL_CHECK(cmp.value("target", "") == "MOD" && cmp.value("result", "EQUAL") == "EQUAL",
               UnsupportedError, "{}", kShape);
  const std::string key = bytes(cmp, "key");
  const int64_t expected = integer(cmp, "mod_revision");
  TESSEL_CHECK(fields(success[0], "a txn success", {"request_put"}).contains("request_put"),
               UnsupportedError, "{}", kShape);
  const json& put_request =
      fields(success[0]["request_put"], "a txn put", {"key", "value", "lease"});
  TESSEL_CHECK(bytes(put_request, "key") == key, UnsupportedError, "{}", kShape);
  std::optional<KeyRange> read;
  if (!failure.empty()) {
    TESSEL_CHECK(fields(failure[0], "a txn failure", {"request_range"}).contains("request_range"),
                 UnsupportedError, "{}", kShape);
    const json& range_request = failure[0]["request_range"];
    read = key_range(fields(range_request, "a txn range", {"key", "range_end"}));
  }

  if (auto revision = store.compare_and_set(key, expected, bytes(put_request, "value"),
                                            integer(put_request, "lease"))) {
    json put_reply = {{"response_put", {{"header", header(*revision)}}}};
    reply(res, {{"header", header(*revision)},
                {"succeeded", true},
                {"responses", json::array({std::move(put_reply)})}});
    return;
  }
  const int64_t revision = store.revision();
  json body = {{"header", header(revision)}};  // "succeeded": false is left out, as etcd does
  if (read) {
    json range_reply_json = {
        {"response_range", range_reply(revision, read_range(store, *read), false)}};
    body["responses"] = json::array({std::move(range_reply_json)});
  }
  reply(res, body);
}

void grant(MemoryStore& store, const json& request, httplib::Response& res) {
  fields(request, "/v3/lease/grant", {"TTL", "ID"});
  TESSEL_CHECK(integer(request, "ID") == 0, UnsupportedError,
               "the embedded control store chooses lease ids itself: leave ID out of "
               "/v3/lease/grant");
  // etcd raises a TTL below its minimum to the minimum: one second here.
  const int64_t seconds = std::max<int64_t>(1, integer(request, "TTL"));
  TESSEL_CHECK(seconds <= kMaxLeaseSeconds, InvalidArgumentError,
               "etcdserver: too large lease TTL");
  const LeaseId id = store.grant_lease(std::chrono::seconds(seconds));
  reply(res, {{"header", header(store.revision())},
              {"ID", std::to_string(id)},
              {"TTL", std::to_string(seconds)}});
}

// etcd's keepalive is a stream of {"result": ...} lines; one request gets one line.
void keep_alive(MemoryStore& store, const json& request, httplib::Response& res) {
  fields(request, "/v3/lease/keepalive", {"ID"});
  const LeaseId id = integer(request, "ID");
  json result = {{"header", header(store.revision())}, {"ID", std::to_string(id)}};
  try {
    store.keep_alive(id);
    if (auto ttl = store.lease_ttl(id)) {
      result["TTL"] = std::to_string(std::max<int64_t>(1, (ttl->count() + 999) / 1000));
    }
  } catch (const PeerLostError&) {
    // etcd answers the renewal of a dead lease with no TTL, not with an error.
  }
  res.set_content(text({{"result", result}}) + "\n", "application/json");
}

void revoke(MemoryStore& store, const json& request, httplib::Response& res) {
  fields(request, "/v3/kv/lease/revoke", {"ID"});
  const LeaseId id = integer(request, "ID");
  // etcd refuses a lease it does not know (a PeerLostError is answered as its "not found").
  TESSEL_CHECK(store.lease_ttl(id).has_value(), PeerLostError,
               "control store: lease {} has expired or was revoked", id);
  store.revoke(id);
  reply(res, {{"header", header(store.revision())}});
}

// ---------------------------------------------------------------------------------------------
// Watches

struct WatchStream {
  KeyRange keys;
  std::string prefix;  // keys.prefix()
  int64_t after = 0;   // the changes up to here were sent
  bool created = false;
};

bool write_line(httplib::DataSink& sink, const json& message) {
  const std::string line = text(message) + "\n";
  return sink.write(line.data(), line.size());
}

// One step of a watch stream: the acknowledgement first, then a batch of the changes after
// stream.after, or after kWatchPoll of quiet a newline (a failed write is how a client that went
// away is noticed; httplib checks for shutdown between steps). False ends the stream.
bool watch_step(MemoryStore& store, WatchStream& stream, httplib::DataSink& sink) noexcept {
  try {
    if (!stream.created) {
      stream.created = true;
      return write_line(sink,
                        {{"result", {{"header", header(store.revision())}, {"created", true}}}});
    }
    WatchResult r;
    try {
      r = store.watch(stream.prefix, stream.after, StoreServer::kWatchPoll);
    } catch (const CorruptDataError&) {
      // etcd cancels a watch behind its history, naming the oldest revision it could start from.
      const json result = {{"header", header(store.revision())},
                           {"canceled", true},
                           {"compact_revision", std::to_string(store.compacted_revision() + 1)}};
      const bool written = write_line(sink, {{"result", result}});
      sink.done();
      return written;
    }
    stream.after = std::max(stream.after, r.revision);
    json events = json::array();
    for (const auto& event : r.events) {
      if (stream.keys.contains(event.kv.key)) events.push_back(event_json(event));
    }
    if (events.empty()) return sink.write("\n", 1);
    return write_line(sink,
                      {{"result", {{"header", header(store.revision())}, {"events", events}}}});
  } catch (...) {
    // An exception would escape httplib's writer and end the process; the client sees its stream
    // end early instead.
    return false;
  }
}

void watch(const std::shared_ptr<MemoryStore>& store, const json& request, httplib::Response& res) {
  fields(request, "/v3/watch", {"create_request"});
  TESSEL_CHECK(request.contains("create_request"), UnsupportedError,
               "the embedded control store's /v3/watch serves one create_request per stream");
  const json& create = fields(request["create_request"], "a watch create_request",
                              {"key", "range_end", "start_revision"});
  auto stream = std::make_shared<WatchStream>();
  stream->keys = key_range(create);
  stream->prefix = stream->keys.prefix();
  const int64_t start = integer(create, "start_revision");
  stream->after = start > 0 ? start - 1 : store->revision();  // no start: from now on
  res.set_chunked_content_provider("application/json",
                                   [store, stream](size_t, httplib::DataSink& sink) {
                                     return watch_step(*store, *stream, sink);
                                   });
}

// A handler for one path: parses the body and answers errors the way etcd's gateway does.
template <typename Serve>
httplib::Server::Handler etcd_handler(Serve serve) {
  return [serve = std::move(serve)](const httplib::Request& req, httplib::Response& res) {
    try {
      serve(json::parse(req.body), res);
    } catch (const PeerLostError&) {
      // MemoryStore throws it only for a lease that expired or was revoked.
      error_reply(res, 404, 5, "etcdserver: requested lease not found");
    } catch (const UnsupportedError& e) {
      error_reply(res, 501, 12, e.what());
    } catch (const InvalidArgumentError& e) {
      error_reply(res, 400, 3, e.what());
    } catch (const CorruptDataError& e) {
      error_reply(res, 400, 3, e.what());
    } catch (const json::exception& e) {
      error_reply(res, 400, 3, e.what());
    } catch (const std::exception& e) {
      error_reply(res, 500, 13, e.what());
    }
  };
}

}  // namespace

StoreServer::StoreServer(std::shared_ptr<MemoryStore> store, std::string host, int port)
    : store_(std::move(store)), host_(std::move(host)) {
  TESSEL_CHECK(store_ != nullptr, InvalidArgumentError, "StoreServer: no store to serve");
  TESSEL_CHECK(port >= 0 && port <= 65535, ConfigError,
               "control store server port {} is outside [0, 65535] (0: any free port)", port);
  auto server = std::make_unique<HttpServer>();
  server->new_task_queue = [] { return new WorkerPool(kMaxThreads); };
  server->set_keep_alive_max_count(1);  // one request per connection: see the header
  server->set_keep_alive_timeout(kRequestWaitSeconds);
  server->set_read_timeout(kIoTimeout);
  server->set_write_timeout(kIoTimeout);
  server->set_payload_max_length(kMaxRequestBytes);
  // A reply's headers and body go out in separate writes: with Nagle's algorithm the body would
  // wait for the client's delayed ACK (40 ms on Linux).
  server->set_tcp_nodelay(true);
  // httplib's default sets SO_REUSEPORT, with which a second server on this port would share the
  // connections of the first (two jobs' stores mixed) instead of failing to listen. SO_REUSEADDR
  // only lets a restarted server take its port back from connections still in TIME_WAIT.
  // Close-on-exec: a program this process starts must not hold the port after it stopped.
  server->set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    ::fcntl(sock, F_SETFD, FD_CLOEXEC);
  });

  MemoryStore& s = *store_;
  using Response = httplib::Response;
  server->Post("/v3/kv/put", etcd_handler([&s](const json& r, Response& res) { put(s, r, res); }));
  server->Post("/v3/kv/range",
               etcd_handler([&s](const json& r, Response& res) { range(s, r, res); }));
  server->Post("/v3/kv/deleterange",
               etcd_handler([&s](const json& r, Response& res) { delete_range(s, r, res); }));
  server->Post("/v3/kv/txn", etcd_handler([&s](const json& r, Response& res) { txn(s, r, res); }));
  server->Post("/v3/lease/grant",
               etcd_handler([&s](const json& r, Response& res) { grant(s, r, res); }));
  server->Post("/v3/lease/keepalive",
               etcd_handler([&s](const json& r, Response& res) { keep_alive(s, r, res); }));
  server->Post("/v3/kv/lease/revoke",
               etcd_handler([&s](const json& r, Response& res) { revoke(s, r, res); }));
  server->Post("/v3/watch", etcd_handler([store = store_](const json& r, Response& res) {
                 watch(store, r, res);
               }));
  server->Post(".*", [](const httplib::Request& req, Response& res) {
    error_reply(res, 501, 12,
                "the embedded control store does not serve POST " + req.path +
                    " (it serves the part of etcd's gateway that EtcdStore uses)");
  });

  port_ =
      port == 0 ? server->bind_to_any_port(host_) : (server->bind_to_port(host_, port) ? port : -1);
  TESSEL_CHECK(port_ > 0, IoError,
               "the control store server cannot listen on {}:{} (in use, or not an address of "
               "this host): choose another host or port",
               host_, port);
  // Best effort: at the default backlog the server still serves, only bursts wait longer.
  (void)server->raise_backlog(kListenBacklog);
  server_ = std::move(server);
  auto ended = std::make_shared<std::atomic<bool>>(false);
  listener_ = std::thread([this, ended] {
    server_->listen_after_bind();
    *ended = true;
  });
  // stop() leaves a server that is not running yet alone, and the destructor must not miss it.
  while (!server_->is_running() && !*ended) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

StoreServer::~StoreServer() {
  server_->stop();
  listener_.join();
}

std::string StoreServer::endpoint() const {
  return "http://" + host_ + ":" + std::to_string(port_);
}

MemoryStore& StoreServer::store() {
  return *store_;
}

}  // namespace tessel::comm
