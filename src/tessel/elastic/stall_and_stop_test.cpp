// Workers that stop answering and stop requests, while a job trains:
//  * a worker stopped (SIGSTOP: a frozen VM) is fenced -- killed -- once its heartbeat expires,
//    or, with a heartbeat too slow to notice, once it has not reported the failure its peers met
//    within the communication timeout; the job goes on from the survivors' replicas;
//  * SIGTERM to one worker is a planned leave: a live switch without it, nothing lost;
//  * SIGTERM to `tessel train` (a preemption notice) makes the workers save at their next step
//    boundary and exit (exit code 143); the same command resumes there and ends where an
//    uninterrupted run ends.
#include <gtest/gtest.h>

#include "tessel/elastic/failure_test_util.h"

namespace tessel::elastic {
namespace {

using namespace tessel::elastic::testing;
using tessel::testing::TempDir;

// Stops (SIGSTOP) one random worker once 20 steps are logged; the stopped process is never
// continued: only its fencing ends it.
const char* kStopOneWorker =
    "RANDOM=5\n"
    "for i in $(seq 3000); do [ $(lines) -ge 20 ] && break; sleep 0.01; done\n"
    "pids=($(pgrep -P $L))\n"
    "kill -STOP ${pids[$((RANDOM % ${#pids[@]}))]} && echo stopped\n";

// The job's recoveries: each from the survivors' state, none losing a step.
void expect_one_recovery_from_survivors(const TempDir& dir, const std::string& cause) {
  int recoveries = 0;
  for (const auto& e : read_lines(dir / "events.jsonl")) {
    if (e.at("event") != "recover") continue;
    ++recoveries;
    EXPECT_NE(e.at("cause").get<std::string>().find(cause), std::string::npos) << e.dump();
    EXPECT_EQ(e.at("restored_from"), "survivors") << e.dump();
    EXPECT_LE(e.at("steps_lost").get<int64_t>(), 0) << e.dump();
  }
  EXPECT_EQ(recoveries, 1);
}

// Before fencing, the coordinator waited for the stopped worker's report until its deadline and
// then ended the job (exit 1); the survivors waited for the 20 s communication timeout first.
TEST(Stalls, AStoppedWorkerIsFencedWhenItsHeartbeatExpires) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{80};
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job.config() + "parallel: {dp: 3, timeout_s: 20}\nelastic: {heartbeat_timeout_s: 3}\n");
  std::string out;
  const int rc = train_with_killer(dir, cfg, kStopOneWorker, &out);
  const std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("stopped"), std::string::npos) << out << log;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  expect_one_recovery_from_survivors(dir, "heartbeat expired");
  expect_like_one_process(dir, corpus, job, 1);
}

// A heartbeat far longer than the communication timeout: the peers time out (2 s) and report;
// the stopped worker, which cannot, is fenced 5 s after that, as one stuck where no timeout
// reaches it would be.
TEST(Stalls, AWorkerThatDoesNotReportItsPeersFailureIsFenced) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{60};
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job.config() + "parallel: {dp: 3, timeout_s: 2}\nelastic: {heartbeat_timeout_s: 600}\n");
  std::string out;
  const int rc = train_with_killer(dir, cfg, kStopOneWorker, &out);
  const std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  EXPECT_NE(log.find("did not report the failure its peers met"), std::string::npos) << log;
  expect_one_recovery_from_survivors(dir, "timed out");
  expect_like_one_process(dir, corpus, job, 1);
}

// SIGTERM to one of three workers: it asks to leave, the other two switch to a plan of their own
// at the next boundary with its state, and it exits 0. Nothing is recovered, nothing lost.
TEST(Preemption, SigtermToOneWorkerIsAPlannedLeave) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{60};
  const auto cfg = config::testing::write_config(dir, corpus, job.config() + "parallel: {dp: 3}\n");
  std::string out;
  const int rc =
      train_with_killer(dir, cfg,
                        "for i in $(seq 3000); do [ $(lines) -ge 20 ] && break; sleep 0.01; done\n"
                        "pids=($(pgrep -P $L))\n"
                        "kill -TERM ${pids[1]} && echo terminated\n",
                        &out);
  const std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  const auto events = read_lines(dir / "events.jsonl");
  ASSERT_EQ(events.size(), 1u) << log;
  EXPECT_EQ(events[0].at("event"), "reconfigure") << events[0].dump();
  EXPECT_NE(events[0].at("cause").get<std::string>().find("planned leave"), std::string::npos)
      << events[0].dump();
  EXPECT_EQ(events[0].at("new_workers").get<int>(), 2) << events[0].dump();
  EXPECT_EQ(events[0].at("steps_lost").get<int64_t>(), 0) << events[0].dump();
  expect_like_one_process(dir, corpus, job, 0);
}

// SIGTERM to `tessel train` once 15 steps are logged, at world sizes 1 and 3: the workers save
// at their next boundary -- a step no checkpoint.every would have saved -- and the job exits 143
// saying how to resume; the same command then resumes there. Every step's loss, across both
// runs, is the one an uninterrupted run logs: the state at the stop is saved bit for bit, and the
// resumed run computes the same steps under the same plan with the same data, so the numbers are
// equal, not merely close.
void stop_and_resume(int workers) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const std::string training =
      Job{40}.training() + fmt::format("parallel: {{dp: {}}}\n", workers) +
      "checkpoint: {dir: ck, every: 1000}\noutput: {metrics: metrics.jsonl}\n";
  const auto whole = config::testing::write_config(dir, corpus, training, "whole.yaml");
  std::string out;
  ASSERT_EQ(tessel::testing::run_command(
                fmt::format("cd {0} && TESSEL_CTL_DIR={0}/ctl OMP_NUM_THREADS=1 {1} train {2} "
                            "2>&1 && mv metrics.jsonl uninterrupted.jsonl && rm -r ck",
                            dir.path().string(), tessel::testing::tessel_binary().string(), whole),
                &out),
            0)
      << out;
  const auto uninterrupted = runtime::testing::read_step_losses(dir / "uninterrupted.jsonl");
  const int rc =
      train_with_killer(dir, whole,
                        "for i in $(seq 3000); do [ $(lines) -ge 15 ] && break; sleep 0.01; done\n"
                        "kill -TERM $L && echo terminated\n",
                        &out);
  std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("train exit 143"), std::string::npos) << out << log;
  EXPECT_NE(log.find("run the same command to resume"), std::string::npos) << log;
  const auto saved = checkpoint::latest_sharded_checkpoint((dir / "ck").string());
  ASSERT_TRUE(saved.has_value()) << log;
  const int64_t stopped_at = store::CheckpointReader(*saved).meta().at("step").get<int64_t>();
  EXPECT_GE(stopped_at, 15) << log;
  EXPECT_LT(stopped_at, 40) << log;
  EXPECT_NE(log.find(fmt::format("stopping after step {}", stopped_at)), std::string::npos) << log;

  // The same command resumes at the saved step.
  ASSERT_EQ(train_with_killer(dir, whole, "", &out), 0) << out;
  log = read_text(dir / "train.out");
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  EXPECT_NE(log.find(fmt::format("at step {}", stopped_at)), std::string::npos) << log;
  const auto logged = runtime::testing::read_step_losses(dir / "metrics.jsonl");
  ASSERT_EQ(logged.size(), uninterrupted.size());
  for (const auto& [step, loss] : uninterrupted) {
    ASSERT_TRUE(logged.contains(step)) << step;
    EXPECT_EQ(logged.at(step), loss) << "step " << step;
  }
}

TEST(Preemption, SigtermToTheJobSavesAndTheSameCommandResumesOneWorker) {
  stop_and_resume(1);
}
TEST(Preemption, SigtermToTheJobSavesAndTheSameCommandResumesThreeWorkers) {
  stop_and_resume(3);
}

}  // namespace
}  // namespace tessel::elastic
