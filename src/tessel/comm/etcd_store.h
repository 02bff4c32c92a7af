// EtcdStore: the control store (control_store.h) on an etcd v3 server, through etcd's JSON
// gateway (POST /v3/kv/..., /v3/lease/..., /v3/watch) over plain HTTP, or over TLS with the
// server's certificate verified and, when etcd asks for one (--client-cert-auth), a client
// certificate. It is what the processes of a multi-host job share: revisions are etcd's
// mod_revision, compare-and-set is a txn on it, and leases are etcd's leases (whole seconds; etcd
// erases their keys when they expire).
//
// Thread-safe: calls from several threads run on separate connections. Every HTTP call is bounded
// by the operation timeout given to the constructor; watch() and wait() by their own.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/comm/control_store.h"

namespace httplib {
class Client;
}

namespace tessel::comm {

// The environment variable naming the token file of a guarded embedded control store, for the
// EtcdStores a process makes without options (docs/security.md).
inline constexpr const char* kControlTokenFileEnv = "TESSEL_CONTROL_TOKEN_FILE";
// The environment variables giving the TLS files of EtcdStoreOptions (ca_file, cert_file,
// key_file) to the EtcdStores a process makes without options, for https:// endpoints only: one
// setting serves `tessel agent`, the workers it starts and `tessel train --cluster`
// (docs/security.md, "etcd over TLS").
inline constexpr const char* kEtcdCaEnv = "TESSEL_ETCD_CA";
inline constexpr const char* kEtcdCertEnv = "TESSEL_ETCD_CERT";
inline constexpr const char* kEtcdKeyEnv = "TESSEL_ETCD_KEY";

// Whether `url` is an endpoint EtcdStore takes: "http://host:port" or "https://host:port" (the
// port may be left out: 80 and 443; an IPv6 address in brackets; nothing after the port).
bool is_etcd_endpoint(std::string_view url);

struct EtcdStoreOptions {
  // Bounds every HTTP call (watch() and wait() have their own).
  std::chrono::milliseconds timeout = std::chrono::seconds(10);
  // A file holding the token of a StoreServer started with one (net/bearer_token.h): every
  // request then carries "Authorization: Bearer <token>". Empty: no token.
  std::string token_file{};

  // TLS, for https:// endpoints (given with an http:// endpoint, they are a ConfigError).
  // The CA certificate(s), PEM, that etcd's certificate (its --cert-file) must be signed by;
  // required for https://. Only these are trusted, not the system's CAs, and the endpoint's host
  // must be named by the certificate (its subjectAltName, as cpp-httplib checks).
  std::string ca_file{};
  // This client's certificate and its private key, PEM, both or neither: what etcd started with
  // --client-cert-auth asks for (signed by the CA of its --trusted-ca-file). The key file must be
  // private to its owner, like a token file (chmod 600), and not encrypted.
  std::string cert_file{};
  std::string key_file{};
  // (Every member has an initializer, so designated initializers may leave any of them out.)
};

class EtcdStore final : public ControlStore {
 public:
  // `endpoint`: etcd's client URL, "http://host:port" or "https://host:port" (is_etcd_endpoint).
  // Connecting is lazy: the first call throws PeerLostError when nothing answers there, or when
  // the TLS handshake fails (the message says which side refused what, and which file to check).
  // Throws ConfigError for a malformed endpoint; a token file that cannot be read or that others
  // can read; for https:// no CA file, a certificate without its key or a key without its
  // certificate; a TLS file that cannot be read or is not PEM of the right kind (naming it), a
  // key that others can read or that does not belong to the certificate; TLS files for http://.
  EtcdStore(std::string endpoint, EtcdStoreOptions options);
  // As above, with the token file named by $TESSEL_CONTROL_TOKEN_FILE when it is set, and for an
  // https:// endpoint the TLS files named by $TESSEL_ETCD_CA, $TESSEL_ETCD_CERT and
  // $TESSEL_ETCD_KEY (ignored for http://: the embedded control store is plain HTTP on loopback).
  explicit EtcdStore(std::string endpoint,
                     std::chrono::milliseconds timeout = std::chrono::seconds(10));
  ~EtcdStore() override;

  int64_t set(const std::string& key, const std::string& value, LeaseId lease = 0) override;
  std::optional<KeyValue> get(const std::string& key) override;
  std::optional<int64_t> compare_and_set(const std::string& key, int64_t expected_revision,
                                         const std::string& value, LeaseId lease = 0) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool erase(const std::string& key) override;
  std::vector<KeyValue> list(const std::string& prefix) override;
  int64_t revision() override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  WatchResult watch(const std::string& prefix, int64_t after,
                    std::chrono::milliseconds timeout) override;
  LeaseId grant_lease(std::chrono::milliseconds ttl) override;
  void keep_alive(LeaseId lease) override;
  void revoke(LeaseId lease) override;

  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Reply;
  // Deletes a client with SIGPIPE held off (closing a TLS connection writes to it).
  struct ClientDeleter {
    void operator()(httplib::Client* client) const;
  };
  using ClientPtr = std::unique_ptr<httplib::Client, ClientDeleter>;

  // `environment`: the options came from the environment (messages name its variables).
  EtcdStore(std::string endpoint, EtcdStoreOptions options, bool environment);
  // POSTs `body` (JSON text) to `path`, on an idle connection when `reuse` (else on a new one,
  // closed afterwards); throws PeerLostError when etcd cannot be reached.
  Reply post(const std::string& path, const std::string& body, bool reuse = true);
  // post() that also throws on an HTTP or etcd error; returns the reply's JSON text.
  std::string call(const std::string& path, const std::string& body, bool reuse = true);
  ClientPtr make_client(std::chrono::milliseconds read_timeout) const;
  // For a request that failed with `error` (an httplib::Error) without a reply: throws the
  // PeerLostError that says what went wrong when it was TLS -- a failed handshake, a certificate
  // refused by either side -- or when this http:// endpoint turns out to serve TLS (`closed`: the
  // connection was closed before a byte came back); returns otherwise.
  void throw_if_tls_failure(const httplib::Client& client, int error, bool closed) const;
  // Sends GET /health on a new TLS connection to host:port and returns the alert the server sent
  // (-1: none); *speaks_tls says whether it answered TLS at all. `configured`: with this store's
  // CA, certificate and key, in TLS 1.2 at most, where the server judges the client's certificate
  // inside the handshake, so that its alert is read for sure (in TLS 1.3 the verdict comes after
  // the client's side of the handshake, and a request's write that meets the connection closed
  // by it loses the alert). Else verifying nothing: whether an http:// endpoint serves TLS.
  int probe_tls(bool configured, bool* speaks_tls) const;

  const std::string endpoint_;
  const std::chrono::milliseconds timeout_;
  std::string token_;  // empty: none
  bool tls_ = false;   // https://
  std::string host_;   // of the endpoint, for messages and the TLS probe
  int port_ = 0;
  std::string ca_file_, cert_file_, key_file_;  // TLS only; cert and key: both or neither
  // Idle keep-alive connections: httplib::Client runs one request at a time.
  std::mutex mu_;
  std::vector<ClientPtr> idle_;
};

}  // namespace tessel::comm
