// A cluster of virtual "hosts" on one Linux machine, for multi-host tests: each host is a network
// namespace with its own address, and a bridge in one more "switch" namespace joins them. A test
// runs processes inside hosts, cuts hosts off the switch (link_down) and kills whole hosts
// (kill_host), while it watches from outside. Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and
// iproute2's `ip`; tests skip with netns_unavailable()'s reason when they are missing.
//
// Nothing is configured in the test's own network namespace: the bridge, the veth pairs and the
// addresses all live in the cluster's namespaces, named tsl-<pid>-<n>[-<tag>]-h<i> (hosts) and
// tsl-<pid>-<n>[-<tag>]-sw (the switch), so that what a test process which died left behind is
// recognised, and removed by the next VirtualCluster built on the machine.
//
// Every wait is bounded, and failures throw std::runtime_error (a failing `ip` command is quoted
// with its stderr); std::invalid_argument reports a misuse (a host index out of range, ...).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace tessel::testing {

// Why this process cannot build a VirtualCluster, in one sentence; empty when it can. Checked once
// per process: the capabilities, `ip` on PATH, and a probe namespace with a bridge and a veth pair
// really created, entered (setns) and deleted. In a test:
//   if (const std::string why = netns_unavailable(); !why.empty()) GTEST_SKIP() << why;
std::string netns_unavailable();

// Why NamespacedEtcd cannot run, in one sentence (etcd not on PATH); empty when it can.
std::string etcd_unavailable();

// An owned file descriptor, closed when the object dies.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept;
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A network namespace's identity: the device and inode of its nsfs file (/run/netns/<name>, or
// /proc/<pid>/ns/net of a process in it).
struct NetnsId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const NetnsId&) const = default;
};

// The identity of the namespace `ns_file` refers to. Throws std::runtime_error when it cannot be
// read.
NetnsId netns_id_of(const std::filesystem::path& ns_file);

// Every live process whose network namespace (that of its main thread) is `ns`; never this
// process. Zombies are not listed: a process leaves its namespaces when it exits.
std::vector<pid_t> processes_in(NetnsId ns);

// Runs `ip <args>` (found on PATH; no shell) and returns its stdout. Throws std::runtime_error
// quoting the command and its stderr when it fails, or when it has not finished within `timeout`
// (it is then killed).
std::string run_ip(const std::vector<std::string>& args,
                   std::chrono::milliseconds timeout = std::chrono::seconds(10));

// A TCP connection to address:port (IPv4) from the calling thread's network namespace, or an
// invalid UniqueFd when it is refused, unreachable or not established within `timeout`. The socket
// is blocking, with `timeout` as its send and receive timeout so that no later call on it hangs.
UniqueFd connect_tcp(const std::string& address, int port, std::chrono::milliseconds timeout);

struct HttpResponse {
  int status = 0;
  std::string body;
};

// One HTTP/1.0 GET of `target` from address:port, made from the calling thread's network
// namespace (inside a host: through VirtualCluster::run_in). Throws std::runtime_error when there
// is no connection, or no complete response within `timeout`.
HttpResponse http_get(const std::string& address, int port, const std::string& target,
                      std::chrono::milliseconds timeout);

// The hosts, the switch and the processes spawned into them. Every member but the constructor and
// the destructor may be called from several threads at once.
class VirtualCluster {
 public:
  static constexpr int kMaxHosts = 200;

  // Builds `hosts` host namespaces (1..kMaxHosts) and the switch. `tag` (letters, digits and '_'
  // kept, at most 16 characters) goes into the namespace names to tell a test's cluster apart in
  // `ip netns list`. First removes the namespaces of dead test processes (and kills what still runs
  // in them). Throws std::runtime_error, after removing what it had built, when a step fails.
  VirtualCluster(int hosts, const std::string& tag);
  // Kills every process in the cluster's namespaces (found by namespace, so also the ones other
  // processes started there) and every process spawn() started, reaps the latter, and deletes the
  // veths, the bridge and the namespaces. Never throws (problems are logged); bounded: at most 5 s
  // for the processes plus 5 s per `ip` command (which normally take milliseconds).
  ~VirtualCluster();
  VirtualCluster(const VirtualCluster&) = delete;
  VirtualCluster& operator=(const VirtualCluster&) = delete;

  int hosts() const { return static_cast<int>(hosts_.size()); }
  // The host's IPv4 address, "10.X.Y.<host + 1>", in the cluster's own 10.X.Y.0/24: no other
  // live cluster on the machine (of any process) has the same subnet.
  std::string address(int host) const;
  std::string subnet() const;  // "10.X.Y.0/24"
  // The host's interface to the switch, inside its namespace.
  const std::string& iface(int host) const;
  // The host's namespace: its name (for `ip -n`, `ip netns exec`) and identity.
  const std::string& netns(int host) const;
  NetnsId netns_id(int host) const;
  const std::string& switch_netns() const { return switch_.name; }

  // Starts argv (argv[0] searched on the PATH of the child's environment) inside `host`: in its
  // own session and process group, killed when the calling thread dies (PR_SET_PDEATHSIG: call
  // from a thread that outlives the process, e.g. the test's, not from run_in), stdin /dev/null,
  // stdout and stderr appended to log_file, environment this process's plus extra_env. When the
  // program cannot be executed, the process writes why to log_file and exits with 127. Throws
  // std::runtime_error when the log cannot be opened or fork fails.
  pid_t spawn(int host, const std::vector<std::string>& argv,
              const std::map<std::string, std::string>& extra_env,
              const std::filesystem::path& log_file);

  // Exit codes here are the shell's: the status passed to exit(), or 128 + the signal that killed
  // the process (137 for SIGKILL).
  // The exit code of a process spawn() started, or nothing while it runs. Reaps it; asking again
  // returns the same code. Throws std::invalid_argument for a pid spawn() did not return, and
  // std::runtime_error when waitpid fails (something else in the process reaped it).
  std::optional<int> try_wait(pid_t pid);
  // The same, waiting up to `timeout`; throws std::runtime_error when the process still runs then
  // (it is left running).
  int wait(pid_t pid, std::chrono::milliseconds timeout);
  // Sends `sig` to the process (not to its group). A process that was already reaped is not
  // signalled (its pid may be another process's by now). Throws std::invalid_argument for pid <= 0
  // or this process, std::runtime_error when kill() fails otherwise.
  void kill(pid_t pid, int sig);

  // The processes living in the host's namespace, whoever started them.
  std::vector<pid_t> processes(int host) const;

  // Cuts the host off the switch (its port leaves the bridge) and restores it, in effect when the
  // call returns; both are idempotent. Meanwhile nothing in the host reaches another host, nor the
  // reverse (connections time out: the host's interface keeps its carrier, as behind a partition);
  // its processes keep running, and the host reaches its own address.
  void link_down(int host);
  void link_up(int host);

  // A host loses power: its link goes down first (so its processes' dying connections send
  // nothing to the others), then every process in its namespace is killed with SIGKILL and the
  // ones spawn() started are reaped (try_wait() then says 137). The link stays down: link_up()
  // brings the "rebooted" host back, empty. Throws std::runtime_error when processes survive 5 s.
  void kill_host(int host);

  // Runs fn on a new thread that has first entered the host's network namespace (a thread's own
  // setting: the caller's thread is unaffected), waits for it, and rethrows what fn throws.
  // Sockets fn creates stay in the host for their whole life and may be used from any thread
  // afterwards. fn must bound its own waits; it may use this cluster but not spawn() (see there).
  void run_in(int host, const std::function<void()>& fn) const;

 private:
  struct Namespace {
    std::string name;
    NetnsId id;
  };

  void build();
  void add_namespace(Namespace& ns);
  void teardown() noexcept;
  void check_host(int host) const;
  std::string switch_port(int host) const;
  // SIGKILLs the unreaped children spawn() started (in `host`, or all for -1) and reaps them until
  // `deadline`; returns the ones still unreaped then.
  std::vector<pid_t> kill_and_reap_children(int host,
                                            std::chrono::steady_clock::time_point deadline);

  std::string prefix_;  // tsl-<pid>-<n>[-<tag>]
  int subnet_x_ = 0, subnet_y_ = 0;
  UniqueFd subnet_reservation_;
  Namespace switch_;
  std::vector<Namespace> hosts_;    // every host's; a name is set once the namespace exists
  std::vector<Namespace> created_;  // namespaces to delete, in creation order
  bool bridge_created_ = false;
  int veths_created_ = 0;

  mutable std::mutex children_mutex_;
  std::map<pid_t, int> children_;    // spawned, not yet reaped: pid -> host
  std::map<pid_t, int> exit_codes_;  // reaped: pid -> exit code
};

// An etcd server inside one host, listening on the host's address (client port 2379, peer port
// 2380), as a single-member cluster with short heartbeats (10 ms, election 100 ms) so that it
// elects itself at once and grants leases as short as 1 s. The VirtualCluster must outlive it.
class NamespacedEtcd {
 public:
  // Starts etcd with its data in dir/data and its output in dir/etcd.log (dir is created; tmpfs is
  // fastest, etcd syncs every write), and waits up to 20 s until GET /health answers
  // "health":"true" from inside the host. Throws std::runtime_error, quoting the end of the log,
  // when it does not.
  NamespacedEtcd(VirtualCluster& cluster, int host, const std::filesystem::path& dir);
  // Kills etcd with SIGKILL and reaps it (bounded; never throws).
  ~NamespacedEtcd();
  NamespacedEtcd(const NamespacedEtcd&) = delete;
  NamespacedEtcd& operator=(const NamespacedEtcd&) = delete;

  std::string endpoint() const;  // "http://10.X.Y.<host + 1>:2379"
  pid_t pid() const { return pid_; }
  const std::filesystem::path& log_file() const { return log_; }
  // Whether GET /health answers "health":"true" within `timeout`, asked from inside `from_host`.
  bool healthy_from(int from_host, std::chrono::milliseconds timeout) const;

 private:
  void stop() noexcept;
  std::string log_tail() const;

  VirtualCluster& cluster_;
  int host_;
  std::filesystem::path log_;
  pid_t pid_ = -1;
};

}  // namespace tessel::testing
