#include "tessel/comm/etcd_store.h"

#include <fcntl.h>
#include <httplib.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "tessel/comm/etcd_json.h"
#include "tessel/core/base64.h"
#include "tessel/core/check.h"
#include "tessel/net/bearer_token.h"
#include "tessel/net/sigpipe_hold.h"

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

// An endpoint taken apart: "http://host:port" or "https://host:port".
struct Endpoint {
  bool tls = false;
  std::string host;
  int port = 0;
};

std::optional<Endpoint> parse_endpoint(std::string_view url) {
  Endpoint e;
  if (url.starts_with("http://")) {
    url.remove_prefix(7);
    e.port = 80;
  } else if (url.starts_with("https://")) {
    url.remove_prefix(8);
    e.tls = true;
    e.port = 443;
  } else {
    return std::nullopt;
  }
  if (url.starts_with('[')) {
    const size_t close = url.find(']');
    if (close == std::string_view::npos) return std::nullopt;
    e.host = url.substr(1, close - 1);
    url.remove_prefix(close + 1);
  } else {
    e.host = url.substr(0, url.find(':'));
    url.remove_prefix(e.host.size());
  }
  if (e.host.empty()) return std::nullopt;
  for (char c : e.host) {
    if (c <= ' ' || c >= 127 || std::strchr("/?#@[]", c) != nullptr) return std::nullopt;
  }
  if (url.empty()) return e;
  if (url.front() != ':' || url.size() < 2 || url.size() > 6) return std::nullopt;
  int port = 0;
  for (char c : url.substr(1)) {
    if (c < '0' || c > '9') return std::nullopt;
    port = port * 10 + (c - '0');
  }
  if (port < 1 || port > 65535) return std::nullopt;
  e.port = port;
  return e;
}

// "host:port", an IPv6 address in brackets.
std::string authority(const std::string& host, int port) {
  if (host.find(':') == std::string::npos) return fmt::format("{}:{}", host, port);
  return fmt::format("[{}]:{}", host, port);
}

EtcdStoreOptions from_environment(const std::string& endpoint, milliseconds timeout) {
  EtcdStoreOptions options;
  options.timeout = timeout;
  if (const char* file = std::getenv(kControlTokenFileEnv); file && *file) {
    options.token_file = file;
  }
  // The same environment reaches the embedded control store, plain HTTP on loopback: the TLS
  // files are for https:// endpoints only.
  if (endpoint.starts_with("https://")) {
    for (auto [name, field] :
         {std::pair{kEtcdCaEnv, &options.ca_file}, std::pair{kEtcdCertEnv, &options.cert_file},
          std::pair{kEtcdKeyEnv, &options.key_file}}) {
      if (const char* file = std::getenv(name); file && *file) *field = file;
    }
  }
  return options;
}

// How the TLS settings are named in messages: the environment variables, or the options.
struct TlsNames {
  const char* ca;
  const char* cert;
  const char* key;
};
constexpr TlsNames kEnvironmentNames = {kEtcdCaEnv, kEtcdCertEnv, kEtcdKeyEnv};
constexpr TlsNames kOptionNames = {"EtcdStoreOptions::ca_file", "EtcdStoreOptions::cert_file",
                                   "EtcdStoreOptions::key_file"};

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

// The contents of one TLS file (PEM text is small: more than 1 MiB is not one). Throws ConfigError
// naming the file and its setting when it cannot be read or is not a regular file, and for a key
// (`secret`) that group or others may read or write -- the rule of token files
// (net/bearer_token.h, docs/security.md).
std::string read_tls_file(const std::string& endpoint, const std::string& path, const char* kind,
                          const char* setting, bool secret) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSEL_CHECK(fd >= 0, ConfigError, "etcd at {}: cannot read the {} {} ({}): {}", endpoint, kind,
               path, setting, std::strerror(errno));
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  const int stat_errno = errno;
  auto close_fd = [fd] { ::close(fd); };
  if (!stated) {
    close_fd();
    TESSEL_THROW(ConfigError, "etcd at {}: cannot read the {} {} ({}): {}", endpoint, kind, path,
                 setting, std::strerror(stat_errno));
  }
  if (!S_ISREG(st.st_mode) || st.st_size > (1 << 20)) {
    close_fd();
    TESSEL_THROW(ConfigError, "etcd at {}: the {} {} ({}) is not a regular file of PEM text",
                 endpoint, kind, path, setting);
  }
  if (secret && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    close_fd();
    TESSEL_THROW(ConfigError,
                 "etcd at {}: the {} {} ({}) can be read or written by group or others (mode "
                 "{:04o}); make it private with `chmod 600 {}`",
                 endpoint, kind, path, setting, st.st_mode & 07777, path);
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  const int read_errno = errno;
  close_fd();
  TESSEL_CHECK(got == text.size(), ConfigError, "etcd at {}: cannot read the {} {} ({}): {}",
               endpoint, kind, path, setting,
               got < text.size() && read_errno != 0 ? std::strerror(read_errno) : "it shrank");
  return text;
}

BioPtr memory_bio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// A PEM passphrase callback that notes it was asked and gives none: an encrypted key is refused
// rather than prompted for on the terminal.
int refuse_passphrase(char*, int, int, void* asked) {
  *static_cast<bool*>(asked) = true;
  return -1;
}

// Checks the TLS files of an https:// endpoint: each readable and of the right kind, the key
// private and belonging to the certificate. Throws ConfigError naming the file and its setting.
void check_tls_files(const std::string& endpoint, const EtcdStoreOptions& o, const TlsNames& n) {
  TESSEL_CHECK(!o.ca_file.empty(), ConfigError,
               "etcd at {}: an https:// endpoint needs the CA certificate that signed etcd's "
               "certificate, to verify it: set {} to its PEM file",
               endpoint, n.ca);
  TESSEL_CHECK(o.key_file.empty() || !o.cert_file.empty(), ConfigError,
               "etcd at {}: a client key without its certificate: {} is set ({}) but {} is not",
               endpoint, n.key, o.key_file, n.cert);
  TESSEL_CHECK(o.cert_file.empty() || !o.key_file.empty(), ConfigError,
               "etcd at {}: a client certificate without its key: {} is set ({}) but {} is not",
               endpoint, n.cert, o.cert_file, n.key);

  const std::string ca = read_tls_file(endpoint, o.ca_file, "CA file", n.ca, false);
  {
    BioPtr bio = memory_bio(ca);
    int certificates = 0;
    while (X509Ptr(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr))) ++certificates;
    ERR_clear_error();  // the end of the file is an error to PEM_read
    TESSEL_CHECK(certificates > 0, ConfigError,
                 "etcd at {}: the CA file {} ({}) holds no PEM certificate (-----BEGIN "
                 "CERTIFICATE-----)",
                 endpoint, o.ca_file, n.ca);
  }
  if (o.cert_file.empty()) return;

  const std::string cert_text =
      read_tls_file(endpoint, o.cert_file, "client certificate", n.cert, false);
  const std::string key_text = read_tls_file(endpoint, o.key_file, "client key", n.key, true);
  X509Ptr cert(PEM_read_bio_X509(memory_bio(cert_text).get(), nullptr, nullptr, nullptr));
  bool asked = false;
  PkeyPtr key(
      PEM_read_bio_PrivateKey(memory_bio(key_text).get(), nullptr, &refuse_passphrase, &asked));
  ERR_clear_error();
  TESSEL_CHECK(cert != nullptr, ConfigError,
               "etcd at {}: the client certificate {} ({}) is not a PEM certificate (-----BEGIN "
               "CERTIFICATE-----)",
               endpoint, o.cert_file, n.cert);
  TESSEL_CHECK(!asked, ConfigError,
               "etcd at {}: the client key {} ({}) is encrypted, and nobody is there to type its "
               "passphrase: store it decrypted (`openssl pkey -in {} -out <new file>`, then chmod "
               "600)",
               endpoint, o.key_file, n.key, o.key_file);
  TESSEL_CHECK(key != nullptr, ConfigError,
               "etcd at {}: the client key {} ({}) is not a PEM private key (-----BEGIN PRIVATE "
               "KEY-----)",
               endpoint, o.key_file, n.key);
  const bool matches = X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();
  TESSEL_CHECK(matches, ConfigError,
               "etcd at {}: the client key {} ({}) does not belong to the certificate {} ({})",
               endpoint, o.key_file, n.key, o.cert_file, n.cert);
}

// What the TLS layer saw during the calling thread's current request (httplib runs a request,
// its handshake included, on the thread that sends it): the last alert the server sent (-1: none;
// close_notify is not counted), and whether a handshake completed.
struct TlsTrace {
  int alert = -1;
  bool handshake_done = false;
};
thread_local TlsTrace tls_trace;

void note_tls_event(const SSL*, int where, int value) {
  if ((where & SSL_CB_READ_ALERT) == SSL_CB_READ_ALERT && (value & 0xff) != SSL_AD_CLOSE_NOTIFY) {
    tls_trace.alert = value & 0xff;
  }
  if ((where & SSL_CB_HANDSHAKE_DONE) != 0) tls_trace.handshake_done = true;
}

void start_tls_trace() {
  tls_trace = TlsTrace{};
  ERR_clear_error();
}

// OpenSSL's reasons for the calling thread's last failure, oldest first ("" when none); clears
// them.
std::string openssl_errors() {
  std::string out;
  while (const unsigned long code = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(code);
    const std::string text = reason ? reason : fmt::format("error {:#x}", code);
    if (out.find(text) != std::string::npos) continue;
    out += (out.empty() ? "" : "; ") + text;
  }
  return out;
}

// Alerts by which a TLS server refuses the client's certificate (or the lack of one).
bool refuses_certificate(int alert) {
  switch (alert) {
    case SSL_AD_BAD_CERTIFICATE:
    case SSL_AD_UNSUPPORTED_CERTIFICATE:
    case SSL_AD_CERTIFICATE_REVOKED:
    case SSL_AD_CERTIFICATE_EXPIRED:
    case SSL_AD_CERTIFICATE_UNKNOWN:
    case SSL_AD_UNKNOWN_CA:
    case SSL_AD_ACCESS_DENIED:
    case SSL_AD_CERTIFICATE_REQUIRED:
      return true;
    default:
      return false;
  }
}

}  // namespace

bool is_etcd_endpoint(std::string_view url) {
  return parse_endpoint(url).has_value();
}

void EtcdStore::ClientDeleter::operator()(httplib::Client* client) const {
  net::SigpipeHold hold;
  delete client;
}

EtcdStore::EtcdStore(std::string endpoint, milliseconds timeout)
    : EtcdStore(endpoint, from_environment(endpoint, timeout), true) {}

EtcdStore::EtcdStore(std::string endpoint, EtcdStoreOptions options)
    : EtcdStore(std::move(endpoint), std::move(options), false) {}

EtcdStore::EtcdStore(std::string endpoint, EtcdStoreOptions options, bool environment)
    : endpoint_(std::move(endpoint)), timeout_(options.timeout) {
  const auto parsed = parse_endpoint(endpoint_);
  TESSEL_CHECK(parsed.has_value(), ConfigError,
               "etcd endpoint '{}' must look like http://host:port or https://host:port",
               endpoint_);
  tls_ = parsed->tls;
  host_ = parsed->host;
  port_ = parsed->port;
  // cpp-httplib parses it again, more strictly (an IPv6 address of digits and colons only).
  TESSEL_CHECK(httplib::Client(endpoint_).is_valid(), ConfigError,
               "etcd endpoint '{}' is not one cpp-httplib can connect to", endpoint_);
  TESSEL_CHECK(timeout_.count() > 0, ConfigError, "etcd operation timeout must be positive");
  if (!options.token_file.empty()) {
    token_ = net::read_token_file(options.token_file, "the control store client of " + endpoint_);
  }
  const TlsNames& names = environment ? kEnvironmentNames : kOptionNames;
  if (!tls_) {
    TESSEL_CHECK(options.ca_file.empty() && options.cert_file.empty() && options.key_file.empty(),
                 ConfigError,
                 "etcd at {}: TLS files are given ({}, {}, {}) but the endpoint is plain http://: "
                 "use https://{} for TLS",
                 endpoint_, names.ca, names.cert, names.key, authority(host_, port_));
    return;
  }
  check_tls_files(endpoint_, options, names);
  ca_file_ = options.ca_file;
  cert_file_ = options.cert_file;
  key_file_ = options.key_file;
}

EtcdStore::~EtcdStore() = default;

EtcdStore::ClientPtr EtcdStore::make_client(milliseconds read_timeout) const {
  // cpp-httplib reads the TLS files for each new client, so renewed files are picked up.
  ClientPtr client(new httplib::Client(endpoint_, cert_file_, key_file_));
  TESSEL_CHECK(client->is_valid(), ConfigError,
               "etcd at {}: cannot load the client certificate {} ({}) with its key {} ({}); were "
               "they replaced since this process started?",
               endpoint_, cert_file_, kEtcdCertEnv, key_file_, kEtcdKeyEnv);
  if (tls_) {
    client->set_ca_cert_path(ca_file_);
    client->enable_server_certificate_verification(true);
    SSL_CTX_set_info_callback(client->ssl_context(), &note_tls_event);
  }
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

int EtcdStore::probe_tls(bool configured, bool* speaks_tls) const {
  const milliseconds limit = std::min<milliseconds>(timeout_, std::chrono::seconds(2));
  start_tls_trace();
  bool answered = false;
  {
    net::SigpipeHold hold;
    std::unique_ptr<httplib::ClientImpl> probe;
    if (configured) {
      auto client = std::make_unique<httplib::SSLClient>(host_, port_, cert_file_, key_file_);
      client->set_ca_cert_path(ca_file_);
      client->enable_server_certificate_verification(true);
      if (client->is_valid()) SSL_CTX_set_max_proto_version(client->ssl_context(), TLS1_2_VERSION);
      probe = std::move(client);
    } else {
      auto client = std::make_unique<httplib::SSLClient>(host_, port_);
      client->enable_server_certificate_verification(false);
      probe = std::move(client);
    }
    auto& ssl = static_cast<httplib::SSLClient&>(*probe);
    if (ssl.is_valid()) {
      SSL_CTX_set_info_callback(ssl.ssl_context(), &note_tls_event);
      probe->set_connection_timeout(limit);
      probe->set_read_timeout(limit);
      probe->set_write_timeout(limit);
      answered = static_cast<bool>(probe->Get("/health"));
    }
  }
  *speaks_tls = answered || tls_trace.handshake_done || tls_trace.alert >= 0;
  ERR_clear_error();
  return tls_trace.alert;
}

void EtcdStore::throw_if_tls_failure(const httplib::Client& client, int error, bool closed) const {
  const auto err = static_cast<httplib::Error>(error);
  bool speaks_tls = false;
  if (!tls_) {
    if (closed && (probe_tls(false, &speaks_tls), speaks_tls)) {
      TESSEL_THROW(PeerLostError,
                   "etcd at {} serves TLS on that port, and a plain http:// request gets no "
                   "answer: use https://{}, with {} naming the CA that signed etcd's "
                   "certificate (and {} / {} a client certificate and key, if etcd asks for one)",
                   endpoint_, authority(host_, port_), kEtcdCaEnv, kEtcdCertEnv, kEtcdKeyEnv);
    }
    return;
  }
  TlsTrace trace = tls_trace;
  const std::string openssl = openssl_errors();
  if (closed && trace.handshake_done && trace.alert < 0) {
    // etcd closed the connection right after the handshake: most likely it refused the client's
    // certificate (TLS 1.3 says so after the client's side of the handshake), but the request's
    // write met the closed connection before the alert was read. A TLS 1.2 handshake hears it.
    const int alert = probe_tls(true, &speaks_tls);
    if (refuses_certificate(alert)) trace.alert = alert;
  }
  const std::string ca = fmt::format("{} (now {})", kEtcdCaEnv, ca_file_);
  const std::string cert =
      cert_file_.empty()
          ? fmt::format("{} / {} (not set)", kEtcdCertEnv, kEtcdKeyEnv)
          : fmt::format("{} / {} (now {} / {})", kEtcdCertEnv, kEtcdKeyEnv, cert_file_, key_file_);
  if (err == httplib::Error::SSLServerVerification) {
    const long verify = client.get_openssl_verify_result();
    if (verify != X509_V_OK) {
      TESSEL_THROW(PeerLostError,
                   "etcd at {}: the TLS handshake failed (etcd's certificate does not verify "
                   "against the CA file: {}): check {}: it must hold the CA that signed etcd's "
                   "--cert-file, and that certificate must be valid now",
                   endpoint_, X509_verify_cert_error_string(verify), ca);
    }
    TESSEL_THROW(PeerLostError,
                 "etcd at {}: the TLS handshake failed (etcd's certificate is signed by the CA, "
                 "but does not name the host '{}' in its subjectAltName): connect by a name or "
                 "address the certificate holds, or reissue it for '{}'",
                 endpoint_, host_, host_);
  }
  if (refuses_certificate(trace.alert)) {
    if (cert_file_.empty()) {
      TESSEL_THROW(PeerLostError,
                   "etcd at {}: the TLS handshake failed (etcd sent the alert '{}': it requires a "
                   "client certificate, --client-cert-auth, and none was given): check {}: set "
                   "them to a certificate signed by the CA of etcd's --trusted-ca-file and its "
                   "key",
                   endpoint_, SSL_alert_desc_string_long(trace.alert), cert);
    }
    TESSEL_THROW(PeerLostError,
                 "etcd at {}: the TLS handshake failed (etcd refused the client certificate with "
                 "the alert '{}'): check {}: the certificate must be signed by the CA of etcd's "
                 "--trusted-ca-file, be valid now and allow client authentication",
                 endpoint_, SSL_alert_desc_string_long(trace.alert), cert);
  }
  if (trace.alert >= 0) {
    TESSEL_THROW(PeerLostError,
                 "etcd at {}: the TLS handshake failed (etcd sent the alert '{}'{}{}): check {} "
                 "and {}, and etcd's TLS flags",
                 endpoint_, SSL_alert_desc_string_long(trace.alert), openssl.empty() ? "" : "; ",
                 openssl, ca, cert);
  }
  if (err == httplib::Error::SSLConnection) {
    TESSEL_THROW(PeerLostError,
                 "etcd at {}: the TLS handshake failed ({}): check that etcd serves TLS on that "
                 "port (--cert-file, an https:// --listen-client-urls), and {} / {}",
                 endpoint_, openssl.empty() ? "no TLS answer" : openssl, ca, cert);
  }
  if (err == httplib::Error::SSLLoadingCerts) {
    TESSEL_THROW(PeerLostError, "etcd at {}: cannot load the CA file ({}): check {}", endpoint_,
                 openssl.empty() ? "no details" : openssl, ca);
  }
  if (closed && trace.handshake_done) {
    TESSEL_THROW(PeerLostError,
                 "etcd at {} closed the connection right after the TLS handshake, before "
                 "answering ({}{}{}): if etcd requires client certificates (--client-cert-auth), "
                 "check {}",
                 endpoint_, httplib::to_string(err), openssl.empty() ? "" : "; ", openssl, cert);
  }
}

EtcdStore::Reply EtcdStore::post(const std::string& path, const std::string& body, bool reuse) {
  ClientPtr client;
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
  start_tls_trace();
  auto res = [&] {
    net::SigpipeHold hold;
    return client->send(req);
  }();
  if (!res) {
    const auto err = res.error();
    if (err == httplib::Error::Read && reply.status > 0 && json::accept(reply.body)) return reply;
    // Closed rather than timed out: no reply began, and the limit was not reached.
    const bool closed = reply.status == 0 &&
                        (err == httplib::Error::Read || err == httplib::Error::Write) &&
                        Clock::now() - start + milliseconds(5) < timeout_;
    throw_if_tls_failure(*client, static_cast<int>(err), closed);
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
  if (tls_ && reply.status == 503 &&
      (message == "connection closed" || message.starts_with("connection error"))) {
    // gRPC's words for a connection it cannot make. etcd's JSON gateway reaches etcd's gRPC side
    // through TLS, presenting etcd's own certificate as its client certificate: under
    // --client-cert-auth that one must allow client authentication too, or every call through the
    // gateway ends so.
    TESSEL_THROW(IoError,
                 "etcd at {} refused POST {} (HTTP 503): {}: its JSON gateway cannot reach etcd "
                 "itself; if etcd requires client certificates (--client-cert-auth), its own "
                 "certificate (--cert-file) must allow client authentication too "
                 "(extendedKeyUsage serverAuth,clientAuth) and be signed by its --trusted-ca-file, "
                 "as the gateway connects with it",
                 endpoint_, path, message);
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
  bool answered = false;
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    answered = true;
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
  start_tls_trace();
  auto res = [&] {
    net::SigpipeHold hold;
    return client->send(req);
  }();
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
    throw_if_tls_failure(*client, static_cast<int>(err),
                         !answered && Clock::now() + milliseconds(5) < deadline);
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
