// The virtual cluster harness: hosts reach each other and nothing else, links are cut and
// restored, hosts are killed whole, and nothing outlives a cluster. Every test skips, saying why,
// where network namespaces cannot be built (not root, no `ip`).
#include "tessel/testing/netns.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tessel/testing/testing.h"

namespace tessel::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

#define SKIP_WITHOUT_NETNS() \
  if (const std::string why = netns_unavailable(); !why.empty()) GTEST_SKIP() << why

constexpr int kPort = 7000;
constexpr auto kRefused = 300ms;  // how long a connection that must fail is given
constexpr auto kBound = 5s;       // the bound on anything that must happen

// ---- a server process: this binary in another role ----

// TESSEL_NETNS_TEST_SERVER=<address>:<port> in its environment turns this test binary into a TCP
// server answering every connection with "hello\n" (for 60 s at most): the process the tests
// spawn inside hosts, with nothing needed beyond the binary. It runs before main, so GoogleTest
// never starts in that role.
[[noreturn]] void serve_hello(const std::string& where) {
  const size_t colon = where.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::atoi(where.c_str() + colon + 1)));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (colon == std::string::npos ||
      ::inet_pton(AF_INET, where.substr(0, colon).c_str(), &addr.sin_addr) != 1 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0) {
    std::fprintf(stderr, "hello server: cannot listen on %s: %s\n", where.c_str(),
                 std::strerror(errno));
    std::_Exit(2);
  }
  const auto deadline = Clock::now() + 60s;
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const int connection = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    if (::send(connection, "hello\n", 6, MSG_NOSIGNAL) < 0) {
      // the client left already: nothing to do
    }
    ::close(connection);
  }
  std::_Exit(0);
}

[[maybe_unused]] const bool kServerRole = [] {
  if (const char* where = std::getenv("TESSEL_NETNS_TEST_SERVER")) serve_hello(where);
  return false;
}();

// Starts the hello server in `host`, on the host's address.
pid_t spawn_server(VirtualCluster& cluster, int host, const std::filesystem::path& log) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return cluster.spawn(
      host, {self},
      {{"TESSEL_NETNS_TEST_SERVER", cluster.address(host) + ":" + std::to_string(kPort)}}, log);
}

// ---- sockets and processes ----

// A listening TCP socket on address:port in the calling thread's namespace.
UniqueFd listen_tcp(const std::string& address, int port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, address.c_str(), &addr.sin_addr);
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(fd.get(), 16) != 0) {
    throw std::runtime_error("cannot listen on " + address + ": " + std::strerror(errno));
  }
  return fd;
}

// A listening socket in `host`, on its address: sockets stay in the namespace they were made in.
UniqueFd listener_in(const VirtualCluster& cluster, int host, int port) {
  UniqueFd fd;
  cluster.run_in(host, [&] { fd = listen_tcp(cluster.address(host), port); });
  return fd;
}

// The next connection on `listener` within `timeout` (its peer's address in *peer), or invalid.
UniqueFd accept_within(int listener, milliseconds timeout, std::string* peer) {
  pollfd p{listener, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return {};
  sockaddr_in addr{};
  socklen_t length = sizeof addr;
  UniqueFd fd(::accept4(listener, reinterpret_cast<sockaddr*>(&addr), &length, SOCK_CLOEXEC));
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &addr.sin_addr, text, sizeof text);
  *peer = text;
  const timeval tv{static_cast<time_t>(timeout.count() / 1000),
                   static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Up to `bytes` bytes from a socket with a receive timeout (fewer when it closes or times out).
std::string receive(int fd, size_t bytes) {
  std::string text;
  char buffer[256];
  while (text.size() < bytes) {
    const ssize_t got = ::recv(fd, buffer, std::min(sizeof buffer, bytes - text.size()), 0);
    if (got <= 0) break;
    text.append(buffer, static_cast<size_t>(got));
  }
  return text;
}

void send_text(int fd, const std::string& text) {
  ASSERT_EQ(::send(fd, text.data(), text.size(), MSG_NOSIGNAL), static_cast<ssize_t>(text.size()));
}

// Whether a TCP connection from `from` to address:port is established within `timeout`.
bool connects(const VirtualCluster& cluster, int from, const std::string& address,
              milliseconds timeout) {
  bool connected = false;
  cluster.run_in(from, [&] { connected = connect_tcp(address, kPort, timeout).valid(); });
  return connected;
}

// What the hello server in `to` answers a client in `from` ("" when there is no answer): retried
// for `bound`, since a server just spawned needs a moment before it listens.
std::string hello_from(const VirtualCluster& cluster, int from, int to, milliseconds bound) {
  const auto deadline = Clock::now() + bound;
  std::string answer;
  while (answer.empty() && Clock::now() < deadline) {
    cluster.run_in(from, [&] {
      const UniqueFd fd = connect_tcp(cluster.address(to), kPort, 1s);
      if (fd.valid()) answer = receive(fd.get(), 6);
    });
    if (answer.empty()) std::this_thread::sleep_for(10ms);
  }
  return answer;
}

bool wait_until(const std::function<bool()>& condition, milliseconds bound) {
  const auto deadline = Clock::now() + bound;
  while (!condition()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// Whether pid is a live process in namespace `ns` (a zombie is in no namespace).
bool lives_in(pid_t pid, NetnsId ns) {
  struct stat st {};
  const std::string path = "/proc/" + std::to_string(pid) + "/ns/net";
  return ::stat(path.c_str(), &st) == 0 && NetnsId{st.st_dev, st.st_ino} == ns;
}

// The pid of a process that has exited and been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// The interfaces of the test's own namespace.
std::set<std::string> root_links() {
  std::set<std::string> names;
  std::stringstream lines(run_ip({"-o", "link", "show"}));
  for (std::string line; std::getline(lines, line);) {
    const size_t start = line.find(": ") + 2;  // "4: eth0@if5: <...>"
    names.insert(line.substr(start, line.find_first_of(":@", start) - start));
  }
  return names;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Whether an etcd answers GET /health with "true" on address:2379 from the calling thread.
bool answers_health(const std::string& address) {
  try {
    return http_get(address, 2379, "/health", kRefused).body.find("\"health\":\"true\"") !=
           std::string::npos;
  } catch (const std::runtime_error&) {
    return false;
  }
}

// ---- the tests ----

TEST(VirtualClusterTest, HostsReachEachOtherOverTcp) {
  SKIP_WITHOUT_NETNS();
  VirtualCluster cluster(2, "tcp");
  const std::string subnet = cluster.subnet();
  ASSERT_EQ(subnet.substr(subnet.size() - 5), ".0/24");
  EXPECT_EQ(cluster.address(1), subnet.substr(0, subnet.size() - 5) + ".2");
  EXPECT_NE(run_ip({"-n", cluster.netns(1), "-o", "address", "show", "dev", cluster.iface(1)})
                .find(cluster.address(1) + "/24"),
            std::string::npos);

  const UniqueFd listener = listener_in(cluster, 0, kPort);
  UniqueFd client;
  cluster.run_in(1, [&] { client = connect_tcp(cluster.address(0), kPort, kBound); });
  ASSERT_TRUE(client.valid());
  std::string peer;
  const UniqueFd server = accept_within(listener.get(), kBound, &peer);
  ASSERT_TRUE(server.valid());
  EXPECT_EQ(peer, cluster.address(1));  // over the switch, from host 1's own address

  send_text(client.get(), "ping");
  EXPECT_EQ(receive(server.get(), 4), "ping");
  send_text(server.get(), "pong");
  EXPECT_EQ(receive(client.get(), 4), "pong");
}

TEST(VirtualClusterTest, SpawnRunsInTheHostWithTheExtraEnvironmentAndReportsExecFailures) {
  SKIP_WITHOUT_NETNS();
  VirtualCluster cluster(1, "spawn");
  const TempDir dir;
  const auto log = dir / "spawn.log";
  const pid_t shell =
      cluster.spawn(0, {"sh", "-c", "echo greeting=$GREETING; readlink /proc/self/ns/net"},
                    {{"GREETING", "hello"}}, log);
  EXPECT_EQ(cluster.wait(shell, kBound), 0);
  EXPECT_EQ(cluster.wait(shell, kBound), 0);  // asked again: the same answer
  const std::string output = read_file(log);
  EXPECT_NE(output.find("greeting=hello\n"), std::string::npos) << output;
  EXPECT_NE(output.find("net:[" + std::to_string(cluster.netns_id(0).ino) + "]"), std::string::npos)
      << output;

  const pid_t missing = cluster.spawn(0, {"tessel-no-such-program"}, {}, log);
  EXPECT_EQ(cluster.wait(missing, kBound), 127);
  const pid_t directory = cluster.spawn(0, {dir.path().string()}, {}, log);
  EXPECT_EQ(cluster.wait(directory, kBound), 127);
  const std::string failures = read_file(log);
  EXPECT_NE(failures.find("cannot execute 'tessel-no-such-program' in host 0: not found on PATH"),
            std::string::npos)
      << failures;
  EXPECT_NE(
      failures.find("cannot execute '" + dir.path().string() + "' in host 0: Permission denied"),
      std::string::npos)
      << failures;
}

TEST(VirtualClusterTest, HostsCannotBeReachedFromTheTestsNamespace) {
  SKIP_WITHOUT_NETNS();
  const std::set<std::string> links_before = root_links();
  VirtualCluster cluster(2, "isolated");
  const TempDir dir;
  spawn_server(cluster, 1, dir / "server.log");
  ASSERT_EQ(hello_from(cluster, 0, 1, kBound), "hello\n") << read_file(dir / "server.log");
  const UniqueFd listener = listener_in(cluster, 1, kPort + 1);

  // A connection from here may well be established: a machine's network (this sandbox's does)
  // can accept connections to any address. It must not be the host's.
  const UniqueFd to_server = connect_tcp(cluster.address(1), kPort, kRefused);
  EXPECT_TRUE(!to_server.valid() || receive(to_server.get(), 6) != "hello\n");
  const UniqueFd to_listener = connect_tcp(cluster.address(1), kPort + 1, kRefused);
  std::string peer;
  EXPECT_FALSE(accept_within(listener.get(), kRefused, &peer).valid()) << peer;
  EXPECT_EQ(root_links(), links_before);  // neither the bridge nor a veth end is here
}

TEST(VirtualClusterTest, LinkDownCutsAHostOffAndLinkUpRestoresIt) {
  SKIP_WITHOUT_NETNS();
  VirtualCluster cluster(3, "link");
  const TempDir dir;
  const pid_t server = spawn_server(cluster, 1, dir / "server.log");
  const UniqueFd listener0 = listener_in(cluster, 0, kPort);
  const UniqueFd listener2 = listener_in(cluster, 2, kPort);
  ASSERT_EQ(hello_from(cluster, 0, 1, kBound), "hello\n") << read_file(dir / "server.log");

  cluster.link_down(1);
  EXPECT_FALSE(connects(cluster, 0, cluster.address(1), kRefused));
  EXPECT_FALSE(connects(cluster, 2, cluster.address(1), kRefused));
  EXPECT_FALSE(connects(cluster, 1, cluster.address(0), kRefused));
  EXPECT_TRUE(connects(cluster, 0, cluster.address(2), kBound));  // the others still talk
  // Host 1 itself goes on: its server runs and answers on the host's own address.
  EXPECT_FALSE(cluster.try_wait(server).has_value());
  EXPECT_EQ(hello_from(cluster, 1, 1, kBound), "hello\n");

  cluster.link_up(1);
  EXPECT_EQ(hello_from(cluster, 0, 1, kBound), "hello\n");
  EXPECT_TRUE(connects(cluster, 1, cluster.address(0), kBound));
}

TEST(VirtualClusterTest, KillHostKillsEveryProcessInsideAndCutsTheLink) {
  SKIP_WITHOUT_NETNS();
  VirtualCluster cluster(2, "kill");
  const TempDir dir;
  const pid_t sleeper = cluster.spawn(1, {"sleep", "1000"}, {}, dir / "sleep.log");
  // Its background sleep is a grandchild: not ours, found by its namespace.
  const pid_t shell = cluster.spawn(1, {"sh", "-c", "sleep 1000 & sleep 1000"}, {}, dir / "sh.log");
  const pid_t bystander = cluster.spawn(0, {"sleep", "1000"}, {}, dir / "bystander.log");
  const UniqueFd listener = listener_in(cluster, 1, kPort);  // a socket, not a process, in host 1
  ASSERT_TRUE(wait_until([&] { return cluster.processes(1).size() >= 3; }, kBound));
  const std::vector<pid_t> inside = cluster.processes(1);

  cluster.kill_host(1);
  EXPECT_TRUE(cluster.processes(1).empty());
  EXPECT_EQ(cluster.try_wait(sleeper).value_or(-1), 128 + SIGKILL);  // reaped by kill_host
  EXPECT_EQ(cluster.try_wait(shell).value_or(-1), 128 + SIGKILL);
  for (const pid_t pid : inside) EXPECT_FALSE(lives_in(pid, cluster.netns_id(1))) << pid;
  EXPECT_FALSE(cluster.try_wait(bystander).has_value());
  EXPECT_FALSE(connects(cluster, 0, cluster.address(1), kRefused));  // its link is down too
}

TEST(VirtualClusterTest, DestructorRemovesNamespacesLinksAndProcessesEvenOnAnException) {
  SKIP_WITHOUT_NETNS();
  const std::set<std::string> links_before = root_links();
  const TempDir dir;
  std::vector<std::string> names;
  std::vector<std::pair<pid_t, NetnsId>> inside;
  const auto failing_test = [&] {
    VirtualCluster cluster(2, "teardown");
    names = {cluster.switch_netns(), cluster.netns(0), cluster.netns(1)};
    for (int host = 0; host < 2; ++host) {
      cluster.spawn(host, {"sh", "-c", "sleep 1000 & sleep 1000"}, {}, dir / "sh.log");
    }
    EXPECT_TRUE(wait_until(
        [&] { return cluster.processes(0).size() >= 2 && cluster.processes(1).size() >= 2; },
        kBound));
    for (int host = 0; host < 2; ++host) {
      for (const pid_t pid : cluster.processes(host))
        inside.emplace_back(pid, cluster.netns_id(host));
    }
    throw std::runtime_error("a test fails with the cluster up");
  };
  EXPECT_THROW(failing_test(), std::runtime_error);

  ASSERT_EQ(names.size(), 3u);
  const std::string namespaces = run_ip({"netns", "list"});
  for (const auto& name : names) EXPECT_EQ(namespaces.find(name), std::string::npos) << name;
  EXPECT_GE(inside.size(), 4u);
  for (const auto& [pid, ns] : inside) EXPECT_FALSE(lives_in(pid, ns)) << pid;
  EXPECT_EQ(root_links(), links_before);
}

TEST(VirtualClusterTest, ConstructorRemovesTheNamespacesOfDeadTestProcesses) {
  SKIP_WITHOUT_NETNS();
  // What a crashed test leaves: a namespace named for its (now dead) pid, a process still inside
  // (a child of no cluster). The process makes the namespace and only then is it named, so that
  // whoever removes it -- a cluster of a test running in parallel may be first -- finds it inside.
  const pid_t inside = ::fork();
  if (inside == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // not left behind when this test fails
    if (::unshare(CLONE_NEWNET) != 0) ::_exit(126);
    ::execl("/bin/sh", "sh", "-c", "exec sleep 1000", nullptr);
    ::_exit(127);
  }
  ASSERT_GT(inside, 0);
  const NetnsId ours = netns_id_of("/proc/self/ns/net");
  EXPECT_TRUE(wait_until(
      [&] {
        const std::string path = "/proc/" + std::to_string(inside) + "/ns/net";
        return std::filesystem::exists(path) && !(netns_id_of(path) == ours);
      },
      kBound));
  const std::string name = "tsl-" + std::to_string(dead_pid()) + "-0-h0";
  run_ip({"netns", "attach", name, std::to_string(inside)});

  const VirtualCluster cluster(1, "stale");
  EXPECT_FALSE(std::filesystem::exists("/run/netns/" + name));
  int status = 0;
  EXPECT_TRUE(wait_until([&] { return ::waitpid(inside, &status, WNOHANG) == inside; }, kBound));
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
}

TEST(NamespacedEtcdTest, AnswersHealthFromEveryHostButNotFromOutside) {
  SKIP_WITHOUT_NETNS();
  if (const std::string why = etcd_unavailable(); !why.empty()) GTEST_SKIP() << why;
  VirtualCluster cluster(2, "etcd");
  // etcd syncs every write: its data on tmpfs when there is one.
  std::string base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  std::string pattern = base + "/tessel-netns-etcd-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::filesystem::path dir = pattern;
  {
    const NamespacedEtcd etcd(cluster, 0, dir);
    EXPECT_EQ(etcd.endpoint(), "http://" + cluster.address(0) + ":2379");
    EXPECT_TRUE(etcd.healthy_from(0, kBound)) << read_file(etcd.log_file());
    EXPECT_TRUE(etcd.healthy_from(1, kBound)) << read_file(etcd.log_file());
    EXPECT_FALSE(answers_health(cluster.address(0)));  // not from the test's own namespace
    EXPECT_EQ(cluster.processes(0), std::vector<pid_t>(1, etcd.pid()));
  }
  EXPECT_TRUE(cluster.processes(0).empty());  // killed with the NamespacedEtcd
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace tessel::testing
