#include "tessel/testing/netns.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <utility>

extern char** environ;

namespace tessel::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using namespace std::chrono_literals;

const std::string kHostIface = "eth0";
const std::string kBridge = "br0";
constexpr auto kIpTimeout = 5s;        // one `ip` command cleaning up (they take milliseconds)
constexpr auto kKillBound = 5s;        // processes dying after SIGKILL
constexpr auto kEtcdStartBound = 20s;  // etcd answering /health
constexpr int kEtcdClientPort = 2379;
constexpr int kEtcdPeerPort = 2380;

std::string errno_text(int error) {
  return std::strerror(error);
}

milliseconds remaining(Clock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

std::string first_line(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  return line.empty() ? text : line;
}

std::string netns_path(const std::string& name) {
  return "/run/netns/" + name;
}

// The executable `program` would run as: itself when it names a path, else the first match in
// `path_list` (PATH's syntax); empty when there is none.
std::string find_program(const std::string& program, const std::string& path_list) {
  if (program.find('/') != std::string::npos) return program;
  std::stringstream dirs(path_list);
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return "";
}

std::string path_variable() {
  const char* path = std::getenv("PATH");
  return path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
}

// ---- running `ip` ----

std::string command_text(const std::vector<std::string>& argv) {
  std::string text;
  for (const auto& a : argv) text += (text.empty() ? "" : " ") + a;
  return text;
}

struct ProgramResult {
  int status = 0;  // as from waitpid
  std::string out, err;
};

// Owns posix_spawn's two attribute objects.
struct SpawnAttributes {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  SpawnAttributes() {
    posix_spawn_file_actions_init(&actions);
    posix_spawnattr_init(&attr);
  }
  ~SpawnAttributes() {
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
  }
  SpawnAttributes(const SpawnAttributes&) = delete;
  SpawnAttributes& operator=(const SpawnAttributes&) = delete;
};

std::pair<UniqueFd, UniqueFd> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2: " + errno_text(errno));
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// Reads `out` and `err` until both reach end of file or the deadline passes; false on the latter.
bool drain(int out, int err, std::string& out_text, std::string& err_text,
           Clock::time_point deadline) {
  pollfd fds[2] = {{out, POLLIN, 0}, {err, POLLIN, 0}};
  std::string* texts[2] = {&out_text, &err_text};
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    const milliseconds left = remaining(deadline);
    if (left.count() == 0) return false;
    const int n = ::poll(fds, 2, static_cast<int>(left.count()));
    if (n < 0 && errno != EINTR) throw std::runtime_error("poll: " + errno_text(errno));
    for (int i = 0; i < 2 && n > 0; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t got = ::read(fds[i].fd, buffer, sizeof buffer);
      if (got > 0) texts[i]->append(buffer, static_cast<size_t>(got));
      if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) fds[i].fd = -1;
    }
  }
  return true;
}

// Waits for the child until the deadline, then kills it; returns its status and whether it
// finished in time.
std::pair<int, bool> reap_within(pid_t pid, Clock::time_point deadline) {
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return {status, true};
    if (r < 0 && errno != EINTR) throw std::runtime_error("waitpid: " + errno_text(errno));
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(1ms);
  }
  ::kill(pid, SIGKILL);
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return {status, false};
}

// Runs argv (argv[0] found on PATH, stdin /dev/null, default signals), collecting its output;
// killed when it has not finished within `timeout`.
ProgramResult run_program(const std::vector<std::string>& argv, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto [out_r, out_w] = make_pipe();
  auto [err_r, err_w] = make_pipe();
  SpawnAttributes spawn;
  posix_spawn_file_actions_addopen(&spawn.actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&spawn.actions, out_w.get(), 1);
  posix_spawn_file_actions_adddup2(&spawn.actions, err_w.get(), 2);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&spawn.attr, &none);
  posix_spawnattr_setsigdefault(&spawn.attr, &all);
  posix_spawnattr_setflags(&spawn.attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int error = posix_spawnp(&pid, args[0], &spawn.actions, &spawn.attr, args.data(), environ);
  if (error != 0) {
    throw std::runtime_error("cannot run `" + command_text(argv) + "`: " + errno_text(error));
  }
  out_w.reset();
  err_w.reset();
  ProgramResult result;
  bool in_time = false;
  try {
    in_time = drain(out_r.get(), err_r.get(), result.out, result.err, deadline);
  } catch (...) {
    reap_within(pid, Clock::now());
    throw;
  }
  const auto [status, exited] = reap_within(pid, deadline);
  result.status = status;
  if (!in_time || !exited) {
    throw std::runtime_error("`" + command_text(argv) + "` did not finish within " +
                             std::to_string(timeout.count()) + " ms (killed)");
  }
  return result;
}

// `ip <args>` that is allowed to fail: teardown goes on, saying what was left.
void try_ip(const std::vector<std::string>& args) noexcept {
  try {
    run_ip(args, kIpTimeout);
  } catch (const std::exception& e) {
    spdlog::warn("VirtualCluster teardown: {}", e.what());
  }
}

// ---- processes and namespaces ----

// SIGKILLs every process in `ns` until none is left or the deadline passes (a process may fork
// while its parent is being killed, so the scan repeats); returns the survivors.
std::vector<pid_t> kill_all_in(NetnsId ns, Clock::time_point deadline) {
  for (;;) {
    std::vector<pid_t> pids = processes_in(ns);
    if (pids.empty() || Clock::now() >= deadline) return pids;
    for (const pid_t pid : pids) ::kill(pid, SIGKILL);
    std::this_thread::sleep_for(1ms);
  }
}

std::string pid_list(const std::vector<pid_t>& pids) {
  std::string text;
  for (const pid_t pid : pids) text += (text.empty() ? "" : " ") + std::to_string(pid);
  return text;
}

// The pid in a namespace name tsl-<pid>-..., or nothing for names not made here.
std::optional<pid_t> owner_of(const std::string& name) {
  constexpr std::string_view kPrefix = "tsl-";
  if (name.rfind(kPrefix, 0) != 0) return std::nullopt;
  const size_t end = name.find('-', kPrefix.size());
  if (end == std::string::npos || end == kPrefix.size() || end - kPrefix.size() > 9) {
    return std::nullopt;
  }
  pid_t pid = 0;
  for (size_t i = kPrefix.size(); i < end; ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    pid = pid * 10 + (name[i] - '0');
  }
  return pid > 0 ? std::optional<pid_t>(pid) : std::nullopt;
}

bool process_exists(pid_t pid) {
  return ::kill(pid, 0) == 0 || errno == EPERM;
}

// Removes the namespaces that test processes which died left behind (whatever killed them before
// their destructors ran), killing what still runs inside. Another process may be removing the
// same ones: what has vanished meanwhile is no problem.
void remove_stale_namespaces() {
  std::error_code ec;
  std::filesystem::directory_iterator it("/run/netns", ec), end;
  std::vector<std::string> stale;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::optional<pid_t> owner = owner_of(name);
    if (owner && *owner != ::getpid() && !process_exists(*owner)) stale.push_back(name);
  }
  for (const std::string& name : stale) {
    try {
      const auto survivors = kill_all_in(netns_id_of(netns_path(name)), Clock::now() + kKillBound);
      if (!survivors.empty()) {
        spdlog::warn("stale namespace {}: processes {} survive SIGKILL", name, pid_list(survivors));
      }
      run_ip({"netns", "delete", name}, kIpTimeout);
    } catch (const std::exception& e) {
      if (std::filesystem::exists(netns_path(name), ec)) {
        spdlog::warn("cannot remove stale namespace {}: {}", name, e.what());
      }
    }
  }
}

// Reserves 10.X.Y.0/24 for one cluster among all the machine's, trying X.Y from `start` on. The
// reservation is the name of an abstract unix socket: the kernel gives a name to one socket at a
// time and frees it when the socket is closed or its process dies, so no file is left behind.
// (Abstract names belong to the caller's network namespace: the machine's, for test processes.)
UniqueFd reserve_subnet(unsigned start, int& x, int& y) {
  for (unsigned i = 0; i < 65536; ++i) {
    const unsigned candidate = (start + i) % 65536;
    UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) throw std::runtime_error("socket(AF_UNIX): " + errno_text(errno));
    const std::string name = "tessel-netns-subnet-10." + std::to_string(candidate >> 8) + "." +
                             std::to_string(candidate & 255);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: abstract
    const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) == 0) {
      x = static_cast<int>(candidate >> 8);
      y = static_cast<int>(candidate & 255);
      return fd;
    }
    if (errno != EADDRINUSE) throw std::runtime_error("bind(" + name + "): " + errno_text(errno));
  }
  throw std::runtime_error("every 10.X.Y.0/24 is taken by a live VirtualCluster");
}

// Moves the calling thread into the named network namespace.
void enter_netns(const std::string& name) {
  const std::string path = netns_path(name);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) throw std::runtime_error("cannot open " + path + ": " + errno_text(errno));
  if (::setns(fd.get(), CLONE_NEWNET) != 0) {
    throw std::runtime_error("setns into " + name + ": " + errno_text(errno));
  }
}

std::string clean_tag(const std::string& tag) {
  std::string clean;
  for (const char c : tag) {
    if (clean.size() == 16) break;
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    clean += keep ? c : '_';
  }
  return clean;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// ---- the capability probe ----

bool has_effective_capability(int capability) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const unsigned long long mask = std::strtoull(line.c_str() + 7, nullptr, 16);
    return ((mask >> capability) & 1ULL) != 0;
  }
  return false;
}

std::string probe_netns() {
  constexpr int kCapNetAdmin = 12, kCapSysAdmin = 21;  // linux/capability.h
  if (!has_effective_capability(kCapNetAdmin) || !has_effective_capability(kCapSysAdmin)) {
    return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN): the multi-host "
           "tests are skipped";
  }
  if (find_program("ip", path_variable()).empty()) {
    return "iproute2's `ip` is not on PATH: the multi-host tests are skipped";
  }
  // Everything a cluster does, once: a namespace, a bridge and a veth pair in it, setns from a
  // thread. Named like a cluster's, so that a crash here is cleaned up like one.
  const std::string name = "tsl-" + std::to_string(::getpid()) + "-probe";
  std::string why;
  try {
    run_ip({"netns", "add", name});
    run_ip({"-n", name, "link", "add", kBridge, "type", "bridge"});
    run_ip({"-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"});
    std::thread([&] {
      try {
        enter_netns(name);
      } catch (const std::exception& e) {
        why = e.what();
      }
    }).join();
  } catch (const std::exception& e) {
    why = e.what();
  }
  std::error_code ec;
  if (std::filesystem::exists(netns_path(name), ec)) {
    try {
      run_ip({"netns", "delete", name});
    } catch (const std::exception& e) {
      if (why.empty()) why = e.what();
    }
  }
  if (why.empty()) return "";
  return "cannot build network namespaces here (" + first_line(why) +
         "): the multi-host tests are skipped";
}

// ---- the child of spawn() ----

// Everything the child needs, prepared before fork(): in a threaded process the child may only
// make async-signal-safe calls (no allocation, no locks) until it execs.
struct ChildPlan {
  pid_t parent;
  int netns_fd, log_fd, stdin_fd;
  const char* program;  // nullptr: not found on PATH
  char* const* argv;
  char* const* envp;
  const char* failure;  // the log line's start when exec fails
};

void write_text(int fd, const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(fd, text, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

[[noreturn]] void fail_child(const ChildPlan& plan, const char* reason) {
  write_text(2, plan.failure);
  write_text(2, reason);
  write_text(2, "\n");
  ::_exit(127);
}

[[noreturn]] void run_child(const ChildPlan& plan) {
  // The parent's handlers mean nothing here, and ignored signals would stay ignored across exec.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int sig = 1; sig < NSIG; ++sig) ::sigaction(sig, &dfl, nullptr);
  ::setsid();
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != plan.parent) ::_exit(127);  // the test died before PDEATHSIG was armed
  ::dup2(plan.log_fd, 1);
  ::dup2(plan.log_fd, 2);
  if (::setns(plan.netns_fd, CLONE_NEWNET) != 0) fail_child(plan, strerrordesc_np(errno));
  ::dup2(plan.stdin_fd, 0);
  ::close_range(3, ~0U, 0);  // the test's own descriptors opened without O_CLOEXEC
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (plan.program == nullptr) fail_child(plan, "not found on PATH");
  ::execve(plan.program, plan.argv, plan.envp);
  fail_child(plan, strerrordesc_np(errno));
}

// This process's environment with `extra` added or replacing, as "NAME=value" strings.
std::vector<std::string> child_environment(const std::map<std::string, std::string>& extra) {
  std::map<std::string, std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const size_t eq = text.find('=');
    if (eq != std::string_view::npos) env.emplace(text.substr(0, eq), text.substr(eq + 1));
  }
  for (const auto& [name, value] : extra) {
    if (name.empty() || name.find('=') != std::string::npos) {
      throw std::invalid_argument("spawn: '" + name + "' is not an environment variable name");
    }
    env[name] = value;
  }
  std::vector<std::string> strings;
  for (const auto& [name, value] : env) strings.push_back(name + "=" + value);
  return strings;
}

UniqueFd open_file(const std::filesystem::path& path, int flags) {
  UniqueFd fd(::open(path.c_str(), flags | O_CLOEXEC, 0644));
  if (!fd.valid())
    throw std::runtime_error("cannot open " + path.string() + ": " + errno_text(errno));
  return fd;
}

// ---- sockets ----

// Whether fd is ready for `events` (or has an error) before the deadline.
bool ready_before(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int n = ::poll(&p, 1, static_cast<int>(remaining(deadline).count()));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) throw std::runtime_error("poll: " + errno_text(errno));
  }
}

}  // namespace

// ---- UniqueFd ----

UniqueFd::UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(std::exchange(other.fd_, -1));
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

// ---- free functions ----

std::string netns_unavailable() {
  static const std::string why = probe_netns();
  return why;
}

std::string etcd_unavailable() {
  if (!find_program("etcd", path_variable()).empty()) return "";
  return "etcd is not on PATH: the tests running etcd in a virtual host are skipped (Debian's "
         "etcd-server package has it)";
}

NetnsId netns_id_of(const std::filesystem::path& ns_file) {
  struct stat st {};
  if (::stat(ns_file.c_str(), &st) != 0) {
    throw std::runtime_error("cannot stat " + ns_file.string() + ": " + errno_text(errno));
  }
  return {st.st_dev, st.st_ino};
}

std::vector<pid_t> processes_in(NetnsId ns) {
  std::vector<pid_t> pids;
  const pid_t self = ::getpid();
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc", ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() ||
        !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    struct stat st {};
    // Fails for a process that has exited meanwhile, or is a zombie.
    if (pid == self || ::stat(("/proc/" + name + "/ns/net").c_str(), &st) != 0) continue;
    if (st.st_dev == ns.dev && st.st_ino == ns.ino) pids.push_back(pid);
  }
  return pids;
}

std::string run_ip(const std::vector<std::string>& args, milliseconds timeout) {
  std::vector<std::string> argv = {"ip"};
  argv.insert(argv.end(), args.begin(), args.end());
  ProgramResult result = run_program(argv, timeout);
  if (!WIFEXITED(result.status) || WEXITSTATUS(result.status) != 0) {
    while (!result.err.empty() && result.err.back() == '\n') result.err.pop_back();
    throw std::runtime_error("`" + command_text(argv) + "` failed (exit code " +
                             std::to_string(exit_code_of(result.status)) +
                             "): " + (result.err.empty() ? "no message" : result.err));
  }
  return result.out;
}

UniqueFd connect_tcp(const std::string& address, int port, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  if (port <= 0 || port > 65535) {
    throw std::invalid_argument("connect_tcp: no TCP port " + std::to_string(port));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    throw std::invalid_argument("connect_tcp: '" + address + "' is not an IPv4 address");
  }
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw std::runtime_error("socket: " + errno_text(errno));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS || !ready_before(fd.get(), POLLOUT, deadline)) return {};
    int error = 0;
    socklen_t length = sizeof error;
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0 || error != 0) {
      return {};
    }
  }
  // Blocking from here on, every call bounded by the timeout.
  ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  const long ms = std::max<long>(1, static_cast<long>(timeout.count()));
  const timeval tv{ms / 1000, (ms % 1000) * 1000};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return fd;
}

HttpResponse http_get(const std::string& address, int port, const std::string& target,
                      milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const std::string url = "http://" + address + ":" + std::to_string(port) + target;
  const UniqueFd fd = connect_tcp(address, port, timeout);
  if (!fd.valid()) throw std::runtime_error("GET " + url + ": no connection");
  const std::string request =
      "GET " + target + " HTTP/1.0\r\nHost: " + address + ":" + std::to_string(port) + "\r\n\r\n";
  if (::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    throw std::runtime_error("GET " + url + ": cannot send the request");
  }
  // HTTP/1.0: the server closes the connection after the response.
  std::string response;
  for (;;) {
    if (!ready_before(fd.get(), POLLIN, deadline)) {
      throw std::runtime_error("GET " + url + ": no complete response within " +
                               std::to_string(timeout.count()) + " ms");
    }
    char buffer[4096];
    const ssize_t got = ::recv(fd.get(), buffer, sizeof buffer, 0);
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error("GET " + url + ": " + errno_text(errno));
    }
    response.append(buffer, static_cast<size_t>(got));
  }
  const size_t head_end = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || response.size() < 12 || head_end == std::string::npos) {
    throw std::runtime_error("GET " + url + ": not an HTTP response: " + first_line(response));
  }
  return {std::atoi(response.c_str() + 9), response.substr(head_end + 4)};
}

// ---- VirtualCluster ----

VirtualCluster::VirtualCluster(int hosts, const std::string& tag) {
  if (hosts < 1 || hosts > kMaxHosts) {
    throw std::invalid_argument("VirtualCluster: " + std::to_string(hosts) +
                                " hosts; between 1 and " + std::to_string(kMaxHosts) +
                                " are possible");
  }
  remove_stale_namespaces();
  static std::atomic<unsigned> next_counter{0};
  const unsigned counter = next_counter++;
  const auto pid = static_cast<unsigned>(::getpid());
  prefix_ = "tsl-" + std::to_string(pid) + "-" + std::to_string(counter);
  if (const std::string clean = clean_tag(tag); !clean.empty()) prefix_ += "-" + clean;
  subnet_reservation_ = reserve_subnet(pid * 16 + counter, subnet_x_, subnet_y_);
  hosts_.resize(static_cast<size_t>(hosts));
  try {
    build();
  } catch (...) {
    teardown();
    throw;
  }
}

VirtualCluster::~VirtualCluster() {
  teardown();
}

void VirtualCluster::add_namespace(Namespace& ns) {
  run_ip({"netns", "add", ns.name});
  created_.push_back({ns.name, {}});  // deleted by teardown() from now on
  ns.id = created_.back().id = netns_id_of(netns_path(ns.name));
  run_ip({"-n", ns.name, "link", "set", "lo", "up"});
}

void VirtualCluster::build() {
  switch_.name = prefix_ + "-sw";
  add_namespace(switch_);
  // STP off: a port forwards as soon as it joins, so link_up() restores a host at once.
  run_ip({"-n", switch_.name, "link", "add", kBridge, "up", "type", "bridge", "stp_state", "0"});
  bridge_created_ = true;
  for (int i = 0; i < hosts(); ++i) {
    Namespace& host = hosts_[static_cast<size_t>(i)];
    host.name = prefix_ + "-h" + std::to_string(i);
    add_namespace(host);
    // Created in the switch with its peer born in the host: no end is ever in our namespace.
    run_ip({"-n", switch_.name, "link", "add", switch_port(i), "up", "master", kBridge, "type",
            "veth", "peer", "name", kHostIface, "netns", host.name});
    ++veths_created_;
    run_ip({"-n", host.name, "address", "add", address(i) + "/24", "dev", kHostIface});
    run_ip({"-n", host.name, "link", "set", kHostIface, "up"});
  }
}

void VirtualCluster::teardown() noexcept {
  const auto deadline = Clock::now() + kKillBound;
  try {
    for (const Namespace& ns : created_) {
      if (ns.id == NetnsId{}) continue;
      const auto survivors = kill_all_in(ns.id, deadline);
      if (!survivors.empty()) {
        spdlog::warn("VirtualCluster teardown: processes {} in {} survive SIGKILL",
                     pid_list(survivors), ns.name);
      }
    }
    // Also the ones that left their host's namespace.
    const auto unreaped = kill_and_reap_children(-1, deadline);
    if (!unreaped.empty()) {
      spdlog::warn("VirtualCluster teardown: children {} not reaped", pid_list(unreaped));
    }
  } catch (const std::exception& e) {
    spdlog::warn("VirtualCluster teardown: {}", e.what());
  }
  // The links before the namespaces: a deleted namespace's devices go away asynchronously, and
  // these are gone when the destructor returns.
  for (int i = 0; i < veths_created_; ++i) {
    try_ip({"-n", switch_.name, "link", "delete", switch_port(i)});
  }
  if (bridge_created_) try_ip({"-n", switch_.name, "link", "delete", kBridge});
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
    try_ip({"netns", "delete", it->name});
  }
  created_.clear();
  veths_created_ = 0;
  bridge_created_ = false;
}

void VirtualCluster::check_host(int host) const {
  if (host < 0 || host >= hosts()) {
    throw std::invalid_argument("VirtualCluster: no host " + std::to_string(host) + " (it has " +
                                std::to_string(hosts()) + ")");
  }
}

std::string VirtualCluster::switch_port(int host) const {
  return "h" + std::to_string(host);
}

std::string VirtualCluster::address(int host) const {
  check_host(host);
  return "10." + std::to_string(subnet_x_) + "." + std::to_string(subnet_y_) + "." +
         std::to_string(host + 1);
}

std::string VirtualCluster::subnet() const {
  return "10." + std::to_string(subnet_x_) + "." + std::to_string(subnet_y_) + ".0/24";
}

const std::string& VirtualCluster::iface(int host) const {
  check_host(host);
  return kHostIface;
}

const std::string& VirtualCluster::netns(int host) const {
  check_host(host);
  return hosts_[static_cast<size_t>(host)].name;
}

NetnsId VirtualCluster::netns_id(int host) const {
  check_host(host);
  return hosts_[static_cast<size_t>(host)].id;
}

pid_t VirtualCluster::spawn(int host, const std::vector<std::string>& argv,
                            const std::map<std::string, std::string>& extra_env,
                            const std::filesystem::path& log_file) {
  check_host(host);
  if (argv.empty() || argv[0].empty()) throw std::invalid_argument("spawn: no program");
  std::vector<std::string> env = child_environment(extra_env);
  std::string path_list = "/usr/local/bin:/usr/bin:/bin";
  for (const auto& entry : env) {
    if (entry.rfind("PATH=", 0) == 0) path_list = entry.substr(5);
  }
  const std::string program = find_program(argv[0], path_list);
  const std::string failure = "VirtualCluster::spawn: cannot execute '" + argv[0] + "' in host " +
                              std::to_string(host) + ": ";
  const UniqueFd netns_fd = open_file(netns_path(netns(host)), O_RDONLY);
  const UniqueFd log_fd = open_file(log_file, O_WRONLY | O_CREAT | O_APPEND);
  const UniqueFd stdin_fd = open_file("/dev/null", O_RDONLY);
  std::vector<char*> args, envp;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const ChildPlan plan{::getpid(),
                       netns_fd.get(),
                       log_fd.get(),
                       stdin_fd.get(),
                       program.empty() ? nullptr : program.c_str(),
                       args.data(),
                       envp.data(),
                       failure.c_str()};

  // Every signal blocked across fork, so that none of the test's handlers runs in the child
  // before it has reset them.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = ::fork();
  if (pid == 0) run_child(plan);
  const int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) throw std::runtime_error("spawn: fork: " + errno_text(fork_errno));
  std::lock_guard lock(children_mutex_);
  children_[pid] = host;
  return pid;
}

std::optional<int> VirtualCluster::try_wait(pid_t pid) {
  std::lock_guard lock(children_mutex_);
  if (const auto it = exit_codes_.find(pid); it != exit_codes_.end()) return it->second;
  if (!children_.count(pid)) {
    throw std::invalid_argument("VirtualCluster: process " + std::to_string(pid) +
                                " was not started by spawn()");
  }
  int status = 0;
  pid_t r;
  while ((r = ::waitpid(pid, &status, WNOHANG)) < 0 && errno == EINTR) {
  }
  if (r == 0) return std::nullopt;
  if (r < 0) {
    throw std::runtime_error("waitpid(" + std::to_string(pid) + "): " + errno_text(errno));
  }
  children_.erase(pid);
  return exit_codes_[pid] = exit_code_of(status);
}

int VirtualCluster::wait(pid_t pid, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  milliseconds pause(1);
  for (;;) {
    if (const auto code = try_wait(pid)) return *code;
    if (Clock::now() >= deadline) {
      throw std::runtime_error("VirtualCluster: process " + std::to_string(pid) +
                               " still runs after " + std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::min(pause, remaining(deadline)));
    pause = std::min(pause * 2, milliseconds(20));
  }
}

void VirtualCluster::kill(pid_t pid, int sig) {
  if (pid <= 0 || pid == ::getpid()) {
    throw std::invalid_argument("VirtualCluster::kill: refusing pid " + std::to_string(pid));
  }
  // Under the lock: a child cannot be reaped (and its pid reused) between the check and kill().
  std::lock_guard lock(children_mutex_);
  if (exit_codes_.count(pid)) return;
  if (::kill(pid, sig) != 0 && errno != ESRCH) {
    throw std::runtime_error("kill(" + std::to_string(pid) + ", " + std::to_string(sig) +
                             "): " + errno_text(errno));
  }
}

std::vector<pid_t> VirtualCluster::processes(int host) const {
  check_host(host);
  return processes_in(hosts_[static_cast<size_t>(host)].id);
}

// The host's port leaves the bridge rather than going down: a carrier change reaches the bridge
// through the kernel's linkwatch, which batches events up to a second, so link_up() would take
// effect up to 1 s late; a port rejoining a bridge without STP forwards at once.
void VirtualCluster::link_down(int host) {
  check_host(host);
  run_ip({"-n", switch_.name, "link", "set", switch_port(host), "nomaster"});
}

void VirtualCluster::link_up(int host) {
  check_host(host);
  run_ip({"-n", switch_.name, "link", "set", switch_port(host), "master", kBridge});
}

void VirtualCluster::kill_host(int host) {
  check_host(host);
  link_down(host);
  const auto deadline = Clock::now() + kKillBound;
  const auto survivors = kill_all_in(hosts_[static_cast<size_t>(host)].id, deadline);
  const auto unreaped = kill_and_reap_children(host, deadline);
  if (!survivors.empty() || !unreaped.empty()) {
    throw std::runtime_error("kill_host(" + std::to_string(host) + "): processes " +
                             pid_list(survivors) + " " + pid_list(unreaped) + " still run after " +
                             std::to_string(kKillBound.count()) + " s");
  }
}

std::vector<pid_t> VirtualCluster::kill_and_reap_children(int host, Clock::time_point deadline) {
  std::vector<pid_t> pending;
  {
    std::lock_guard lock(children_mutex_);
    for (const auto& [pid, its_host] : children_) {
      if (host >= 0 && its_host != host) continue;
      ::kill(pid, SIGKILL);  // not reaped yet, so the pid is still this child's
      pending.push_back(pid);
    }
  }
  for (;;) {
    std::erase_if(pending, [&](pid_t pid) {
      try {
        return try_wait(pid).has_value();
      } catch (const std::exception&) {
        return true;  // reaped by someone else (waitpid(-1) in the test): nothing left to do
      }
    });
    if (pending.empty() || Clock::now() >= deadline) return pending;
    std::this_thread::sleep_for(1ms);
  }
}

void VirtualCluster::run_in(int host, const std::function<void()>& fn) const {
  check_host(host);
  const std::string& name = hosts_[static_cast<size_t>(host)].name;
  std::exception_ptr error;
  std::thread thread([&] {
    try {
      enter_netns(name);
      fn();
    } catch (...) {
      error = std::current_exception();
    }
  });
  thread.join();
  if (error) std::rethrow_exception(error);
}

// ---- NamespacedEtcd ----

NamespacedEtcd::NamespacedEtcd(VirtualCluster& cluster, int host, const std::filesystem::path& dir)
    : cluster_(cluster), host_(host), log_(dir / "etcd.log") {
  std::filesystem::create_directories(dir);
  const std::string client =
      "http://" + cluster.address(host) + ":" + std::to_string(kEtcdClientPort);
  const std::string peer = "http://" + cluster.address(host) + ":" + std::to_string(kEtcdPeerPort);
  // As the loopback etcd of the comm tests: short heartbeats, so a single member elects itself in
  // milliseconds and etcd's minimum lease TTL (1.5 election timeouts) stays under 1 s.
  pid_ = cluster.spawn(host,
                       {"etcd", "--name=default", "--data-dir=" + (dir / "data").string(),
                        "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
                        "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
                        "--initial-cluster=default=" + peer, "--heartbeat-interval=10",
                        "--election-timeout=100", "--log-level=warn"},
                       {}, log_);
  const auto deadline = Clock::now() + kEtcdStartBound;
  try {
    for (;;) {
      if (const auto code = cluster_.try_wait(pid_)) {
        throw std::runtime_error("etcd exited with code " + std::to_string(*code) +
                                 " before answering /health; " + log_tail());
      }
      if (healthy_from(host_, 500ms)) return;
      if (Clock::now() >= deadline) {
        throw std::runtime_error("etcd did not answer /health within 20 s; " + log_tail());
      }
      std::this_thread::sleep_for(20ms);
    }
  } catch (...) {
    stop();
    throw;
  }
}

NamespacedEtcd::~NamespacedEtcd() {
  stop();
}

std::string NamespacedEtcd::endpoint() const {
  return "http://" + cluster_.address(host_) + ":" + std::to_string(kEtcdClientPort);
}

bool NamespacedEtcd::healthy_from(int from_host, milliseconds timeout) const {
  bool healthy = false;
  cluster_.run_in(from_host, [&] {
    try {
      const HttpResponse response =
          http_get(cluster_.address(host_), kEtcdClientPort, "/health", timeout);
      healthy =
          response.status == 200 && response.body.find("\"health\":\"true\"") != std::string::npos;
    } catch (const std::runtime_error&) {
      // not answering (yet)
    }
  });
  return healthy;
}

void NamespacedEtcd::stop() noexcept {
  if (pid_ <= 0) return;
  try {
    cluster_.kill(pid_, SIGKILL);
    cluster_.wait(pid_, kKillBound);
  } catch (const std::exception& e) {
    spdlog::warn("NamespacedEtcd: stopping etcd {}: {}", pid_, e.what());
  }
  pid_ = -1;
}

std::string NamespacedEtcd::log_tail() const {
  std::ifstream in(log_);
  std::stringstream text;
  text << in.rdbuf();
  std::string all = text.str();
  if (all.size() > 2000) all = all.substr(all.size() - 2000);
  return "the end of " + log_.string() + ":\n" + all;
}

}  // namespace tessel::testing
