// EtcdStore over TLS with client certificates. Each test makes a small CA with the openssl command
// line (etcd's certificate for IP 127.0.0.1, a client's, and an unrelated CA with a client of its
// own: another job) and starts etcd with --client-cert-auth. Then: the control store's basics
// over https://, and every way a TLS setup goes wrong, with the message it gets. Skipped, saying
// why, without etcd or openssl.
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tessel/comm/etcd_store.h"
#include "tessel/comm/etcd_test_util.h"
#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;
using tessel::testing::error_of;
using tessel::testing::TempDir;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Whether every address "localhost" resolves to is 127.0.0.1 (at least one).
bool localhost_is_127_0_0_1() {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo("localhost", nullptr, &hints, &found) != 0) return false;
  bool ok = found != nullptr;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
    ok = ok && a->ai_family == AF_INET && in->sin_addr.s_addr == htonl(INADDR_LOOPBACK);
  }
  ::freeaddrinfo(found);
  return ok;
}

bool openssl_on_path() {
  std::string out;
  return tessel::testing::run_command("openssl version", &out) == 0;
}

constexpr const char* kNoOpenssl =
    "openssl is not on PATH: the TLS tests make their certificates with it (Debian's openssl "
    "package)";

// The certificates of a test, made with `openssl` in `dir` (EC P-256 keys, valid for a day; keys
// chmod 600): ca, server (signed by ca, for IP 127.0.0.1, server and client authentication: etcd's
// JSON gateway connects to etcd with it), client (signed by ca), other-ca and other-client (signed
// by other-ca). file("client.key") is the path of one. Throws std::runtime_error with openssl's
// output when it fails.
class Certificates {
 public:
  explicit Certificates(const std::filesystem::path& dir) : dir_(dir) {
    run("ca ca\n"
        "ca other-ca\n"
        "leaf server ca 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth'\n"
        "leaf client ca 'extendedKeyUsage=clientAuth'\n"
        "leaf other-client other-ca 'extendedKeyUsage=clientAuth'");
  }
  // One more certificate `name`, signed by `ca`, with these X.509v3 extensions (lines apart).
  void add(const std::string& name, const std::string& ca, const std::string& extensions) {
    run("leaf " + name + " " + ca + " '" + extensions + "'");
  }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // What etcd serves with: this CA's server certificate, client certificates of the same CA.
  testing::EtcdTls etcd() const { return {file("server.crt"), file("server.key"), file("ca.crt")}; }
  // Options of a client of this CA (certificate and key) that verifies etcd against it.
  EtcdStoreOptions client(std::chrono::milliseconds timeout = 10s) const {
    EtcdStoreOptions o;
    o.timeout = timeout;
    o.ca_file = file("ca.crt");
    o.cert_file = file("client.crt");
    o.key_file = file("client.key");
    return o;
  }

 private:
  // Runs `commands` in the folder, with the shell functions `ca NAME` (a self-signed CA) and
  // `leaf NAME CA EXTENSIONS` (a certificate CA signs); keys end up chmod 600.
  void run(const std::string& commands) const {
    const std::string script = R"(set -e
cd ')" + dir_.string() + R"('
ca() { openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
  -subj "/CN=$1" -keyout "$1.key" -out "$1.crt"; }
leaf() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
  -keyout "$1.key" -out "$1.csr"; printf "$3\n" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -CAcreateserial -days 1 \
  -extfile "$1.ext" -out "$1.crt"; }
)" + commands + R"(
chmod 600 ./*.key)";
    std::string out;
    if (tessel::testing::run_command("{\n" + script + "\n}", &out) != 0) {
      throw std::runtime_error("openssl could not make the test's certificates:\n" + out);
    }
  }

  std::filesystem::path dir_;
};

// Sets environment variables for its lifetime, restoring what was there before.
class ScopedEnvironment {
 public:
  void set(const char* name, const std::string& value) {
    const char* old = std::getenv(name);
    saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnvironment() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first, it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first);
      }
    }
  }

 private:
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

// Certificates in a temporary folder and etcd serving TLS with them, requiring client
// certificates of the CA.
class EtcdOverTls : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!openssl_on_path()) GTEST_SKIP() << kNoOpenssl;
    const auto binary = testing::find_etcd();
    if (!binary) GTEST_SKIP() << testing::kNoEtcd;
    certs = std::make_unique<Certificates>(dir.path());
    server = std::make_unique<testing::EtcdServer>(*binary, certs->etcd());
  }
  TempDir dir;
  std::unique_ptr<Certificates> certs;
  std::unique_ptr<testing::EtcdServer> server;
};

// The conformance suite's basics (control_store_conformance_test.cpp) over https://: one store
// made with options, one from the environment as `tessel agent`, its workers and
// `tessel train --cluster` make theirs, both on the same etcd.
TEST_F(EtcdOverTls, TheControlStoreWorksOverTlsWithOptionsOrTheEnvironment) {
  ASSERT_TRUE(server->endpoint().starts_with("https://127.0.0.1:")) << server->endpoint();
  EtcdStore store(server->endpoint(), certs->client());
  ScopedEnvironment env;
  env.set(kEtcdCaEnv, certs->file("ca.crt"));
  env.set(kEtcdCertEnv, certs->file("client.crt"));
  env.set(kEtcdKeyEnv, certs->file("client.key"));
  EtcdStore from_env(server->endpoint(), 10s);

  // set, get, revisions, binary values; each store sees the other's writes.
  EXPECT_FALSE(store.get("job/a").has_value());
  const int64_t r1 = store.set("job/a", "one");
  const int64_t r2 = from_env.set("job/b", "two");
  EXPECT_GT(r2, r1);
  EXPECT_EQ(from_env.get("job/a")->value, "one");
  EXPECT_EQ(store.get("job/b")->revision, r2);
  EXPECT_EQ(store.revision(), r2);
  const std::string bytes("\0\xff\n{}", 5);
  store.set("job/bytes", bytes);
  EXPECT_EQ(from_env.get("job/bytes")->value, bytes);

  // compare-and-set: exactly one winner, at the expected revision only.
  auto created = store.compare_and_set("job/leader", 0, "p1");
  ASSERT_TRUE(created.has_value());
  EXPECT_FALSE(from_env.compare_and_set("job/leader", 0, "p2").has_value());
  EXPECT_TRUE(from_env.compare_and_set("job/leader", *created, "p3").has_value());
  EXPECT_EQ(store.get("job/leader")->value, "p3");

  // add from several threads at once (pooled TLS connections side by side), list, erase.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10; ++i) (t % 2 ? store : from_env).add("job/count", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(store.get("job/count")->value, "40");
  EXPECT_EQ(store.list("job/").size(), 5u);
  EXPECT_TRUE(store.erase("job/bytes"));
  EXPECT_FALSE(store.erase("job/bytes"));
  EXPECT_EQ(from_env.list("job/").size(), 4u);

  // watch: the history after a revision, in order; and a change made while it waits.
  const int64_t start = store.revision();
  store.set("job/g/switch", "1");
  store.erase("job/g/switch");
  const auto history = from_env.watch("job/g/", start, 10s);
  ASSERT_EQ(history.events.size(), 2u);
  EXPECT_EQ(history.events[0].kv.value, "1");
  EXPECT_EQ(history.events[1].kind, WatchEvent::Kind::erase);
  std::thread writer([&] {
    std::this_thread::sleep_for(30ms);
    store.set("job/go", "now");
  });
  const auto woken = from_env.watch("job/go", history.revision, 10s);
  writer.join();
  ASSERT_EQ(woken.events.size(), 1u);
  EXPECT_EQ(woken.events[0].kv.value, "now");
  from_env.wait({"job/go", "job/a"}, 10s);

  // Leases: kept alive (each renewal a stream of its own), revoked, and left to expire.
  const LeaseId kept = store.grant_lease(10s);
  store.set("job/w/0", "x", kept);
  for (int i = 0; i < 3; ++i) store.keep_alive(kept);
  from_env.keep_alive(kept);
  EXPECT_EQ(store.get("job/w/0")->lease, kept);
  store.revoke(kept);
  EXPECT_FALSE(store.get("job/w/0").has_value());
  EXPECT_THROW(store.keep_alive(kept), PeerLostError);

  const LeaseId short_lived = from_env.grant_lease(500ms);
  const int64_t before = store.revision();
  from_env.set("job/hosts/a", "alive", short_lived);
  WatchResult seen;
  seen.revision = before;
  bool erased = false;
  for (int i = 0; i < 100 && !erased; ++i) {
    const auto more = store.watch("job/hosts/", seen.revision, 100ms);
    seen.revision = more.revision;
    for (const auto& e : more.events) erased = erased || e.kind == WatchEvent::Kind::erase;
  }
  EXPECT_TRUE(erased);
  EXPECT_FALSE(store.get("job/hosts/a").has_value());
  EXPECT_THROW(from_env.keep_alive(short_lived), PeerLostError);
  EXPECT_THROW(from_env.set("job/hosts/a", "back", short_lived), PeerLostError);

  // etcd gone, with TLS connections idle in the pool and SIGPIPE not ignored: the calls fail
  // with PeerLostError, the process lives on.
  struct sigaction dfl {
  }, old{};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGPIPE, &dfl, &old);
  server.reset();
  EXPECT_THROW(store.get("job/a"), PeerLostError);
  EXPECT_THROW(from_env.watch("job/", 0, 1s), PeerLostError);
  ::sigaction(SIGPIPE, &old, nullptr);
}

TEST_F(EtcdOverTls, AClientWithoutACertificateIsRefusedClearly) {
  EtcdStoreOptions o = certs->client();
  o.cert_file.clear();
  o.key_file.clear();
  EtcdStore store(server->endpoint(), o);
  for (const auto& what : {error_of<PeerLostError>([&] { store.get("job/a"); }),
                           error_of<PeerLostError>([&] { store.watch("job/", 0, 2s); })}) {
    EXPECT_TRUE(contains(what, "etcd at " + server->endpoint() + ": the TLS handshake failed"))
        << what;
    EXPECT_TRUE(contains(what, "requires a client certificate")) << what;
    EXPECT_TRUE(contains(what, "TESSEL_ETCD_CERT / TESSEL_ETCD_KEY (not set)")) << what;
  }
}

TEST_F(EtcdOverTls, AClientCertificateOfAnotherCaIsRefused) {
  // The other job's client: it trusts etcd's CA, but its own certificate comes from its own CA.
  EtcdStoreOptions o = certs->client();
  o.cert_file = certs->file("other-client.crt");
  o.key_file = certs->file("other-client.key");
  EtcdStore store(server->endpoint(), o);
  const std::string what = error_of<PeerLostError>([&] { store.set("job/a", "x"); });
  EXPECT_TRUE(contains(what, "the TLS handshake failed (etcd refused the client certificate"))
      << what;
  EXPECT_TRUE(contains(what, o.cert_file)) << what;
  EXPECT_TRUE(contains(what, "--trusted-ca-file")) << what;
  // Its certificate is good with the server of its own CA: the same store works with ours.
  EtcdStore ours(server->endpoint(), certs->client());
  EXPECT_FALSE(ours.get("job/a").has_value());
}

TEST_F(EtcdOverTls, EtcdsCertificateMustVerifyAgainstTheCaAndNameTheHost) {
  // A CA file that did not sign etcd's certificate (the other job's).
  EtcdStoreOptions o = certs->client();
  o.ca_file = certs->file("other-ca.crt");
  EtcdStore wrong_ca(server->endpoint(), o);
  for (const auto& what : {error_of<PeerLostError>([&] { wrong_ca.revision(); }),
                           error_of<PeerLostError>([&] { wrong_ca.watch("job/", 0, 2s); })}) {
    EXPECT_TRUE(contains(what, "the TLS handshake failed (etcd's certificate does not verify"))
        << what;
    EXPECT_TRUE(contains(what, "check TESSEL_ETCD_CA (now " + o.ca_file + ")")) << what;
  }
  // The right CA, but a host the certificate does not name (it names IP 127.0.0.1 only) -- where
  // the name "localhost" leads to it: a bare system may have no /etc/hosts.
  if (!localhost_is_127_0_0_1()) {
    std::printf(
        "[ note ] 'localhost' does not resolve to 127.0.0.1 here: host-name check skipped\n");
    return;
  }
  std::string by_name = server->endpoint();
  by_name.replace(by_name.find("127.0.0.1"), 9, "localhost");
  EtcdStore wrong_host(by_name, certs->client());
  const std::string what = error_of<PeerLostError>([&] { wrong_host.get("job/a"); });
  EXPECT_TRUE(contains(what, "does not name the host 'localhost'")) << what;
}

TEST_F(EtcdOverTls, PlainHttpToTheTlsPortSaysToUseHttps) {
  std::string plain = server->endpoint();
  plain.replace(0, 5, "http");  // https:// -> http://
  EtcdStore store(plain, 5s);
  for (const auto& what : {error_of<PeerLostError>([&] { store.get("job/a"); }),
                           error_of<PeerLostError>([&] { store.watch("job/", 0, 2s); })}) {
    EXPECT_TRUE(contains(what, "etcd at " + plain + " serves TLS on that port")) << what;
    EXPECT_TRUE(contains(what, "use " + server->endpoint())) << what;
  }
}

// etcd's JSON gateway connects to etcd with etcd's own certificate: under --client-cert-auth one
// made for server authentication only breaks every call, and the error says why.
TEST(EtcdTlsGateway, AnEtcdCertificateWithoutClientAuthenticationIsNamedAsTheCause) {
  if (!openssl_on_path()) GTEST_SKIP() << kNoOpenssl;
  const auto binary = testing::find_etcd();
  if (!binary) GTEST_SKIP() << testing::kNoEtcd;
  TempDir dir;
  Certificates certs(dir.path());
  certs.add("server-only", "ca", "subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth");
  testing::EtcdTls tls = certs.etcd();
  tls.cert_file = certs.file("server-only.crt");
  tls.key_file = certs.file("server-only.key");
  testing::EtcdServer server(*binary, tls);
  EtcdStore store(server.endpoint(), certs.client());
  const std::string what = error_of<IoError>([&] { store.get("job/a"); });
  EXPECT_TRUE(contains(what, "its JSON gateway cannot reach etcd itself")) << what;
  EXPECT_TRUE(contains(what, "(extendedKeyUsage serverAuth,clientAuth)")) << what;
}

// Every mistake in the settings is a ConfigError at construction, naming the setting and the file.
TEST(EtcdTlsOptions, MistakesAreConfigErrorsNamingTheFile) {
  if (!openssl_on_path()) GTEST_SKIP() << kNoOpenssl;
  TempDir dir;
  const Certificates certs(dir.path());
  const std::string endpoint = "https://127.0.0.1:2379";
  EXPECT_NO_THROW(EtcdStore(endpoint, certs.client()));
  auto error = [&](const EtcdStoreOptions& o, const std::string& url = "https://127.0.0.1:2379") {
    return error_of<ConfigError>([&] { EtcdStore store(url, o); });
  };

  EtcdStoreOptions o = certs.client();
  o.ca_file.clear();
  EXPECT_TRUE(contains(error(o), "an https:// endpoint needs the CA certificate")) << error(o);
  o = certs.client();
  o.key_file.clear();
  EXPECT_TRUE(contains(error(o), "a client certificate without its key")) << error(o);
  o = certs.client();
  o.cert_file.clear();
  EXPECT_TRUE(contains(error(o), "a client key without its certificate")) << error(o);

  o = certs.client();
  o.cert_file = (dir / "missing.crt").string();
  EXPECT_TRUE(contains(error(o), "cannot read the client certificate " + o.cert_file +
                                     " (EtcdStoreOptions::cert_file): No such file"))
      << error(o);
  o = certs.client();
  o.ca_file = dir.path().string();
  EXPECT_TRUE(contains(error(o), "is not a regular file")) << error(o);
  o = certs.client();
  o.ca_file = certs.file("client.csr");
  EXPECT_TRUE(contains(error(o), "the CA file " + o.ca_file +
                                     " (EtcdStoreOptions::ca_file) "
                                     "holds no PEM certificate"))
      << error(o);
  o = certs.client();
  o.key_file = certs.file("other-client.key");
  EXPECT_TRUE(contains(error(o), "does not belong to the certificate " + o.cert_file)) << error(o);
  o = certs.client();
  o.key_file = certs.file("client.crt");
  ::chmod(o.key_file.c_str(), 0600);
  EXPECT_TRUE(contains(error(o), "is not a PEM private key")) << error(o);

  // A key that group or others may read: refused like a token file, with the fix.
  o = certs.client();
  ::chmod(o.key_file.c_str(), 0640);
  EXPECT_TRUE(contains(error(o),
                       "can be read or written by group or others (mode 0640); make it "
                       "private with `chmod 600 " +
                           o.key_file + "`"))
      << error(o);
  ::chmod(o.key_file.c_str(), 0600);

  // An encrypted key: refused, not prompted for.
  std::string out;
  const std::string encrypted = (dir / "encrypted.key").string();
  ASSERT_EQ(tessel::testing::run_command("openssl pkey -in '" + certs.file("client.key") +
                                             "' -aes128 -passout pass:secret -out '" + encrypted +
                                             "' && chmod 600 '" + encrypted + "'",
                                         &out),
            0)
      << out;
  o = certs.client();
  o.key_file = encrypted;
  EXPECT_TRUE(contains(error(o), "is encrypted")) << error(o);

  // TLS files with a plain http:// endpoint, and endpoints of neither kind.
  EXPECT_TRUE(contains(error(certs.client(), "http://127.0.0.1:2379"),
                       "the endpoint is plain http://: use https://127.0.0.1:2379"))
      << error(certs.client(), "http://127.0.0.1:2379");
  for (const char* bad : {"127.0.0.1:2379", "https://", "https://host:port", "https://h:70000",
                          "https://h:2379/v3", "ftp://h:2379"}) {
    EXPECT_TRUE(contains(error(certs.client(), bad),
                         "must look like http://host:port or "
                         "https://host:port"))
        << bad << ": " << error(certs.client(), bad);
  }
  EXPECT_TRUE(is_etcd_endpoint("https://[::1]:2379"));
  EXPECT_TRUE(is_etcd_endpoint("http://etcd.example"));
  EXPECT_FALSE(is_etcd_endpoint("https://etcd.example:2379/cluster"));

  // From the environment: named by its variables; for http:// (the embedded control store, on
  // loopback) the variables are not used at all.
  ScopedEnvironment env;
  env.set(kEtcdCaEnv, certs.file("ca.crt"));
  env.set(kEtcdCertEnv, certs.file("client.crt"));
  env.set(kEtcdKeyEnv, (dir / "missing.key").string());
  const std::string from_env = error_of<ConfigError>([&] { EtcdStore store(endpoint, 1s); });
  EXPECT_TRUE(contains(from_env, "cannot read the client key " + (dir / "missing.key").string() +
                                     " (TESSEL_ETCD_KEY)"))
      << from_env;
  EXPECT_NO_THROW(EtcdStore("http://127.0.0.1:2379", 1s));
}

}  // namespace
}  // namespace tessel::comm
