// What a user gets wrong with a cluster, and what a cluster must survive: each is one clear
// message or is recovered from, and no worker is left running.
//   - an agent or a submitter pointed at an address where no etcd answers;
//   - a submission to a cluster no agent has joined (a wrong cluster name);
//   - a second job on a cluster that runs one;
//   - an agent whose host record is removed from etcd by hand: the job goes on from the other
//     host's replica, the agent fences its worker and joins again, and the job grows back;
//   - the submitter interrupted: the job saves and stops, and the agents run nothing more.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "tessel/comm/etcd_store.h"
#include "tessel/comm/etcd_test_util.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/failure_test_util.h"

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
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} agent --store http://127.0.0.1:{} 2>&1", tessel(), port), &out),
            1)
      << out;
  EXPECT_NE(out.find("no etcd answers at http://127.0.0.1:"), std::string::npos) << out;
  TempDir dir;
  const auto cfg =
      config::testing::write_config(dir, config::testing::make_corpus(dir), Job{5}.training());
  EXPECT_EQ(
      tessel::testing::run_command(
          fmt::format("{} train {} --cluster http://127.0.0.1:{} 2>&1", tessel(), cfg, port), &out),
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
  // Long enough never to end by itself: the test stops it.
  const auto cfg = config::testing::write_config(
      dir, corpus,
      "training: {steps: 100000, global_batch: 12, micro_batch: 2, threads: 1}\n"
      "parallel: {dp: 2, timeout_s: 20}\nelastic: {heartbeat_timeout_s: 2}\n"
      "output: {metrics: metrics.jsonl, events: events.jsonl}\n"
      "checkpoint: {dir: ck, every: 1000}\n");
  std::string out;

  // A cluster nobody joined.
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} train {} --cluster {}/nosuch 2>&1", tessel(), cfg, etcd.endpoint()),
                &out),
            2)
      << out;
  EXPECT_NE(out.find("no agent has joined cluster 'nosuch'"), std::string::npos) << out;

  // Two agents of one slot each.
  auto agent_log = [&](int i) { return read_text(dir / fmt::format("agent{}.log", i)); };
  std::vector<std::unique_ptr<Background>> agents;
  for (int i : {0, 1}) {
    agents.push_back(std::make_unique<Background>(
        fmt::format("OMP_NUM_THREADS=1 {} agent --store {} --slots 1 --lease-ttl 1 --name a{} "
                    "--work-dir {}",
                    tessel(), etcd.endpoint(), i, (dir / fmt::format("agent{}", i)).string()),
        dir / fmt::format("agent{}.log", i)));
    ASSERT_TRUE(
        wait_until([&] { return agent_log(i).find("joined cluster") != std::string::npos; }, 30s))
        << agent_log(i);
  }
  auto logs = [&] {
    return read_text(dir / "train.out") + "--- agent 0:\n" + agent_log(0) + "--- agent 1:\n" +
           agent_log(1);
  };
  Background job(fmt::format("cd {} && exec {} train {} --cluster {}", dir.path().string(),
                             tessel(), cfg, etcd.endpoint()),
                 dir / "train.out");
  auto steps = [&] {
    return std::filesystem::exists(dir / "metrics.jsonl") ? read_lines(dir / "metrics.jsonl").size()
                                                          : size_t(0);
  };
  ASSERT_TRUE(wait_until([&] { return steps() >= 3; }, 60s)) << logs();

  // A second job while it runs.
  EXPECT_EQ(tessel::testing::run_command(
                fmt::format("{} train {} --cluster {} 2>&1", tessel(), cfg, etcd.endpoint()), &out),
            2)
      << out;
  EXPECT_NE(out.find("cluster 'default' runs job"), std::string::npos) << out;

  // The record of the host that does not coordinate, removed by hand: the coordinator counts
  // that host lost and goes on from the other's replica; the agent fences its worker, joins
  // again, and the job grows back onto it.
  const int other = agent_log(0).find("coordinates job") != std::string::npos ? 1 : 0;
  comm::EtcdStore store(etcd.endpoint());
  int id = -1;
  for (const auto& h : list_hosts(store, "default"))
    if (h.name == fmt::format("a{}", other)) id = h.id;
  ASSERT_GE(id, 0) << logs();
  ASSERT_TRUE(store.erase(host_key("default", id)));
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

  // The submitter interrupted: the job saves at its next step boundary and stops; the agents
  // keep running, every worker they started ended.
  const size_t before = steps();
  ASSERT_TRUE(wait_until([&] { return steps() >= before + 2; }, 60s)) << logs();
  job.signal(SIGINT);
  EXPECT_EQ(job.wait(120s), 128 + SIGTERM) << logs();
  EXPECT_NE(read_text(dir / "train.out").find("run the same command to resume"), std::string::npos)
      << logs();
  EXPECT_TRUE(checkpoint::newest_intact_checkpoint((dir / "ck").string()).has_value());
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
