// The coordinator's recovery decision from failure reports (no processes here; the kill tests
// in failure_test.cpp run the whole path).
#include "tessel/elastic/recovery.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic {
namespace {

using elastic::FailureReport;
using tessel::testing::TempDir;

config::TrainConfig config(const TempDir& dir, const std::string& parallel) {
  return config::TrainConfig::load(config::testing::write_config(
      dir, (dir / "none.tok").string(),
      "training: {steps: 20, global_batch: 12, micro_batch: 2}\n" + parallel));
}

FailureReport report(const config::TrainConfig& cfg, const layout::Plan& plan, int process,
                     int rank, int64_t step, bool valid = true, int generation = 0) {
  FailureReport r;
  r.process = process;
  r.valid = valid;
  r.generation = generation;
  r.plan = plan.with_defaults(cfg.model);
  r.rank = rank;
  r.step = step;
  r.cursor = step * 12;
  return r;
}

TEST(Recovery, ReplicasCarryTheStateLive) {
  TempDir dir;
  const auto cfg = config(dir, "parallel: {dp: 4}\n");
  RecoveryInput in;
  // dp 4, process 1 died; process 3 committed step 7, the others are still at 6.
  in.reports = {report(cfg, cfg.plan, 0, 0, 6), report(cfg, cfg.plan, 2, 2, 6),
                report(cfg, cfg.plan, 3, 3, 7)};
  in.dead = {1};
  in.cause = "worker 1 was killed";
  in.failures = 1;
  in.generation = 1;
  in.next_process_id = 4;
  // Recovering from replicas never looks for a checkpoint: verifying one reads all of it, and
  // the decider's search sets damaged ones aside while the survivors may be publishing.
  int looked = 0;
  in.find_checkpoint = [&] {
    ++looked;
    return std::optional<std::string>();
  };
  auto m = decide_recovery(cfg, in);
  EXPECT_EQ(looked, 0);
  EXPECT_TRUE(m.recovery);
  EXPECT_TRUE(m.checkpoint.empty());
  // Step 7 is held whole by process 3 alone (a full replica): the newest state wins.
  EXPECT_EQ(m.step, 7);
  EXPECT_EQ(m.cursor, 84);
  EXPECT_EQ(m.from_members, (std::vector<int>{-1, -1, -1, 3}));
  EXPECT_EQ(m.record.at("steps_lost").get<int64_t>(), 0);
  EXPECT_EQ(m.to.world(), 3);
  ASSERT_EQ(m.to_members.size(), 3u);
  EXPECT_EQ(m.to_members.front(), 3);  // the source first
  EXPECT_TRUE(m.spawn.empty());

  // With replace_failed a new process takes the dead one's place.
  in.replace_failed = true;
  m = decide_recovery(cfg, in);
  EXPECT_EQ(m.to.world(), 4);
  EXPECT_EQ(m.spawn, (std::vector<int>{4}));
  EXPECT_EQ(m.next_process_id, 5);
}

TEST(Recovery, AHalfAppliedUpdateIsNotASource) {
  TempDir dir;
  const auto cfg = config(dir, "parallel: {dp: 2}\n");
  RecoveryInput in;
  in.reports = {report(cfg, cfg.plan, 0, 0, 5, /*valid=*/false)};
  in.dead = {1};
  in.cause = "worker 1 was killed";
  // No consistent copy and no checkpoint: an error naming the fix.
  const auto e = tessel::testing::error_of<Error>([&] { decide_recovery(cfg, in); });
  EXPECT_NE(e.find("checkpoint.every"), std::string::npos) << e;
  EXPECT_NE(e.find("worker 1 was killed"), std::string::npos) << e;
}

TEST(Recovery, NoSurvivorsNeedReplacementsOrARestart) {
  TempDir dir;
  const auto cfg = config(dir, "parallel: {dp: 2}\n");
  RecoveryInput in;
  in.dead = {0, 1};
  in.cause = "worker 0 was killed";
  const auto e = tessel::testing::error_of<Error>([&] { decide_recovery(cfg, in); });
  EXPECT_NE(e.find("no worker survived"), std::string::npos) << e;
  EXPECT_NE(e.find("elastic.replace_failed"), std::string::npos) << e;
}

TEST(Recovery, LostOptimizerShardsRollBackToTheCheckpoint) {
  TempDir dir;
  auto cfg = config(dir, "parallel: {dp: 2, zero_stage: 1}\ncheckpoint: {dir: ck, every: 2}\n");
  // A real checkpoint at step 4 from the single-process trainer (any plan's checkpoint will do).
  {
    auto single = config::TrainConfig::load(config::testing::write_config(
        dir, config::testing::make_corpus(dir),
        "training: {steps: 4, global_batch: 12, micro_batch: 2}\ncheckpoint: {dir: ck}\n",
        "single.yaml"));
    single.metrics_path.clear();
    runtime::ReferenceTrainer(single).run();
  }
  const auto ck = checkpoint::latest_sharded_checkpoint((dir / "ck").string());
  ASSERT_TRUE(ck.has_value());
  RecoveryInput in;
  in.reports = {report(cfg, cfg.plan, 0, 0, 6)};
  in.dead = {1};
  in.cause = "worker 1 was killed";
  int looked = 0;
  in.find_checkpoint = [&] {  // only when the survivors lack some state
    ++looked;
    return ck;
  };
  auto m = decide_recovery(cfg, in);
  EXPECT_EQ(looked, 1);
  EXPECT_EQ(m.checkpoint, *ck);
  EXPECT_EQ(m.from, cfg.plan.with_defaults(cfg.model));  // the plan that failed, for the event
  EXPECT_EQ(m.step, 4);
  EXPECT_EQ(m.record.at("steps_lost").get<int64_t>(), 2);
  // What was lost is named: dp rank 1's optimizer shard.
  const auto lost = m.record.at("lost").get<std::string>();
  EXPECT_NE(lost.find("adam"), std::string::npos) << lost;
  EXPECT_EQ(m.to_members, (std::vector<int>{0}));
}

TEST(Recovery, AFailedSwitchLeavesTheOldGenerationAsTheSource) {
  TempDir dir;
  const auto cfg = config(dir, "parallel: {dp: 2}\n");
  const auto pp2 =
      config::TrainConfig::load(
          config::testing::write_config(dir, (dir / "none.tok").string(),
                                        "training: {steps: 20, global_batch: 12, micro_batch: 2}\n"
                                        "parallel: {pp: 2}\n",
                                        "pp.yaml"))
          .plan;
  RecoveryInput in;
  // Generation 1 (pp 2) was entered by process 0 only; process 1 still holds generation 0's dp
  // rank 1; process 2 (pp rank 1 of generation 1) died. Generation 1 lacks its second stage;
  // generation 0's rank 1 is a full replica.
  in.reports = {report(cfg, pp2, 0, 0, 3, true, 1), report(cfg, cfg.plan, 1, 1, 3, true, 0)};
  in.dead = {2};
  in.cause = "worker 2 was killed";
  in.generation = 2;
  in.next_process_id = 3;
  auto m = decide_recovery(cfg, in);
  EXPECT_TRUE(m.checkpoint.empty());
  EXPECT_EQ(m.from, cfg.plan.with_defaults(cfg.model));
  EXPECT_EQ(m.from_members, (std::vector<int>{-1, 1}));
  EXPECT_EQ(m.to_members.front(), 1);
  EXPECT_EQ(m.to.world(), 2);
}

}  // namespace
}  // namespace tessel::elastic
