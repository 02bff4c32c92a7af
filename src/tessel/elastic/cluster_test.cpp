// A job on a cluster of hosts across real network boundaries, on one machine: each host a Linux
// network namespace (testing/netns.h) with its own address, joined to the others through a
// bridge; etcd in one of them, a `tessel agent` in the others, the job submitted with
// `tessel train --cluster`. Hosts join, are killed whole (every process, and the link), are cut
// off without being killed (and come back), and the coordinator's host dies; after all of it the
// job computed what an uninterrupted single-process run computes, step by step, on exactly the
// uninterrupted data order, and its event log names every loss.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <stdexcept>
#include <thread>

#include "tessel/elastic/failure_test_util.h"
#include "tessel/testing/netns.h"

namespace tessel::elastic {
namespace {

using namespace tessel::elastic::testing;
using namespace std::chrono_literals;
using tessel::testing::NamespacedEtcd;
using tessel::testing::TempDir;
using tessel::testing::VirtualCluster;

// Waits (bounded) until `done` holds; fails the test naming `what` and showing `context()`.
bool wait_for(const std::function<bool()>& done, std::chrono::seconds limit,
              const std::string& what, const std::function<std::string()>& context) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(50ms);
  }
  ADD_FAILURE() << "waited " << limit.count() << " s for " << what << "\n" << context();
  return false;
}

size_t count_lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

// The cluster: host 0 runs etcd and the submitter, hosts 1.. one agent each (named h<i>).
struct Cluster {
  TempDir& dir;
  std::filesystem::path etcd_dir;
  VirtualCluster net;
  NamespacedEtcd etcd;
  std::map<int, pid_t> agents;
  std::string token;  // the cluster's token file

  Cluster(TempDir& d, int hosts)
      : dir(d),
        etcd_dir(memory_dir()),
        net(hosts, "cl"),
        etcd(net, 0, etcd_dir),
        token(write_cluster_token(d, "cluster.token", "cluster-test-secret-0123456789")) {}
  ~Cluster() {
    std::error_code ec;
    std::filesystem::remove_all(etcd_dir, ec);
  }
  // etcd syncs every write: on a loaded machine's disk a sync can stall it for seconds, longer
  // than a lease. Its data goes to memory where there is a tmpfs.
  static std::filesystem::path memory_dir() {
    std::string templ =
        (::access("/dev/shm", W_OK) == 0 ? std::string("/dev/shm") : std::string("/tmp")) +
        "/tessel-cluster-etcd-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    return templ;
  }

  // Each host's own disk, for the job's checkpoints.
  std::filesystem::path checkpoint_dir(int host) const {
    return dir.path() / fmt::format("ck-h{}", host);
  }
  std::vector<std::filesystem::path> checkpoint_dirs() const {
    std::vector<std::filesystem::path> out;
    for (int h = 1; h < net.hosts(); ++h) out.push_back(checkpoint_dir(h));
    return out;
  }
  // `tessel train CONFIG --cluster ...` from host 0, its output in train.out.
  pid_t submit(const std::string& cfg) {
    return net.spawn(0,
                     {tessel::testing::tessel_binary().string(), "train", cfg, "--cluster",
                      etcd.endpoint(), "--token-file", token},
                     {}, dir / "train.out");
  }
  // Whether checkpoint `step` is published on host `host`'s disk (the agents publish a commit
  // as they see it, so the job's last one may come after the job ended).
  bool published(int host, int64_t step) const {
    return std::filesystem::exists(checkpoint_dir(host) / checkpoint::checkpoint_step_name(step) /
                                   "manifest.json");
  }
  std::filesystem::path agent_log(int host) const {
    return dir.path() / fmt::format("agent-h{}.log", host);
  }
  void start_agent(int host) {
    agents[host] = net.spawn(
        host,
        {tessel::testing::tessel_binary().string(), "agent", "--store", etcd.endpoint(), "--iface",
         net.iface(host), "--slots", "1", "--name", fmt::format("h{}", host), "--work-dir",
         (dir.path() / fmt::format("work-h{}", host)).string(), "--token-file", token,
         "--checkpoint-dir", checkpoint_dir(host).string(),
         // Generous for a machine running the whole suite: a starved renewal must not make a
         // healthy host count as lost (detection speed is the benchmark's, not this test's).
         "--lease-ttl", "3"},
        {{"OMP_NUM_THREADS", "1"}}, agent_log(host));
  }
  // The cluster's host id an agent registered under last (-1: none yet).
  int host_id(int host) const {
    // Lines "agent: host <id> (h<n>, ..." (parsed by hand: GCC 12 warns inside <regex> under the
    // sanitizers, and warnings are errors).
    const std::string log = read_text(agent_log(host));
    const std::string marker = "agent: host ";
    int id = -1;
    for (auto at = log.find(marker); at != std::string::npos; at = log.find(marker, at + 1)) {
      size_t end = at + marker.size();
      while (end < log.size() && std::isdigit(static_cast<unsigned char>(log[end]))) ++end;
      if (end == at + marker.size() || log.compare(end, 3, " (h") != 0) continue;
      id = std::stoi(log.substr(at + marker.size(), end - at - marker.size()));
    }
    return id;
  }
  // The namespace whose agent coordinates the job now (-1: none known).
  int coordinator() const {
    int found = -1;
    double newest = -1;
    for (const auto& [host, pid] : agents) {
      const std::string log = read_text(agent_log(host));
      const auto at = log.rfind(" coordinates job ");
      if (at == std::string::npos) continue;
      // Lines start with "[YYYY-mm-dd HH:MM:SS.mmm]": the newest election wins.
      const auto line = log.rfind("\n[", at);
      const std::string stamp = log.substr(line == std::string::npos ? 1 : line + 2, 23);
      const double t = std::stod(stamp.substr(11, 2)) * 3600 + std::stod(stamp.substr(14, 2)) * 60 +
                       std::stod(stamp.substr(17));
      if (t > newest) newest = t, found = host;
    }
    return found;
  }
  std::string logs() const {
    std::string all = "--- train:\n" + read_text(dir.path() / "train.out");
    for (const auto& [host, pid] : agents)
      all += fmt::format("--- agent h{}:\n{}", host, read_text(agent_log(host)));
    return all;
  }
};

TEST(Cluster, HostsJoinDieAreCutOffAndTheCoordinatorMoves) {
  if (const auto why = tessel::testing::netns_unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (const auto why = tessel::testing::etcd_unavailable(); !why.empty()) GTEST_SKIP() << why;
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{240};
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job.config() + "parallel: {dp: 2, timeout_s: 20}\nelastic: {heartbeat_timeout_s: 4}\n");
  Cluster c(dir, 5);
  auto context = [&] { return c.logs(); };
  for (int h : {1, 2}) c.start_agent(h);
  ASSERT_TRUE(wait_for([&] { return c.host_id(1) >= 0 && c.host_id(2) >= 0; }, 30s,
                       "two agents to join", context));
  const pid_t train = c.submit(cfg);
  const auto metrics = dir / "metrics.jsonl";
  const auto events = dir / "events.jsonl";
  auto steps_past = [&](size_t n) { return [&, n] { return count_lines(metrics) >= n; }; };
  auto event_count = [&](size_t n) {
    return [&, n] { return std::filesystem::exists(events) && count_lines(events) >= n; };
  };

  // 1. A third host joins: the job grows to 3 workers at a step boundary.
  ASSERT_TRUE(wait_for(steps_past(10), 60s, "10 steps on two hosts", context));
  c.start_agent(3);
  ASSERT_TRUE(wait_for(event_count(1), 60s, "the switch to three hosts", context));
  EXPECT_EQ(read_lines(events).back().at("new_workers"), 3);

  // 2. A host other than the coordinator's dies whole: the survivors go on from their replicas.
  const size_t at_kill = count_lines(metrics);
  ASSERT_TRUE(wait_for(steps_past(at_kill + 5), 60s, "5 steps on three hosts", context));
  int coordinator = c.coordinator();
  ASSERT_GT(coordinator, 0) << context();
  const int victim = coordinator == 1 ? 2 : 1;
  c.net.kill_host(victim);
  ASSERT_TRUE(wait_for(event_count(2), 60s, "the recovery from a killed host", context));
  auto recovered = read_lines(events).back();
  EXPECT_EQ(recovered.at("event"), "recover") << recovered.dump();
  EXPECT_EQ(recovered.at("restored_from"), "survivors") << recovered.dump();
  EXPECT_NE(recovered.at("cause").get<std::string>().find(fmt::format("(h{})", victim)),
            std::string::npos)
      << recovered.dump();

  // 3. The other non-coordinator host is cut off without being killed: its lease expires, the job
  // recovers without it; once the link is back its agent fences its old workers and the host
  // joins as a new one, which the job grows onto again.
  const size_t at_cut = count_lines(metrics);
  ASSERT_TRUE(wait_for(steps_past(at_cut + 5), 60s, "5 steps after the recovery", context));
  const int cut = coordinator == 3 ? (victim == 1 ? 2 : 1) : 3;
  const int old_id = c.host_id(cut);
  c.net.link_down(cut);
  ASSERT_TRUE(wait_for(event_count(3), 60s, "the recovery from a cut-off host", context));
  recovered = read_lines(events).back();
  EXPECT_EQ(recovered.at("event"), "recover") << recovered.dump();
  EXPECT_EQ(recovered.at("new_workers"), 1) << recovered.dump();
  c.net.link_up(cut);
  ASSERT_TRUE(wait_for([&] { return c.host_id(cut) > old_id; }, 60s,
                       "the cut-off host to fence its workers and join again", context));
  EXPECT_NE(read_text(c.agent_log(cut)).find("killing its"), std::string::npos) << context();
  ASSERT_TRUE(
      wait_for(event_count(4), 60s, "the job to grow onto the host that came back", context));
  EXPECT_EQ(read_lines(events).back().at("new_workers"), 2);

  // 4. The coordinator's host dies: the other agent takes over and the job goes on.
  const size_t at_coordinator = count_lines(metrics);
  ASSERT_TRUE(wait_for(steps_past(at_coordinator + 5), 60s, "5 steps on two hosts", context));
  coordinator = c.coordinator();
  c.net.kill_host(coordinator);
  ASSERT_TRUE(wait_for(event_count(5), 60s, "the recovery from the coordinator's loss", context));
  EXPECT_NE(read_text(c.agent_log(cut)).find("took over"), std::string::npos) << context();

  ASSERT_EQ(c.net.wait(train, 300s), 0) << context();
  for (const auto& e : read_lines(events)) {
    if (e.at("event") == "recover") {
      EXPECT_LE(e.at("steps_lost").get<int64_t>(), 1) << e.dump();
    }
  }
  // At most one step unlogged per failure (its loss was being reduced when the host went). While
  // one host ran the job alone (the third phase), its checkpoints had no second copy.
  ASSERT_TRUE(wait_for(
      [&] {
        for (int h = 1; h < c.net.hosts(); ++h)
          if (c.published(h, job.steps)) return true;
        return false;
      },
      30s, "the last checkpoint published on a host", context));
  gather_host_checkpoints(c.checkpoint_dirs(), dir / "ck", 1);
  expect_like_one_process(dir, corpus, job, 3);
}

// State that no survivor holds comes back from the checkpoints on the hosts' own disks: a
// pipeline of two stages on h1 and h2 (h3 idle) saves every step, each rank file on its own host
// and copied to the previous host (h1's to h3, h2's to h1). h1 is killed whole: its stage has no
// other copy in memory, so the job rolls back to the newest checkpoint, on h2 and h3, and one of
// them reads what it needs of the rank file it does not hold from the other host's tensor store.
TEST(Cluster, StateNoSurvivorHoldsIsReadBackFromAnotherHostsDisk) {
  if (const auto why = tessel::testing::netns_unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (const auto why = tessel::testing::etcd_unavailable(); !why.empty()) GTEST_SKIP() << why;
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{40};
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job.config() +
          "parallel: {pp: 2, timeout_s: 20}\n"
          "elastic: {heartbeat_timeout_s: 4, grow_to_slots: false}\n");
  Cluster c(dir, 4);
  auto context = [&] { return c.logs(); };
  // One after the other, so that host ids follow the namespaces.
  for (int h : {1, 2, 3}) {
    c.start_agent(h);
    ASSERT_TRUE(wait_for([&] { return c.host_id(h) >= 0; }, 30s, "an agent to join", context));
  }
  ASSERT_LT(c.host_id(1), c.host_id(2));
  ASSERT_LT(c.host_id(2), c.host_id(3));
  const pid_t train = c.submit(cfg);
  const auto metrics = dir / "metrics.jsonl";
  const auto events = dir / "events.jsonl";
  ASSERT_TRUE(wait_for([&] { return count_lines(metrics) >= 10; }, 60s, "10 steps", context));
  c.net.kill_host(1);
  ASSERT_TRUE(wait_for([&] { return std::filesystem::exists(events) && count_lines(events) >= 1; },
                       60s, "the recovery from the killed host", context));
  const auto recovered = read_lines(events).back();
  EXPECT_EQ(recovered.at("event"), "recover") << recovered.dump();
  EXPECT_NE(recovered.at("restored_from"), "survivors") << recovered.dump();
  EXPECT_LE(recovered.at("steps_lost").get<int64_t>(), 1) << recovered.dump();
  ASSERT_EQ(c.net.wait(train, 300s), 0) << context();

  // Some rank read part of its state from the other host.
  std::string worker_logs;
  for (int h : {2, 3})
    for (const auto& f :
         std::filesystem::directory_iterator(dir.path() / fmt::format("work-h{}", h)))
      worker_logs += read_text(f.path());
  EXPECT_NE(worker_logs.find("read from other hosts"), std::string::npos) << worker_logs;
  // Every checkpoint had each rank file on two hosts (three, then two, served the job). The
  // agents publish the last one on their disks as they see its commit.
  ASSERT_TRUE(wait_for([&] { return c.published(2, job.steps); }, 30s,
                       "the last checkpoint published on h2", context));
  gather_host_checkpoints(c.checkpoint_dirs(), dir / "ck", 2);
  expect_like_one_process(dir, corpus, job, 1);
}

}  // namespace
}  // namespace tessel::elastic
