// What a user gets wrong with a cluster, and what a cluster must survive: each is one clear
// message or is recovered from, and no worker is left running.
//   - an agent or a submitter pointed at an address where no etcd answers;
//   - a submission to a cluster no agent has joined (a wrong cluster name);
//   - a second job on a cluster that runs one;
//   - agents and submitters without the cluster's token file, or with another cluster's, and a
//     host record written into etcd without the secret;
//   - hosts whose wall clocks jump (an NTP step, a VM restored from a snapshot): one an hour
//     ahead, the other an hour behind, while the job runs and while it recovers;
//   - an agent whose host record is removed from etcd by hand: the job goes on from the other
//     host's replica, the agent fences its worker and joins again, and the job grows back;
//   - the submitter interrupted: the job saves and stops, and the agents run nothing more.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "tessel/comm/etcd_store.h"
#include "tessel/comm/etcd_test_util.h"
#include "tessel/core/clock.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/failure_test_util.h"
#include "tessel/net/bearer_token.h"

namespace tessel::elastic {
namespace {

using namespace std::chrono_literals;
using namespace tessel::elastic::testing;
using tessel::testing::TempDir;

std::string tessel() {
  return tessel::testing::tessel_binary().string();
}

// A process started with `sh -c`, killed (with its process group) when the test ends.
class Background {
 public:
  Background(const std::string& command, const std::filesystem::path& log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      const std::string line = command + " > " + log.string() + " 2>&1";
      ::execl("/bin/sh", "sh", "-c", line.c_str(), nullptr);
      ::_exit(127);
    }
  }
  ~Background() {
    if (pid_ > 0) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  void signal(int sig) { ::kill(-pid_, sig); }
  // The exit status, or -1 when it did not end within `limit`.
  int wait(std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(20ms);
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

bool wait_until(const std::function<bool()>& done, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

TEST(ClusterErrors, NoEtcdAtTheAddressIsOneClearMessage) {
  const int port = comm::testing::free_port();
  std::string out;
  TempDir dir;
  const auto token = write_cluster_token(dir, "cluster.token", "the-clusters-secret-0123456789");
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} agent --store http://127.0.0.1:{} --token-file {} 2>&1", tessel(),
                            port, token),
                &out),
            1)
      << out;
  EXPECT_NE(out.find("no etcd answers at http://127.0.0.1:"), std::string::npos) << out;
  const auto cfg =
      config::testing::write_config(dir, config::testing::make_corpus(dir), Job{5}.training());
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} train {} --cluster http://127.0.0.1:{} --token-file {} 2>&1",
                            tessel(), cfg, port, token),
                &out),
            1)
      << out;
  EXPECT_NE(out.find("--cluster: no etcd answers at"), std::string::npos) << out;
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} agent --store 127.0.0.1:{} 2>&1", tessel(), port), &out),
            2)
      << out;
  EXPECT_NE(out.find("is not etcd's client URL"), std::string::npos) << out;
  EXPECT_NE(
      tessel::testing::run_command(
          fmt::format("{} agent --store http://127.0.0.1:{} --slots 0 2>&1", tessel(), port), &out),
      0)
      << out;
}

TEST(ClusterErrors, WrongClusterSecondJobHandRemovedHostAndInterruptedSubmitter) {
  const auto etcd_binary = comm::testing::find_etcd();
  if (!etcd_binary) GTEST_SKIP() << comm::testing::kNoEtcd;
  comm::testing::EtcdServer etcd(*etcd_binary);
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  // Long enough never to end by itself: the test stops it. Leases (3 s) and heartbeats (6 s) with
  // room for a loaded machine: at 1 s and 2 s a renewal stalled behind other tests' processes on
  // two cores could count a live host or worker lost, a recovery the checks below take for one
  // the clock jump or the unsigned record caused (the test failed once so under ctest -j2).
  const auto cfg = config::testing::write_config(
      dir, corpus,
      "training: {steps: 100000, global_batch: 12, micro_batch: 2, threads: 1}\n"
      "parallel: {dp: 2, timeout_s: 20}\nelastic: {heartbeat_timeout_s: 6}\n"
      "output: {metrics: metrics.jsonl, events: events.jsonl}\n"
      "checkpoint: {dir: ck, every: 1000}\n");
  std::string out;
  const auto token = write_cluster_token(dir, "cluster.token", "the-clusters-secret-0123456789");
  const auto foreign = write_cluster_token(dir, "other.token", "another-clusters-secret-98765");

  // A cluster nobody joined.
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} train {} --cluster {}/nosuch --token-file {} 2>&1", tessel(), cfg,
                            etcd.endpoint(), token),
                &out),
            2)
      << out;
  EXPECT_NE(out.find("no agent has joined cluster 'nosuch'"), std::string::npos) << out;

  // Two agents of one slot each, each with its own wall clock (testing/fake_clock.c), which the
  // test makes jump. (ASan must be told that a library preloaded before its runtime is fine.)
  auto agent_log = [&](int i) { return read_text(dir / fmt::format("agent{}.log", i)); };
  auto clock_file = [&](int i) { return dir / fmt::format("clock{}", i); };
  auto set_clock = [&](int i, int offset_s) { std::ofstream(clock_file(i)) << offset_s << "\n"; };
  const auto fake_clock = std::filesystem::path(TESSEL_BINARY_DIR) / "libtessel_fake_clock.so";
  ASSERT_TRUE(std::filesystem::exists(fake_clock)) << fake_clock;
  const char* asan = std::getenv("ASAN_OPTIONS");
  std::vector<std::unique_ptr<Background>> agents;
  for (int i : {0, 1}) {
    set_clock(i, 0);
    agents.push_back(std::make_unique<Background>(
        fmt::format("LD_PRELOAD={} TESSEL_FAKE_CLOCK_FILE={} "
                    "ASAN_OPTIONS={}verify_asan_link_order=0 OMP_NUM_THREADS=1 {} agent --store {} "
                    "--slots 1 --lease-ttl 3 --name a{} --work-dir {} --token-file {} "
                    "--checkpoint-dir {}",
                    fake_clock.string(), clock_file(i).string(),
                    asan ? std::string(asan) + ":" : std::string(), tessel(), etcd.endpoint(), i,
                    (dir / fmt::format("agent{}", i)).string(), token,
                    (dir / fmt::format("ck-a{}", i)).string()),
        dir / fmt::format("agent{}.log", i)));
    ASSERT_TRUE(
        wait_until([&] { return agent_log(i).find("joined cluster") != std::string::npos; }, 30s))
        << agent_log(i);
  }
  auto logs = [&] {
    return read_text(dir / "train.out") + "--- agent 0:\n" + agent_log(0) + "--- agent 1:\n" +
           agent_log(1);
  };
  // Without a token file, or with another cluster's: refused, each in one message.
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} agent --store {} --slots 1 2>&1", tessel(), etcd.endpoint()), &out),
            2)
      << out;
  EXPECT_NE(out.find("tessel agent needs the cluster's token file"), std::string::npos) << out;
  EXPECT_NE(tessel::testing::run_command(
                fmt::format("{} agent --store {} --slots 1 --token-file {} --work-dir {} 2>&1",
                            tessel(), etcd.endpoint(), foreign, (dir / "foreign").string()),
                &out),
            0)
      << out;
  EXPECT_NE(out.find("cluster 'default' is signed with another secret"), std::string::npos) << out;
  EXPECT_NE(
      tessel::testing::run_command(fmt::format("{} train {} --cluster {} --token-file {} 2>&1",
                                               tessel(), cfg, etcd.endpoint(), foreign),
                                   &out),
      0)
      << out;
  EXPECT_NE(out.find("cluster 'default' is signed with another secret"), std::string::npos) << out;

  Background job(fmt::format("cd {} && {}={} exec {} train {} --cluster {}", dir.path().string(),
                             kClusterTokenEnv, token, tessel(), cfg, etcd.endpoint()),
                 dir / "train.out");
  auto steps = [&] {
    return std::filesystem::exists(dir / "metrics.jsonl") ? read_lines(dir / "metrics.jsonl").size()
                                                          : size_t(0);
  };
  ASSERT_TRUE(wait_until([&] { return steps() >= 3; }, 60s)) << logs();

  // A second job while it runs.
  EXPECT_EQ(
      tessel::testing::run_command(fmt::format("{} train {} --cluster {} --token-file {} 2>&1",
                                               tessel(), cfg, etcd.endpoint(), token),
                                   &out),
      2)
      << out;
  EXPECT_NE(out.find("cluster 'default' runs job"), std::string::npos) << out;

  // The hosts' wall clocks jump apart: one an hour ahead, the other an hour behind. Nothing
  // waits on the wall clock (leases expire on etcd's clock, timeouts run on each process's steady
  // clock), so no host counts as lost and the job goes on without a recovery. The clocks stay
  // apart through the recovery below, whose control-plane share is measured across them.
  for (int i : {0, 1}) set_clock(i, i == 0 ? 3600 : -3600);
  const size_t jumped = steps();
  ASSERT_TRUE(wait_until([&] { return steps() >= jumped + 4; }, 60s)) << logs();
  // The jump took effect: the step records (stamped on the wall clock of rank 0's host) are an
  // hour away from this process's clock.
  const double now = tessel::unix_seconds();
  EXPECT_GT(std::abs(read_lines(dir / "metrics.jsonl").back().at("time").get<double>() - now),
            3000.0)
      << logs();
  EXPECT_FALSE(std::filesystem::exists(dir / "events.jsonl") &&
               !read_lines(dir / "events.jsonl").empty())
      << "a clock jump caused a reconfiguration:\n"
      << logs();

  // A host record written without the secret (4 slots: the job would grow onto it): nobody
  // believes it. The coordinator says so, and places nothing there.
  comm::EtcdStore raw(etcd.endpoint());
  HostRecord fake;
  fake.id = 999;
  fake.name = "intruder";
  fake.address = "127.0.0.1";
  fake.slots = 4;
  raw.set(host_key("default", 999), fake.to_json().dump());
  // The coordinator reads the record when its watch fires, which may be many steps later (a step
  // of this model takes a few milliseconds): wait for the warning, then for steps after it.
  EXPECT_TRUE(wait_until(
      [&] {
        return (agent_log(0) + agent_log(1)).find(host_key("default", 999)) != std::string::npos;
      },
      30s))
      << "no warning about the unsigned host record\n"
      << logs();
  const size_t faked = steps();
  ASSERT_TRUE(wait_until([&] { return steps() >= faked + 3; }, 60s)) << logs();
  EXPECT_FALSE(std::filesystem::exists(dir / "events.jsonl") &&
               !read_lines(dir / "events.jsonl").empty())
      << logs();
  raw.erase(host_key("default", 999));

  // The record of the host that does not coordinate, removed by hand: the coordinator counts
  // that host lost and goes on from the other's replica; the agent fences its worker, joins
  // again, and the job grows back onto it.
  const int other = agent_log(0).find("coordinates job") != std::string::npos ? 1 : 0;
  const auto store =
      open_cluster_store(etcd.endpoint(), net::read_token_file(token, "test"), "default");
  int id = -1;
  for (const auto& h : list_hosts(*store, "default"))
    if (h.name == fmt::format("a{}", other)) id = h.id;
  ASSERT_GE(id, 0) << logs();
  ASSERT_TRUE(store->erase(host_key("default", id)));
  ASSERT_TRUE(wait_until(
      [&] {
        return agent_log(other).find("was removed from etcd while its lease lived") !=
               std::string::npos;
      },
      30s))
      << logs();
  ASSERT_TRUE(wait_until(
      [&] {
        const auto events = std::filesystem::exists(dir / "events.jsonl")
                                ? read_lines(dir / "events.jsonl")
                                : std::vector<nlohmann::json>{};
        return events.size() >= 2 && events.back().at("new_workers") == 2;
      },
      90s))
      << logs();
  const auto events = read_lines(dir / "events.jsonl");
  EXPECT_EQ(events[0].at("event"), "recover") << events[0].dump();
  EXPECT_EQ(events[0].at("restored_from"), "survivors") << events[0].dump();
  // Two hours between the clocks that stamped the decision and the switch; the share reported
  // is bounded by what the worker's own steady clock saw.
  for (const auto& e : events) {
    EXPECT_GE(e.at("control_s").get<double>(), 0.0) << e.dump();
    EXPECT_LT(e.at("control_s").get<double>(), 60.0) << e.dump();
  }

  // The submitter interrupted: the job saves at its next step boundary and stops; the agents
  // keep running, every worker they started ended.
  const size_t before = steps();
  ASSERT_TRUE(wait_until([&] { return steps() >= before + 2; }, 60s)) << logs();
  job.signal(SIGINT);
  EXPECT_EQ(job.wait(120s), 128 + SIGTERM) << logs();
  EXPECT_NE(read_text(dir / "train.out").find("run the same command to resume"), std::string::npos)
      << logs();
  // Each host's own disk holds the save: its rank file and a copy of the other's (two hosts).
  for (int i : {0, 1})
    EXPECT_TRUE(
        checkpoint::newest_intact_checkpoint((dir / fmt::format("ck-a{}", i)).string()).has_value())
        << logs();
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = 0; (at = text.find(what, at)) != std::string::npos; ++at) ++n;
    return n;
  };
  for (int i : {0, 1}) {
    EXPECT_TRUE(wait_until(
        [&] {
          const auto log = agent_log(i);
          return count(log, "agent: started process") ==
                 count(log, "exited with") + count(log, "was killed by");
        },
        30s))
        << agent_log(i);
  }
}

}  // namespace
}  // namespace tessel::elastic
