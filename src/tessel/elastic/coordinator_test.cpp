// The coordinator: control commands, and live scaling of a running job by `tessel ctl scale N`
// with the losses of one uninterrupted single-process run.
#include "tessel/elastic/coordinator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tessel/comm/etcd_store.h"
#include "tessel/comm/etcd_test_util.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/elastic/decider.h"
#include "tessel/elastic/reconfiguration.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic {
namespace {

using tessel::testing::TempDir;

constexpr int64_t kSteps = 150;
const std::string kTraining =
    "training: {steps: 150, global_batch: 12, micro_batch: 2, threads: 1}\n"
    "optimizer: {lr: 0.003, warmup_steps: 1}\n"
    "output: {metrics: metrics.jsonl, events: events.jsonl}\n";

// The record a command leads to, as the workers read it from the job's control store.
std::optional<Reconfiguration> record_of(Coordinator& c, const std::string& job, int g) {
  auto kv = c.store().get(record_key(job, g));
  if (!kv) return std::nullopt;
  return Reconfiguration::from_json(nlohmann::json::parse(kv->value), kv->key);
}

TEST(Coordinator, ScaleRequestsAreCheckedByThePlannerAndPublishedForTheWorkers) {
  TempDir dir;
  setenv("TESSEL_CTL_DIR", (dir / "ctl").c_str(), 1);
  auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(), kTraining + "parallel: {dp: 2}\n"));
  Coordinator c(cfg, "job1", 2);
  EXPECT_TRUE(std::filesystem::exists(c.socket_path()));
  // Only this user reaches the job (docs/security.md).
  struct stat st {};
  ASSERT_EQ(::stat(c.socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat((dir / "ctl").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(c.endpoint().rfind("http://127.0.0.1:", 0), 0u) << c.endpoint();
  std::vector<std::pair<int, std::string>> spawned;
  auto spawn = [&](int p, const std::map<std::string, std::string>& env) {
    spawned.emplace_back(p, env.at("TESSEL_JOIN_GENERATION"));
  };
  auto ok = c.handle("scale 3");
  EXPECT_EQ(ok.rfind("ok: request 1: 3 workers", 0), 0u) << ok;
  c.tick({spawn, nullptr});
  auto r = record_of(c, "job1", 1);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->to.world(), 3);
  EXPECT_EQ(r->request, 1);
  EXPECT_EQ(spawned, (std::vector<std::pair<int, std::string>>{{2, "1"}}));
  // A count no layout fits: refused with the planner's reason, nothing published.
  auto refused = c.handle("scale 13");
  EXPECT_EQ(refused.rfind("refused:", 0), 0u) << refused;
  EXPECT_NE(refused.find("13 workers"), std::string::npos) << refused;
  c.tick({spawn, nullptr});
  EXPECT_FALSE(record_of(c, "job1", 2));
  EXPECT_EQ(c.handle("scale 0").rfind("refused:", 0), 0u);
  // One whole number, nothing else: before, these were carried out as 2, 2 and 1 workers.
  for (const char* loose : {"scale 2.5", "scale 2abc", "scale 1 2", "scale", "scale -1"})
    EXPECT_EQ(c.handle(loose).rfind("refused:", 0), 0u) << loose << ": " << c.handle(loose);
  c.tick({spawn, nullptr});
  EXPECT_FALSE(record_of(c, "job1", 2));
  EXPECT_EQ(c.handle("grow").rfind("refused: unknown command", 0), 0u);
  EXPECT_EQ(c.handle("status").rfind("ok: job job1", 0), 0u);
  // A second coordinator of the same job on the same store would split its decisions.
  EXPECT_THROW(
      Decider(cfg, std::shared_ptr<comm::ControlStore>(&c.store(), [](auto*) {}), "job1", 2, 0),
      ConfigError);
  // No job: a clear error, not a hang.
  EXPECT_THROW(send_control_command("nope", "status", 500), IoError);
  // A socket left by a killed launcher (nothing listens on it) does not make "several jobs".
  {
    const auto stale = (dir / "ctl" / "dead-job.sock").string();
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, stale.c_str(), sizeof a.sun_path - 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
    ::close(fd);  // bound, never listened on: what a dead process leaves
    // The launcher's loop, here a thread, answers while the client waits.
    std::atomic<bool> done{false};
    std::thread loop([&] {
      while (!done) {
        c.tick({spawn, nullptr});
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    std::string reply;
    try {
      reply = send_control_command("", "status", 5000);
    } catch (const std::exception& e) {
      reply = e.what();
    }
    done = true;
    loop.join();
    EXPECT_EQ(reply.rfind("ok: job job1", 0), 0u) << reply;
  }
  // A client that sends one byte at a time holds the coordinator 200 ms at most, then gets an
  // answer to what it sent.
  {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, c.socket_path().c_str(), sizeof a.sun_path - 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(::write(fd, "s", 1), 1);
    std::thread trickle([fd] {
      for (const char ch : std::string("tatus")) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        if (::write(fd, &ch, 1) != 1) return;
      }
    });
    c.tick({spawn, nullptr});
    // Answered with what had come within its window (a prefix of "status"), not after waiting
    // for the whole word (1.5 s away); before, it waited up to 1 s per byte, 4096 bytes.
    char reply[256] = {};
    const ssize_t n = ::recv(fd, reply, sizeof reply - 1, 0);
    trickle.join();
    ::close(fd);
    ASSERT_GT(n, 0);
    EXPECT_EQ(std::string(reply).rfind("refused: unknown command 's", 0), 0u) << reply;
  }
  unsetenv("TESSEL_CTL_DIR");
}

// A socket left by a launcher that was killed (nobody listens; older than a minute) is removed
// when the next job starts in the same directory; a fresh one (a job that has bound but may not
// listen yet) and a live job's socket are not.
TEST(Coordinator, AStaleControlSocketIsRemovedWhenTheNextJobStarts) {
  TempDir dir;
  const auto ctl = dir / "ctl";
  std::filesystem::create_directories(ctl);
  setenv("TESSEL_CTL_DIR", ctl.c_str(), 1);
  // Bound, then closed without unlinking: what a SIGKILLed launcher leaves.
  auto leave_socket = [&](const std::string& name) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const auto path = (ctl / name).string();
    std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    EXPECT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
    ::close(fd);
    return ctl / name;
  };
  const auto stale = leave_socket("killed.sock");
  const auto fresh = leave_socket("starting.sock");
  std::filesystem::last_write_time(
      stale, std::filesystem::file_time_type::clock::now() - std::chrono::minutes(5));
  auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(), kTraining + "parallel: {dp: 2}\n"));
  Coordinator live(cfg, "live", 2);
  std::filesystem::last_write_time(
      live.socket_path(), std::filesystem::file_time_type::clock::now() - std::chrono::minutes(5));
  Coordinator next(cfg, "next", 2);
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(fresh));
  EXPECT_TRUE(std::filesystem::exists(live.socket_path()));
  EXPECT_TRUE(std::filesystem::exists(next.socket_path()));
  unsetenv("TESSEL_CTL_DIR");
}

// The watched hosts file: a changed count of worker slots becomes a scale request; the same
// count, blank lines and comments do not; a count the planner refuses publishes nothing.
TEST(Coordinator, HostsFileChangesBecomeScaleRequests) {
  TempDir dir;
  setenv("TESSEL_CTL_DIR", (dir / "ctl").c_str(), 1);
  auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(),
      kTraining + "parallel: {dp: 2}\nelastic: {hosts_file: hosts.txt}\n"));
  EXPECT_EQ(cfg.hosts_file, (dir / "hosts.txt").string());
  Coordinator c(cfg, "job2", 2);
  auto spawn = [](int, const std::map<std::string, std::string>&) {};
  auto write_hosts = [&](const std::string& text) {
    std::ofstream(dir / "hosts.txt") << text;
    // A new modification time for each version (some filesystems count in coarse ticks).
    static int bump = 0;
    std::filesystem::last_write_time(
        dir / "hosts.txt",
        std::filesystem::file_time_type::clock::now() + std::chrono::seconds(++bump));
  };
  c.tick({spawn, nullptr});               // no file yet: nothing
  write_hosts("localhost\nlocalhost\n");  // 2 slots: what the job has
  c.tick({spawn, nullptr});
  EXPECT_FALSE(record_of(c, "job2", 1));
  write_hosts("# three slots\nlocalhost\n\nlocalhost\nlocalhost\n");
  c.tick({spawn, nullptr});
  auto r = record_of(c, "job2", 1);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->to.world(), 3);
  // The workers apply it.
  c.store().set(progress_key("job2"), Progress{1, 5, 0}.to_json().dump());
  c.tick({spawn, nullptr});  // unchanged file: no second request
  EXPECT_FALSE(record_of(c, "job2", 2));
  std::string thirteen;
  for (int i = 0; i < 13; ++i) thirteen += "localhost\n";
  write_hosts(thirteen);  // no layout for 13 workers: refused, nothing published
  c.tick({spawn, nullptr});
  EXPECT_FALSE(record_of(c, "job2", 2));
  unsetenv("TESSEL_CTL_DIR");
}

// A running job scaled 2 -> 3 -> 1 workers by `tessel ctl`: every step equals one single-process
// step (step_check_test_util.h), and each scale is one event line, prepared before it was made.
TEST(Coordinator, CtlScaleChangesTheWorkersOfARunningJob) {
  TempDir dir;
  auto corpus = config::testing::make_corpus(dir);
  const auto single_cfg = config::testing::write_config(dir, corpus, kTraining, "single.yaml");
  auto cfg = config::testing::write_config(
      dir, corpus,
      kTraining + "parallel: {dp: 2}\n" + runtime::testing::every_step_checkpoints(kSteps));
  const auto bin = tessel::testing::tessel_binary().string();
  // Bounded by `timeout`: a hang fails the test instead of blocking it.
  std::ofstream(dir / "scale.sh") << fmt::format(
      "set -e\ncd {dir}\nexport TESSEL_CTL_DIR={dir}/ctl OMP_NUM_THREADS=1\n"
      "{bin} train {cfg} > train.out 2>&1 &\n"
      "L=$!\n"
      "lines() {{ [ -f metrics.jsonl ] && wc -l < metrics.jsonl || echo 0; }}\n"
      "for i in $(seq 600); do [ $(lines) -ge 5 ] && break; sleep 0.02; done\n"
      "{bin} ctl scale 3\n"
      "for i in $(seq 600); do grep -q '\"workers\":3' metrics.jsonl && break; sleep 0.02; done\n"
      "{bin} ctl scale 13 || echo refused-as-expected\n"
      "{bin} ctl scale 1\n"
      "wait $L\n",
      fmt::arg("dir", dir.path().string()), fmt::arg("bin", bin), fmt::arg("cfg", cfg));
  std::string out;
  int rc = tessel::testing::run_command(
      fmt::format("timeout 120 bash {}", (dir / "scale.sh").string()), &out);
  std::ifstream train_out(dir / "train.out");
  std::string log((std::istreambuf_iterator<char>(train_out)), {});
  ASSERT_EQ(rc, 0) << out << log;
  EXPECT_NE(out.find("refused-as-expected"), std::string::npos) << out;

  std::vector<nlohmann::json> records;
  std::ifstream m(dir / "metrics.jsonl");
  for (std::string line; std::getline(m, line);)
    if (!line.empty()) records.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(int64_t(records.size()), kSteps) << log;
  std::set<int> worker_counts;
  for (const auto& r : records) worker_counts.insert(r.at("workers").get<int>());
  EXPECT_EQ(worker_counts, (std::set<int>{1, 2, 3})) << log;
  runtime::testing::expect_steps_match_one_process(
      single_cfg, dir / "steps", runtime::testing::read_step_losses(dir / "metrics.jsonl"), 1,
      kSteps);
  std::vector<nlohmann::json> events;
  std::ifstream ev(dir / "events.jsonl");
  for (std::string line; std::getline(ev, line);)
    if (!line.empty()) events.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(events.size(), 2u) << log;
  EXPECT_EQ(events[0].at("cause"), "scale request");
  EXPECT_EQ(events[0].at("new_workers").get<int>(), 3);
  EXPECT_EQ(events[1].at("new_workers").get<int>(), 1);
  // Each was prepared over elastic.prepare_steps (2) steps before it was made.
  for (const auto& e : events)
    EXPECT_EQ(e.value("announced_at_step", int64_t(-1)), e.at("step").get<int64_t>() - 2)
        << e.dump();
}

// The control plane on etcd (Debian's etcd-server, started here) instead of the embedded store:
// a timeline run that grows and shrinks equals one single-process run step for step, and the job
// leaves no key behind.
TEST(Coordinator, AJobRunsOnEtcd) {
  const auto etcd = comm::testing::find_etcd();
  if (!etcd) GTEST_SKIP() << comm::testing::kNoEtcd;
  comm::testing::EtcdServer server(*etcd);
  TempDir dir;
  auto corpus = config::testing::make_corpus(dir);
  constexpr int64_t kShort = 8;
  const std::string training =
      "training: {steps: 8, global_batch: 12, micro_batch: 2, threads: 1}\n"
      "optimizer: {lr: 0.003, warmup_steps: 1}\n"
      "output: {metrics: metrics.jsonl, events: events.jsonl}\n";
  const auto single_cfg = config::testing::write_config(dir, corpus, training, "single.yaml");
  auto cfg = config::testing::write_config(
      dir, corpus,
      training + "parallel: {dp: 2}\n" +
          fmt::format("elastic: {{control_store: {}}}\n", server.endpoint()) +
          "timeline: [{at_step: 3, workers: 3}, {at_step: 5, workers: 1}]\n" +
          runtime::testing::every_step_checkpoints(kShort));
  std::string out;
  int rc = tessel::testing::run_command(
      fmt::format("cd {} && OMP_NUM_THREADS=1 timeout 120 {} train {}", dir.path().string(),
                  tessel::testing::tessel_binary().string(), cfg),
      &out);
  ASSERT_EQ(rc, 0) << out;
  runtime::testing::expect_steps_match_one_process(
      single_cfg, dir / "steps", runtime::testing::read_step_losses(dir / "metrics.jsonl"), 1,
      kShort);
  std::ifstream ev(dir / "events.jsonl");
  int events = 0;
  for (std::string line; std::getline(ev, line);) events += !line.empty();
  EXPECT_EQ(events, 2) << out;
  comm::EtcdStore store(server.endpoint());
  EXPECT_TRUE(store.list("/tessel/").empty());
}

// A control store that does not answer: one clear error naming it and the fix, before any
// worker starts.
TEST(Coordinator, AnUnreachableEtcdIsOneClearError) {
  TempDir dir;
  auto cfg = config::testing::write_config(
      dir, (dir / "none.tok").string(),
      kTraining + "parallel: {dp: 2}\nelastic: {control_store: 'http://127.0.0.1:9'}\n");
  std::string out;
  int rc = tessel::testing::run_command(
      fmt::format("TESSEL_CTL_DIR={}/ctl timeout 60 {} train {} 2>&1", dir.path().string(),
                  tessel::testing::tessel_binary().string(), cfg),
      &out);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("no etcd answers at http://127.0.0.1:9"), std::string::npos) << out;
  EXPECT_EQ(out.find("[rank"), std::string::npos) << out;  // no worker was started
}

}  // namespace
}  // namespace tessel::elastic
