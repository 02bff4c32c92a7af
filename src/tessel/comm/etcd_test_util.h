// A throwaway etcd server for tests: started on free loopback ports with its data in a temporary
// directory (tmpfs when there is one: etcd syncs every write to disk), killed and removed when the
// EtcdServer is destroyed, whatever the test's outcome. Plain HTTP, or TLS (EtcdTls).
#pragma once

#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tessel::comm::testing {

// The etcd binary on PATH, or nothing.
inline std::optional<std::string> find_etcd() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/etcd";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return std::nullopt;
}

inline constexpr const char* kNoEtcd =
    "etcd is not on PATH: the etcd control store's tests need it (run scripts/setup, which "
    "installs "
    "Debian's etcd-server package)";

// A loopback port nobody listens on now (the kernel's choice for port 0). Another process may
// take it before etcd binds it: EtcdServer then retries with new ports.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot bind a loopback port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// TLS for an EtcdServer (PEM files): etcd serves https://127.0.0.1:<port> with this certificate
// and key, and with a `client_ca_file` requires every client to present a certificate signed by
// that CA (--client-cert-auth --trusted-ca-file).
struct EtcdTls {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;  // empty: no client certificate asked for
};

class EtcdServer {
 public:
  // Starts etcd and waits (bounded) until it answers. Throws std::runtime_error with etcd's log
  // when it does not come up. With `tls` its health is asked on a plain-HTTP metrics port
  // (--listen-metrics-urls), which needs no client certificate.
  explicit EtcdServer(const std::string& binary, std::optional<EtcdTls> tls = std::nullopt)
      : tls_(std::move(tls)) {
    std::string last_log;
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (start(binary)) return;
      last_log = log_tail();
      stop();
    }
    throw std::runtime_error("etcd did not come up; its log ends with:\n" + last_log);
  }
  ~EtcdServer() { stop(); }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  const std::string& endpoint() const { return endpoint_; }

 private:
  bool start(const std::string& binary) {
    const std::string base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string templ = base + "/tessel-etcd-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed in " + base);
    dir_ = templ;
    const int client_port = free_port(), peer_port = free_port();
    endpoint_ = (tls_ ? "https://127.0.0.1:" : "http://127.0.0.1:") + std::to_string(client_port);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port);
    // Short heartbeats: a single member elects itself in milliseconds, and etcd's minimum lease
    // TTL (1.5 election timeouts) stays under the 1 s the tests ask for.
    std::vector<std::string> args = {binary,
                                     "--name=tessel-test",
                                     "--data-dir=" + dir_ + "/data",
                                     "--listen-client-urls=" + endpoint_,
                                     "--advertise-client-urls=" + endpoint_,
                                     "--listen-peer-urls=" + peer,
                                     "--initial-advertise-peer-urls=" + peer,
                                     "--initial-cluster=tessel-test=" + peer,
                                     "--heartbeat-interval=10",
                                     "--election-timeout=100",
                                     "--log-level=warn"};
    std::string health = endpoint_;
    if (tls_) {
      health = "http://127.0.0.1:" + std::to_string(free_port());
      args.push_back("--listen-metrics-urls=" + health);
      args.push_back("--cert-file=" + tls_->cert_file);
      args.push_back("--key-file=" + tls_->key_file);
      if (!tls_->client_ca_file.empty()) {
        args.push_back("--client-cert-auth");
        args.push_back("--trusted-ca-file=" + tls_->client_ca_file);
      }
    }
    const std::string log = dir_ + "/etcd.log";
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      // etcd must not outlive a test binary that crashes before its destructors run.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(binary.c_str(), argv.data());
      ::_exit(127);
    }
    httplib::Client client(health);
    client.set_connection_timeout(std::chrono::milliseconds(200));
    client.set_read_timeout(std::chrono::milliseconds(500));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;  // exited: a port taken meanwhile, most likely
        return false;
      }
      auto res = client.Get("/health");
      if (res && res->status == 200 && res->body.find("true") != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  std::string log_tail() const {
    std::ifstream in(dir_ + "/etcd.log");
    std::stringstream s;
    s << in.rdbuf();
    const std::string all = s.str();
    return all.size() > 2000 ? all.substr(all.size() - 2000) : all;
  }

  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
      dir_.clear();
    }
  }

  std::optional<EtcdTls> tls_;
  pid_t pid_ = -1;
  std::string dir_, endpoint_;
};

}  // namespace tessel::comm::testing
