#include "tessel/comm/etcd_store.h"

#include <httplib.h>

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <thread>

#include "tessel/comm/etcd_json.h"
#include "tessel/core/base64.h"
#include "tessel/core/check.h"
#include "tessel/net/bearer_token.h"

namespace tessel::comm {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A number field of a reply (etcd omits fields that are zero).
int64_t number(const json& j, const char* field) {
  const auto v = gateway_integer(j, field);
  TESSEL_CHECK(v.has_value(), CorruptDataError, "etcd: field '{}' is not a number: {}", field,
               j.at(field).dump());
  return *v;
}

json parse(const std::string& text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const json::exception&) {
    // Something else answers there (a web server's error page): one line of it names it.
    std::string start;
    for (char c : text.substr(0, 400)) {
      const bool space = c == '\n' || c == '\r' || c == '\t' || c == ' ';
      if (space && (start.empty() || start.back() == ' ')) continue;
      start += space ? ' ' : c;
    }
    TESSEL_THROW(CorruptDataError,
                 "etcd: the reply to {} is not JSON, so what answers is not etcd's v3 gateway: "
                 "{:.120}",
                 what, start);
  }
}

// The end of etcd's key range holding every key that starts with `prefix`: the prefix with its
// last byte incremented (trailing 0xff bytes dropped first). "\0" means "to the end of keyspace".
std::string prefix_end(std::string prefix) {
  while (!prefix.empty() && static_cast<unsigned char>(prefix.back()) == 0xff) prefix.pop_back();
  if (prefix.empty()) return std::string(1, '\0');
  prefix.back() = static_cast<char>(static_cast<unsigned char>(prefix.back()) + 1);
  return prefix;
}

// A range request over every key under `prefix` (etcd refuses an empty key: "\0" is the first).
json prefix_range(const std::string& prefix) {
  return {{"key", base64_encode(prefix.empty() ? std::string(1, '\0') : prefix)},
          {"range_end", base64_encode(prefix_end(prefix))}};
}

KeyValue key_value(const json& kv) {
  KeyValue out;
  out.key = base64_decode(kv.value("key", ""));
  out.value = base64_decode(kv.value("value", ""));
  out.revision = number(kv, "mod_revision");
  out.lease = number(kv, "lease");
  return out;
}

std::string error_message(const json& j) {
  if (j.contains("message") && j["message"].is_string()) return j["message"].get<std::string>();
  if (j.contains("error")) {
    const json& e = j["error"];
    if (e.is_string()) return e.get<std::string>();
    if (e.is_object() && e.contains("message")) return e["message"].dump();
    return e.dump();
  }
  return j.dump();
}

bool is_lease_not_found(const std::string& message) {
  return message.find("requested lease not found") != std::string::npos;
}

json put_request(const std::string& key, const std::string& value, LeaseId lease) {
  json put = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  return put;
}

std::string common_prefix(const std::vector<std::string>& keys) {
  if (keys.empty()) return {};
  std::string prefix = keys.front();
  for (const auto& k : keys) {
    size_t n = 0;
    while (n < prefix.size() && n < k.size() && prefix[n] == k[n]) ++n;
    prefix.resize(n);
  }
  return prefix;
}

}  // namespace

struct EtcdStore::Reply {
  int status = 0;
  std::string body;
};

namespace {

EtcdStoreOptions from_environment(milliseconds timeout) {
  EtcdStoreOptions options;
  options.timeout = timeout;
  if (const char* file = std::getenv(kControlTokenFileEnv); file && *file) {
    options.token_file = file;
  }
  return options;
}

}  // namespace

EtcdStore::EtcdStore(std::string endpoint, milliseconds timeout)
    : EtcdStore(std::move(endpoint), from_environment(timeout)) {}

EtcdStore::EtcdStore(std::string endpoint, EtcdStoreOptions options)
    : endpoint_(std::move(endpoint)), timeout_(options.timeout) {
  // Plain HTTP only for now: TLS to etcd (certificates, client auth) is not configured anywhere.
  TESSEL_CHECK(endpoint_.rfind("http://", 0) == 0, ConfigError,
               "etcd endpoint '{}' must look like http://host:port", endpoint_);
  TESSEL_CHECK(timeout_.count() > 0, ConfigError, "etcd operation timeout must be positive");
  if (!options.token_file.empty()) {
    token_ = net::read_token_file(options.token_file, "the control store client of " + endpoint_);
  }
}

EtcdStore::~EtcdStore() = default;

std::unique_ptr<httplib::Client> EtcdStore::make_client(milliseconds read_timeout) const {
  auto client = std::make_unique<httplib::Client>(endpoint_);
  client->set_connection_timeout(timeout_);
  client->set_read_timeout(read_timeout);
  client->set_write_timeout(timeout_);
  client->set_keep_alive(true);
  if (!token_.empty()) client->set_bearer_token_auth(token_);
  // Headers and body go out in separate writes: with Nagle's algorithm the body would wait for
  // the server's delayed ACK (40 ms on Linux) on every request.
  client->set_tcp_nodelay(true);
  return client;
}

EtcdStore::Reply EtcdStore::post(const std::string& path, const std::string& body, bool reuse) {
  std::unique_ptr<httplib::Client> client;
  if (reuse) {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      client = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  if (!client) client = make_client(timeout_);
  // The reply is collected as it arrives because etcd's gateway ends an error reply with HTTP
  // trailers, which cpp-httplib 0.11 cannot parse: the request then fails after the whole body
  // came, and the body is etcd's error.
  Reply reply;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& response) {
    reply.status = response.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    reply.body.append(data, size);
    return true;
  };
  const auto start = Clock::now();
  auto res = client->send(req);
  if (!res) {
    const auto err = res.error();
    if (err == httplib::Error::Read && reply.status > 0 && json::accept(reply.body)) return reply;
    if (err == httplib::Error::Read || err == httplib::Error::Write) {
      TESSEL_THROW(PeerLostError,
                   "etcd at {} did not answer POST {} ({} error after {} ms; the limit is {} ms): "
                   "check that etcd runs there and is healthy",
                   endpoint_, path, httplib::to_string(err),
                   std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(),
                   timeout_.count());
    }
    TESSEL_THROW(PeerLostError, "cannot reach etcd at {} ({}): check that etcd runs there",
                 endpoint_, httplib::to_string(err));
  }
  reply.status = res->status;
  if (reuse) {
    std::lock_guard lock(mu_);
    idle_.push_back(std::move(client));
  }
  return reply;
}

std::string EtcdStore::call(const std::string& path, const std::string& body, bool reuse) {
  Reply reply = post(path, body, reuse);
  // Unary calls fail with an HTTP error; streamed ones (keepalive) with an "error" object.
  if (reply.status == 200 && reply.body.find("\"error\"") == std::string::npos) return reply.body;
  const json doc = parse(reply.body, "POST " + path);
  if (reply.status == 200 && !doc.contains("error")) return reply.body;
  const std::string message = error_message(doc);
  // A put on an expired lease: the lease's holder has been declared dead, as the interface says.
  if (is_lease_not_found(message)) {
    TESSEL_THROW(PeerLostError, "etcd at {}: {} (the lease has expired or was revoked)", endpoint_,
                 message);
  }
  TESSEL_THROW(IoError, "etcd at {} refused POST {} (HTTP {}): {}", endpoint_, path, reply.status,
               message);
}

int64_t EtcdStore::set(const std::string& key, const std::string& value, LeaseId lease) {
  const json reply = parse(call("/v3/kv/put", put_request(key, value, lease).dump()), "put");
  return number(reply.at("header"), "revision");
}

std::optional<KeyValue> EtcdStore::get(const std::string& key) {
  const json reply = parse(call("/v3/kv/range", json{{"key", base64_encode(key)}}.dump()), "range");
  if (!reply.contains("kvs") || reply["kvs"].empty()) return std::nullopt;
  return key_value(reply["kvs"][0]);
}

std::optional<int64_t> EtcdStore::compare_and_set(const std::string& key, int64_t expected_revision,
                                                  const std::string& value, LeaseId lease) {
  // etcd compares a missing key's mod_revision as 0, which is what expected_revision 0 means.
  const json txn = {{"compare",
                     {{{"key", base64_encode(key)},
                       {"target", "MOD"},
                       {"result", "EQUAL"},
                       {"mod_revision", std::to_string(expected_revision)}}}},
                    {"success", {{{"request_put", put_request(key, value, lease)}}}}};
  const json reply = parse(call("/v3/kv/txn", txn.dump()), "txn");
  if (!reply.value("succeeded", false)) return std::nullopt;
  return number(reply.at("header"), "revision");
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  // etcd has no arithmetic: read, then write only if nobody wrote in between. A lost race returns
  // the key as it is now (the txn's failure branch), so each retry costs one round trip.
  std::optional<KeyValue> current = get(key);
  const auto deadline = Clock::now() + timeout_;
  for (;;) {
    const int64_t value = (current ? parse_counter(key, current->value) : 0) + delta;
    const json txn = {{"compare",
                       {{{"key", base64_encode(key)},
                         {"target", "MOD"},
                         {"result", "EQUAL"},
                         {"mod_revision", std::to_string(current ? current->revision : 0)}}}},
                      {"success",
                       {{{"request_put",
                          put_request(key, std::to_string(value), current ? current->lease : 0)}}}},
                      {"failure", {{{"request_range", {{"key", base64_encode(key)}}}}}}};
    const json reply = parse(call("/v3/kv/txn", txn.dump()), "txn");
    if (reply.value("succeeded", false)) return value;
    TESSEL_CHECK(Clock::now() < deadline, TimeoutError,
                 "control store: add to '{}' lost every race against other writers for {} ms", key,
                 timeout_.count());
    current.reset();
    const json& range = reply.at("responses").at(0).at("response_range");
    if (range.contains("kvs") && !range["kvs"].empty()) current = key_value(range["kvs"][0]);
  }
}

bool EtcdStore::erase(const std::string& key) {
  const json reply =
      parse(call("/v3/kv/deleterange", json{{"key", base64_encode(key)}}.dump()), "deleterange");
  return number(reply, "deleted") > 0;
}

std::vector<KeyValue> EtcdStore::list(const std::string& prefix) {
  const json reply = parse(call("/v3/kv/range", prefix_range(prefix).dump()), "range");
  std::vector<KeyValue> out;
  if (reply.contains("kvs")) {
    for (const auto& kv : reply["kvs"]) out.push_back(key_value(kv));
  }
  return out;
}

int64_t EtcdStore::revision() {
  // Any range reply carries the store's revision in its header; count_only skips the data.
  const json request = {{"key", base64_encode(std::string(1, '\0'))}, {"count_only", true}};
  const json reply = parse(call("/v3/kv/range", request.dump()), "range");
  return number(reply.at("header"), "revision");
}

void EtcdStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    // Every key created after the first read's revision is a change a watch from it reports, so
    // none can be missed between the reads and the watch.
    int64_t since = -1;
    std::vector<std::string> missing;
    for (const auto& key : keys) {
      const json reply =
          parse(call("/v3/kv/range", json{{"key", base64_encode(key)}}.dump()), "range");
      if (since < 0) since = number(reply.at("header"), "revision");
      if (!reply.contains("kvs") || reply["kvs"].empty()) missing.push_back(key);
    }
    if (missing.empty()) return;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      std::string names;
      for (const auto& k : missing) names += (names.empty() ? "'" : ", '") + k + "'";
      TESSEL_THROW(TimeoutError, "control store (etcd at {}): still missing after {} ms: {}",
                   endpoint_, timeout.count(), names);
    }
    try {
      watch(common_prefix(missing), since, left);
    } catch (const CorruptDataError&) {
      // The history after `since` was compacted meanwhile: reading the keys again is enough.
    }
  }
}

WatchResult EtcdStore::watch(const std::string& prefix, int64_t after, milliseconds timeout) {
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  json create = prefix_range(prefix);
  create["start_revision"] = std::to_string(after + 1);
  const std::string body = json{{"create_request", create}}.dump();

  // The gateway streams one JSON object per line: the "created" acknowledgement, then event
  // batches (or a cancellation). The first batch is the answer; the stream is then abandoned.
  WatchResult result;
  result.revision = after;
  int64_t compacted = 0;
  std::string error, buffer;
  bool done = false;
  auto handle = [&](const std::string& line) {
    const json msg = parse(line, "watch");
    if (msg.contains("error")) {
      error = error_message(msg);
      return false;
    }
    const json& r = msg.value("result", json::object());
    if ((compacted = number(r, "compact_revision")) > 0) return false;
    if (r.value("canceled", false)) {
      error = "watch canceled: " + r.value("cancel_reason", std::string("no reason given"));
      return false;
    }
    if (r.contains("events")) {
      for (const auto& e : r["events"]) {
        WatchEvent event;
        event.kind =
            e.value("type", "PUT") == "DELETE" ? WatchEvent::Kind::erase : WatchEvent::Kind::put;
        event.kv = key_value(e.at("kv"));
        result.events.push_back(std::move(event));
      }
    }
    return result.events.empty();
  };

  httplib::Request req;
  req.method = "POST";
  req.path = "/v3/watch";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    buffer.append(data, size);
    for (size_t nl; (nl = buffer.find('\n')) != std::string::npos;) {
      const std::string line = buffer.substr(0, nl);
      buffer.erase(0, nl + 1);
      if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
      if (!handle(line)) {
        done = true;
        return false;
      }
    }
    return Clock::now() < deadline;
  };
  // Waiting for events is a read on an idle stream: bounded by what is left of `timeout`.
  auto client = make_client(std::max(timeout, milliseconds(1)));
  auto res = client->send(req);
  if (compacted > 0) {
    TESSEL_THROW(CorruptDataError,
                 "etcd at {} has compacted its history up to revision {}: the changes under '{}' "
                 "after revision {} are gone; re-read them with list()",
                 endpoint_, compacted, prefix, after);
  }
  if (!error.empty()) TESSEL_THROW(IoError, "etcd at {} refused the watch: {}", endpoint_, error);
  if (!result.events.empty()) {
    result.revision = result.events.back().kv.revision;
    return result;
  }
  if (!res && !done) {
    const auto err = res.error();
    if (err == httplib::Error::Connection || err == httplib::Error::ConnectionTimeout) {
      TESSEL_THROW(PeerLostError, "cannot reach etcd at {} ({}): check that etcd runs there",
                   endpoint_, httplib::to_string(err));
    }
    // A read that timed out is the normal end of a quiet watch; a stream that ended early is not.
    if (Clock::now() + milliseconds(5) < deadline) {
      TESSEL_THROW(PeerLostError, "etcd at {} closed the watch stream early ({})", endpoint_,
                   httplib::to_string(err));
    }
  } else if (res && res->status != 200) {
    // The reply went to the content receiver: what it did not take as lines is the error.
    TESSEL_THROW(IoError, "etcd at {} refused the watch (HTTP {}): {}", endpoint_, res->status,
                 res->body.empty() ? buffer : res->body);
  }
  // No event came. The gateway offers no progress notification here, and etcd delivers the
  // history of a watch that starts in the past asynchronously, so silence does not prove that
  // nothing changed up to the current revision: the caller asks again from `after`, which never
  // skips a change.
  return result;
}

LeaseId EtcdStore::grant_lease(milliseconds ttl) {
  // etcd's TTLs are whole seconds; rounding up never expires a lease earlier than asked.
  const int64_t seconds = std::max<int64_t>(1, (ttl.count() + 999) / 1000);
  const json reply =
      parse(call("/v3/lease/grant", json{{"TTL", std::to_string(seconds)}}.dump()), "grant");
  const LeaseId id = number(reply, "ID");
  TESSEL_CHECK(id != 0, CorruptDataError, "etcd at {} granted no lease: {}", endpoint_,
               reply.dump());
  return id;
}

void EtcdStore::keep_alive(LeaseId lease) {
  // A stream on etcd's side: the gateway leaves its connection unfit for another request.
  const json reply = parse(
      call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump(), false), "keepalive");
  // etcd answers a renewal of an expired lease with no TTL rather than an error.
  TESSEL_CHECK(number(reply.value("result", json::object()), "TTL") > 0, PeerLostError,
               "etcd at {}: lease {} has expired (its keys are gone)", endpoint_, lease);
}

void EtcdStore::revoke(LeaseId lease) {
  // etcd 3.4's gateway serves revoke under /v3/kv/lease/revoke (/v3/lease/revoke is 3.5's).
  try {
    call("/v3/kv/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  } catch (const PeerLostError& e) {
    if (!is_lease_not_found(e.what())) throw;
  }
}

}  // namespace tessel::comm
