#include "tessel/comm/store_server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/comm/etcd_json.h"
#include "tessel/core/base64.h"
#include "tessel/core/check.h"
#include "tessel/net/guarded_server.h"

namespace tessel::comm {
namespace {

using json = nlohmann::json;

// etcd's largest lease TTL, in seconds (it refuses longer ones).
constexpr int64_t kMaxLeaseSeconds = 9'000'000'000;

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
  std::chrono::steady_clock::time_point last_write;
};

// How often a quiet watch looks whether its client closed its end: a watch whose client left
// must give its thread and its place under the cap back soon, as EtcdStore leaves after each
// batch.
constexpr std::chrono::milliseconds kLivenessPoll{5};

bool write_line(httplib::DataSink& sink, const json& message) {
  const std::string line = text(message) + "\n";
  return sink.write(line.data(), line.size());
}

// One step of a watch stream: the acknowledgement first, then a batch of the changes after
// stream.after, or after kWatchPoll of quiet a newline (a failed write is how a client that went
// away without closing is noticed; httplib checks for shutdown between steps). False ends the
// stream.
bool watch_step(MemoryStore& store, WatchStream& stream, httplib::DataSink& sink) noexcept {
  try {
    const auto now = std::chrono::steady_clock::now();
    if (!stream.created) {
      stream.created = true;
      stream.last_write = now;
      return write_line(sink,
                        {{"result", {{"header", header(store.revision())}, {"created", true}}}});
    }
    // A client that closed its end is seen at once (GuardedServer's is_writable looks), so its
    // watch frees its thread and its place under the cap before the next keep-alive write.
    if (!sink.is_writable()) return false;
    WatchResult r;
    try {
      r = store.watch(stream.prefix, stream.after, kLivenessPoll);
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
    if (events.empty()) {
      if (now - stream.last_write < StoreServer::kWatchPoll) return true;
      stream.last_write = now;
      return sink.write("\n", 1);
    }
    stream.last_write = now;
    return write_line(sink,
                      {{"result", {{"header", header(store.revision())}, {"events", events}}}});
  } catch (...) {
    // An exception would escape httplib's writer and end the process; the client sees its stream
    // end early instead.
    return false;
  }
}

void watch(const std::shared_ptr<MemoryStore>& store,
           const std::shared_ptr<std::atomic<size_t>>& watches, size_t max_watches,
           const json& request, httplib::Response& res) {
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
  // Each open watch holds a worker thread; past the cap a watch is refused (etcd's
  // RESOURCE_EXHAUSTED) so the other requests always find a thread.
  if (watches->fetch_add(1) >= max_watches) {
    --*watches;
    error_reply(res, 429, 8,
                "etcdserver: too many open watches (" + std::to_string(max_watches) +
                    "); close some, or raise StoreServerOptions::max_watches");
    return;
  }
  res.set_chunked_content_provider(
      "application/json",
      [store, stream](size_t, httplib::DataSink& sink) {
        return watch_step(*store, *stream, sink);
      },
      [watches](bool) { --*watches; });
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

namespace {

StoreServerOptions at(std::string host, int port) {
  StoreServerOptions o;
  o.host = std::move(host);
  o.port = port;
  return o;
}

}  // namespace

net::ServerLimits control_store_limits() {
  net::ServerLimits limits;
  // Control-plane values are small; etcd itself refuses requests over 1.5 MiB.
  limits.max_body_bytes = size_t(2) << 20;
  limits.threads = StoreServer::kMaxThreads;
  // The processes of a job on one host all connect from loopback: one address holds them all.
  limits.max_connections = 512;
  limits.max_connections_per_client = 512;
  return limits;
}

StoreServer::StoreServer(std::shared_ptr<MemoryStore> store, std::string host, int port)
    : StoreServer(std::move(store), at(std::move(host), port)) {}

StoreServer::StoreServer(std::shared_ptr<MemoryStore> store, StoreServerOptions options)
    : store_(std::move(store)) {
  TESSEL_CHECK(store_ != nullptr, InvalidArgumentError, "StoreServer: no store to serve");
  TESSEL_CHECK(options.port >= 0 && options.port <= 65535, ConfigError,
               "control store server port {} is outside [0, 65535] (0: any free port)",
               options.port);
  TESSEL_CHECK(options.max_watches > 0 && options.max_watches < options.limits.threads, ConfigError,
               "the control store's max_watches ({}) must be positive and below its threads ({}): "
               "each watch holds a thread, and the other requests need one",
               options.max_watches, options.limits.threads);
  net::ServerOptions so;
  so.name = "the embedded control store";
  so.host = options.host;
  so.port = options.port;
  so.token_file = options.token_file;
  so.token_hint = "a token file (StoreServerOptions::token_file)";
  so.limits = options.limits;
  // One request per connection: see the header.
  so.limits.max_requests_per_connection = 1;
  // The gate's answers in etcd's error shape, so EtcdStore reports their message.
  so.error_body = [](int status, const std::string& message) {
    const int code = status == 401 ? 16 : status == 408 ? 4 : status == 503 ? 14 : 8;
    return text({{"error", message}, {"message", message}, {"code", code}});
  };
  server_ = std::make_unique<net::GuardedServer>(std::move(so));
  auto& server = *server_;

  MemoryStore& s = *store_;
  using Response = httplib::Response;
  server.Post("/v3/kv/put", etcd_handler([&s](const json& r, Response& res) { put(s, r, res); }));
  server.Post("/v3/kv/range",
              etcd_handler([&s](const json& r, Response& res) { range(s, r, res); }));
  server.Post("/v3/kv/deleterange",
              etcd_handler([&s](const json& r, Response& res) { delete_range(s, r, res); }));
  server.Post("/v3/kv/txn", etcd_handler([&s](const json& r, Response& res) { txn(s, r, res); }));
  server.Post("/v3/lease/grant",
              etcd_handler([&s](const json& r, Response& res) { grant(s, r, res); }));
  server.Post("/v3/lease/keepalive",
              etcd_handler([&s](const json& r, Response& res) { keep_alive(s, r, res); }));
  server.Post("/v3/kv/lease/revoke",
              etcd_handler([&s](const json& r, Response& res) { revoke(s, r, res); }));
  auto watches = std::make_shared<std::atomic<size_t>>(0);
  server.Post("/v3/watch", etcd_handler([store = store_, watches, max = options.max_watches](
                                            const json& r, Response& res) {
                watch(store, watches, max, r, res);
              }));
  server.Post(".*", [](const httplib::Request& req, Response& res) {
    error_reply(res, 501, 12,
                "the embedded control store does not serve POST " + req.path +
                    " (it serves the part of etcd's gateway that EtcdStore uses)");
  });
  server.start();
}

StoreServer::~StoreServer() {
  server_->stop();
}

std::string StoreServer::endpoint() const {
  const std::string& host = server_->host();
  const bool v6 = host.find(':') != std::string::npos;
  return "http://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(server_->port());
}

bool StoreServer::requires_token() const {
  return server_->requires_token();
}

MemoryStore& StoreServer::store() {
  return *store_;
}

}  // namespace tessel::comm
