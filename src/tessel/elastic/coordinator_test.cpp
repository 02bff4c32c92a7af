// The coordinator: control commands, and live scaling of a running job by `tessel ctl scale N`
// with the losses of one uninterrupted single-process run.
#include "tessel/elastic/coordinator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/elastic/switch_marker.h"
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

TEST(Coordinator, ScaleRequestsAreCheckedByThePlannerAndWrittenForTheWorkers) {
  TempDir dir;
  setenv("TESSEL_CTL_DIR", (dir / "ctl").c_str(), 1);
  auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(), kTraining + "parallel: {dp: 2}\n"));
  Coordinator c(cfg, "job1", 2);
  EXPECT_TRUE(std::filesystem::exists(c.socket_path()));
  const std::string store = dir.path().string();
  auto ok = c.handle("scale 3", store);
  EXPECT_EQ(ok.rfind("ok: request 1: 3 workers", 0), 0u) << ok;
  auto req = nlohmann::json::parse(std::ifstream(dir / "job1.request-1.json"));
  EXPECT_EQ(req.at("workers").get<int>(), 3);
  EXPECT_EQ(layout::plan_from_json(req.at("plan")).world(), 3);
  // A count no layout fits: refused with the planner's reason, nothing written.
  auto refused = c.handle("scale 13", store);
  EXPECT_EQ(refused.rfind("refused:", 0), 0u) << refused;
  EXPECT_NE(refused.find("13 workers"), std::string::npos) << refused;
  EXPECT_FALSE(std::filesystem::exists(dir / "job1.request-2.json"));
  EXPECT_EQ(c.handle("scale 0", store).rfind("refused:", 0), 0u);
  EXPECT_EQ(c.handle("grow", store).rfind("refused: unknown command", 0), 0u);
  EXPECT_EQ(c.handle("status", store).rfind("ok: job job1", 0), 0u);
  // No job: a clear error, not a hang.
  EXPECT_THROW(send_control_command("nope", "status", 500), IoError);
  unsetenv("TESSEL_CTL_DIR");
}

// The watched hosts file: a changed count of worker slots becomes a scale request; the same
// count, blank lines and comments do not; a count the planner refuses writes nothing.
TEST(Coordinator, HostsFileChangesBecomeScaleRequests) {
  TempDir dir;
  setenv("TESSEL_CTL_DIR", (dir / "ctl").c_str(), 1);
  auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(),
      kTraining + "parallel: {dp: 2}\nelastic: {hosts_file: hosts.txt}\n"));
  EXPECT_EQ(cfg.hosts_file, (dir / "hosts.txt").string());
  Coordinator c(cfg, "job2", 2);
  process::LaunchResult job;
  job.store_dir = dir.path().string();
  job.job_id = "job2";
  auto spawn = [](int, const std::map<std::string, std::string>&) {};
  auto write_hosts = [&](const std::string& text) {
    std::ofstream(dir / "hosts.txt") << text;
    // A new modification time for each version (some filesystems count in coarse ticks).
    static int bump = 0;
    std::filesystem::last_write_time(
        dir / "hosts.txt",
        std::filesystem::file_time_type::clock::now() + std::chrono::seconds(++bump));
  };
  c.tick(spawn, job);                     // no file yet: nothing
  write_hosts("localhost\nlocalhost\n");  // 2 slots: what the job has
  c.tick(spawn, job);
  EXPECT_FALSE(std::filesystem::exists(dir / "job2.request-1.json"));
  write_hosts("# three slots\nlocalhost\n\nlocalhost\nlocalhost\n");
  c.tick(spawn, job);
  ASSERT_TRUE(std::filesystem::exists(dir / "job2.request-1.json"));
  auto req = nlohmann::json::parse(std::ifstream(dir / "job2.request-1.json"));
  EXPECT_EQ(req.at("workers").get<int>(), 3);
  c.tick(spawn, job);  // unchanged file: no second request
  EXPECT_FALSE(std::filesystem::exists(dir / "job2.request-2.json"));
  std::string thirteen;
  for (int i = 0; i < 13; ++i) thirteen += "localhost\n";
  write_hosts(thirteen);  // no layout for 13 workers: refused, nothing written
  c.tick(spawn, job);
  EXPECT_FALSE(std::filesystem::exists(dir / "job2.request-2.json"));
  unsetenv("TESSEL_CTL_DIR");
}

// A failure nobody died of (a timed-out collective): once every worker has reported, the
// coordinator decides to go on live with all of them.
TEST(Coordinator, AReportedFailureWithoutADeathIsRecoveredFrom) {
  TempDir dir;
  setenv("TESSEL_CTL_DIR", (dir / "ctl").c_str(), 1);
  auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(), kTraining + "parallel: {dp: 2}\n"));
  Coordinator c(cfg, "job3", 2);
  process::LaunchResult job;
  job.store_dir = dir.path().string();
  job.job_id = "job3";
  std::vector<int> spawned;
  auto spawn = [&](int p, const std::map<std::string, std::string>&) { spawned.push_back(p); };
  auto report = [&](int process) {
    elastic::FailureReport r;
    r.process = process;
    r.valid = true;
    r.plan = cfg.plan;
    r.rank = process;
    r.step = 9;
    r.cursor = 108;
    r.error = "all_reduce_sum on group 'dp.0' timed out";
    write_json_file(elastic::failure_report_path(job.store_dir, "job3", 1, process), r.to_json());
  };
  report(1);
  c.tick(spawn, job);  // a recovery starts; process 0 has not reported yet
  EXPECT_FALSE(std::filesystem::exists(elastic::recovery_path(job.store_dir, "job3", 1)));
  report(0);
  c.tick(spawn, job);
  const auto path = elastic::recovery_path(job.store_dir, "job3", 1);
  ASSERT_TRUE(std::filesystem::exists(path));
  const auto m = elastic::SwitchMarker::from_json(read_json_file(path), path);
  EXPECT_TRUE(m.recovery);
  EXPECT_TRUE(m.checkpoint.empty());
  EXPECT_EQ(m.step, 9);
  EXPECT_EQ(m.to.world(), 2);
  EXPECT_TRUE(spawned.empty());
  EXPECT_NE(m.cause.find("timed out"), std::string::npos) << m.cause;
  EXPECT_NE(c.handle("status", job.store_dir).find("1 failures"), std::string::npos);
  unsetenv("TESSEL_CTL_DIR");
}

// Every rank decides a switch alike and begins it without waiting for rank 0's marker, so when
// one fails, processes may already have registered under its generation's store prefix; dead ones
// cannot say so. A recovery goes one generation further (reusing it made the new world's
// rendezvous fail with "rank 2 is already registered").
TEST(Coordinator, ARecoveryGoesPastTheGenerationASwitchMayHaveBegun) {
  TempDir dir;
  setenv("TESSEL_CTL_DIR", (dir / "ctl").c_str(), 1);
  auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(), kTraining + "parallel: {dp: 2}\n"));
  Coordinator c(cfg, "job4", 2);
  process::LaunchResult job;
  job.store_dir = dir.path().string();
  job.job_id = "job4";
  auto spawn = [](int, const std::map<std::string, std::string>&) {};
  for (int process : {0, 1}) {
    elastic::FailureReport r;
    r.process = process;
    r.valid = true;
    r.generation = 0;
    r.plan = cfg.plan;
    r.rank = process;
    r.step = 4;
    r.cursor = 48;
    r.error = "connect on group 'reshard' timed out";
    write_json_file(elastic::failure_report_path(job.store_dir, "job4", 1, process), r.to_json());
  }
  c.tick(spawn, job);
  c.tick(spawn, job);
  const auto path = elastic::recovery_path(job.store_dir, "job4", 1);
  ASSERT_TRUE(std::filesystem::exists(path));
  const auto m = elastic::SwitchMarker::from_json(read_json_file(path), path);
  EXPECT_EQ(m.generation, 2);
  EXPECT_TRUE(std::filesystem::exists(elastic::switch_marker_path(job.store_dir, "job4", 2)));
  EXPECT_FALSE(std::filesystem::exists(elastic::switch_marker_path(job.store_dir, "job4", 1)));
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

}  // namespace
}  // namespace tessel::elastic
