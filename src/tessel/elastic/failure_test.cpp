// Workers killed while a job trains: the job goes on, and what it computes is what an
// uninterrupted single-process run computes: every step, as the job finally recorded it, equals
// one single-process step from the state the job saved before it (losses, parameters and Adam
// moments, within the float32 bounds of step_check_test_util.h), and it consumed the data in
// exactly the uninterrupted order.
#include <gtest/gtest.h>

#include "tessel/elastic/failure_test_util.h"

namespace tessel::elastic {
namespace {

using namespace tessel::elastic::testing;
using tessel::testing::TempDir;

// 20 random workers of a dp job killed at random moments, each replaced by a new process: the
// job always goes on from the survivors' replicas (no step is lost but the one in flight), and
// its per-step losses, data order and final state are those of the uninterrupted run.
TEST(Failures, TwentyRandomKillsOfReplicatedWorkers) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{150};
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job.config() + "parallel: {dp: 4, timeout_s: 20}\nelastic: {replace_failed: true}\n");
  std::string out;
  const int rc = train_and_kill(dir, cfg, 20, &out);
  const std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("killed 20"), std::string::npos) << out << log;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;

  const auto events = read_lines(dir / "events.jsonl");
  int recoveries = 0;
  for (const auto& e : events) {
    if (e.at("event") != "recover") continue;
    ++recoveries;
    EXPECT_LE(e.at("steps_lost").get<int64_t>(), 0) << e.dump();
    EXPECT_EQ(e.at("restored_from"), "survivors") << e.dump();
    EXPECT_EQ(e.at("new_workers").get<int>(), 4) << e.dump();
  }
  // A kill can land after the last step, once the others have finished: nothing to recover.
  size_t after_the_end = 0;
  for (size_t at = 0; (at = log.find("nothing to recover", at)) != std::string::npos; ++at)
    ++after_the_end;
  EXPECT_LE(after_the_end, 1u) << log;
  EXPECT_EQ(size_t(recoveries) + after_the_end, 20u) << log;

  expect_like_one_process(dir, corpus, job, 20);  // at most one unlogged step per kill
}

// Kills that do not wait for the job: during timeline switches, during recoveries, of processes
// just started. The job still reaches its last step with the losses, data order and final state
// of the uninterrupted run (replicas or, when a failure leaves none, the checkpoint).
TEST(Failures, KillsDuringSwitchesAndRecoveries) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{120};
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job.config() +
          "parallel: {dp: 4, timeout_s: 10}\nelastic: {replace_failed: true}\n"
          "timeline:\n"
          "  - {at_step: 15, workers: 2}\n  - {at_step: 30, workers: 3}\n"
          "  - {at_step: 45, workers: 4}\n  - {at_step: 60, workers: 2}\n"
          "  - {at_step: 75, workers: 4}\n");
  // Kills every 0.1-0.4 s once step 7 is done, without waiting for recoveries.
  std::string out;
  const int rc =
      train_with_killer(dir, cfg,
                        "RANDOM=11\n"
                        "for i in $(seq 2000); do [ $(lines) -ge 7 ] && break; "
                        "sleep 0.01; done\n"
                        "for k in $(seq 10); do\n"
                        "  sleep 0.$((RANDOM % 4 + 1))\n"
                        "  pids=($(pgrep -P $L))\n"
                        "  [ ${#pids[@]} -gt 0 ] || break\n"
                        "  kill -9 ${pids[$((RANDOM % ${#pids[@]}))]} && echo killed $k\n"
                        "done\n",
                        &out);
  const std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  expect_like_one_process(dir, corpus, job, 10);
}

// A worker killed while a scale-up is being prepared (its new processes started and building
// their buffers): the recovery does not wait for those processes, they leave, and the scale-up
// is prepared again from the survivors' new world and happens at its step.
TEST(Failures, AFailureDuringAPreparedSwitch) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{80};
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job.config() +
          "parallel: {dp: 2, timeout_s: 20}\nelastic: {prepare_steps: 50}\n"
          "timeline:\n  - {at_step: 60, workers: 4}\n");
  // Once the two processes of the scale-up exist (announced at step 10), kill process 1.
  std::string out;
  const int rc = train_with_killer(
      dir, cfg,
      "for i in $(seq 3000); do [ $(pgrep -P $L | wc -l) -ge 4 ] && break; sleep 0.01; done\n"
      "for p in $(pgrep -P $L); do\n"
      "  tr '\\0' '\\n' < /proc/$p/environ | grep -qx TESSEL_RANK=1 && kill -9 $p && "
      "echo killed 1\n"
      "done\n",
      &out);
  const std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("killed 1"), std::string::npos) << out << log;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  EXPECT_NE(log.find("overtook the switch"), std::string::npos) << log;

  const auto events = read_lines(dir / "events.jsonl");
  ASSERT_EQ(events.size(), 2u) << log;
  const auto& recover = events[0];
  EXPECT_EQ(recover.at("event"), "recover") << recover.dump();
  EXPECT_LT(recover.at("step").get<int64_t>(), 60) << recover.dump();
  EXPECT_EQ(recover.at("restored_from"), "survivors") << recover.dump();
  EXPECT_EQ(recover.at("new_workers").get<int>(), 1) << recover.dump();
  const auto& grow = events[1];
  EXPECT_EQ(grow.at("event"), "reconfigure") << grow.dump();
  EXPECT_EQ(grow.at("step").get<int64_t>(), 60) << grow.dump();
  EXPECT_EQ(grow.at("new_workers").get<int>(), 4) << grow.dump();
  // Prepared again by the survivor, right after the recovery.
  EXPECT_EQ(grow.value("announced_at_step", int64_t(-1)), recover.at("step").get<int64_t>())
      << grow.dump();
  expect_like_one_process(dir, corpus, job, 1);
}

// ZeRO-1 keeps each optimizer shard on one worker only: killing one loses state, so the job
// rolls back to its last checkpoint (each survivor reading only its share) and still ends where
// the uninterrupted run ends.
TEST(Failures, LostOptimizerShardsAreRestoredFromTheCheckpoint) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const Job job{60};
  const auto cfg = config::testing::write_config(
      dir, corpus, job.config() + "parallel: {dp: 3, zero_stage: 1, timeout_s: 20}\n");
  std::string out;
  // After the first checkpoints: before them a lost shard ends the job (next test).
  const int rc = train_and_kill(dir, cfg, 2, &out, 7);
  const std::string log = read_text(dir / "train.out");
  ASSERT_EQ(rc, 0) << out << log;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  const auto events = read_lines(dir / "events.jsonl");
  int from_checkpoint = 0;
  for (const auto& e : events) {
    if (e.at("event") != "recover") continue;
    if (e.at("restored_from").get<std::string>().find("step-") != std::string::npos) {
      ++from_checkpoint;
      EXPECT_TRUE(e.contains("lost")) << e.dump();
    }
  }
  EXPECT_GE(from_checkpoint, 1) << log;
  expect_like_one_process(dir, corpus, job, 2);
}

// Without a checkpoint, losing the only copy of some state ends the job with one message that
// names what was lost and the fix.
TEST(Failures, LostStateWithoutACheckpointIsAClearError) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg =
      config::testing::write_config(dir, corpus,
                                    Job{150}.training() +
                                        "parallel: {dp: 2, zero_stage: 1, timeout_s: 20}\n"
                                        "output: {metrics: metrics.jsonl, events: events.jsonl}\n");
  std::string out;
  train_and_kill(dir, cfg, 1, &out);
  const std::string log = read_text(dir / "train.out");
  EXPECT_NE(out.find("train exit 1"), std::string::npos) << out << log;
  EXPECT_NE(log.find("no surviving copy"), std::string::npos) << log;
  EXPECT_NE(log.find("checkpoint.every"), std::string::npos) << log;
}

}  // namespace
}  // namespace tessel::elastic
