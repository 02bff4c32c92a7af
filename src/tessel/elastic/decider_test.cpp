// The protocol without processes: the decider against a MemoryStore, with the workers' reports
// written by hand -- late, out of order, overwritten before anyone read them (the store keeps
// only the newest progress), from a world a failure replaced -- and the records it publishes
// read back as a worker would (record_feed.h).
#include "tessel/elastic/decider.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <set>

#include "tessel/comm/memory_store.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/elastic/record_feed.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic {
namespace {

using namespace std::chrono_literals;
using tessel::testing::TempDir;

const std::string kTraining =
    "training: {steps: 100, global_batch: 12, micro_batch: 2, threads: 1}\n"
    "parallel: {dp: 2}\n";

struct Job {
  TempDir dir;
  std::shared_ptr<comm::MemoryStore> store = std::make_shared<comm::MemoryStore>();
  config::TrainConfig cfg;

  explicit Job(const std::string& extra = "") {
    cfg = config::TrainConfig::load(
        config::testing::write_config(dir, (dir / "none.tok").string(), kTraining + extra));
  }
  void progress(int generation, int64_t step, int entering = 0) {
    store->set(progress_key("j"), Progress{generation, step, entering}.to_json().dump());
  }
  std::optional<Reconfiguration> record(int g) {
    auto kv = store->get(record_key("j", g));
    if (!kv) return std::nullopt;
    return Reconfiguration::from_json(nlohmann::json::parse(kv->value), kv->key);
  }
  void report(int64_t failure, int process, int generation, int64_t step, bool valid = true,
              std::string error = "all_reduce_sum on group 'dp.0' timed out",
              std::string kind = "timeout") {
    FailureReport r;
    r.process = process;
    r.valid = valid;
    r.generation = generation;
    r.plan = cfg.plan;
    r.members = {0, 1};
    r.rank = process;
    r.step = step;
    r.cursor = step * 12;
    r.error = std::move(error);
    r.kind = std::move(kind);
    store->set(report_key("j", failure, process), r.to_json().dump());
  }
};

TEST(Decider, AScaleRequestIsOneRecordThatStartsTheProcessesItAdds) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0);
  EXPECT_TRUE(d.update().empty());
  EXPECT_EQ(d.scale(3).rfind("ok: request 1: 3 workers", 0), 0u);
  const auto starts = d.update();
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].process, 2);
  EXPECT_EQ(starts[0].generation, 1);
  const auto r = job.record(1);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->from_members, (std::vector<int>{0, 1}));
  EXPECT_EQ(r->to_members, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(r->to.world(), 3);
  EXPECT_EQ(r->at_step, -1);
  EXPECT_EQ(r->request, 1);
  EXPECT_FALSE(r->recovery);
  EXPECT_EQ(job.store->get(generation_key("j"))->value, "1");
  // Refusals publish nothing.
  EXPECT_EQ(d.scale(13).rfind("refused:", 0), 0u);
  EXPECT_EQ(d.scale(0).rfind("refused:", 0), 0u);
}

TEST(Decider, RequestsWaitForThePendingRecordAndTheNewestWins) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0);
  d.scale(3);
  d.update();
  d.scale(6);
  d.scale(1);
  job.progress(0, 7);  // the old world still runs: record 1 is pending
  EXPECT_TRUE(d.update().empty());
  EXPECT_FALSE(job.record(2));
  // The report of generation 1 at step 8 arrives (the one entering it was overwritten unread).
  job.progress(1, 8);
  EXPECT_TRUE(d.update().empty());  // 3 -> 1 starts nobody
  const auto r = job.record(2);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->request, 3);
  EXPECT_EQ(r->from_members, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(r->to_members, (std::vector<int>{0}));
  EXPECT_FALSE(job.record(3));
}

TEST(Decider, ATimelineEntryIsPublishedAheadOfItsStep) {
  Job job("elastic: {prepare_steps: 2}\ntimeline: [{at_step: 10, workers: 3}]\n");
  Decider d(job.cfg, job.store, "j", 2, 0);
  job.progress(0, 6);
  EXPECT_TRUE(d.update().empty());
  job.progress(0, 7);
  const auto starts = d.update();
  ASSERT_EQ(starts.size(), 1u);
  const auto r = job.record(1);
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->timeline);
  EXPECT_EQ(r->at_step, 10);
  EXPECT_EQ(r->to.world(), 3);
  EXPECT_EQ(r->cause, "timeline (workers)");
}

TEST(Decider, AResumedJobSkipsTheTimelineBehindIt) {
  Job job("timeline: [{at_step: 10, workers: 3}, {at_step: 30, workers: 1}]\n");
  Decider d(job.cfg, job.store, "j", 3, 20);
  job.progress(0, 26);
  EXPECT_TRUE(d.update().empty());
  job.progress(0, 27);
  d.update();
  const auto r = job.record(1);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->at_step, 30);
  EXPECT_EQ(r->from.world(), 3);
  EXPECT_EQ(r->to.world(), 1);
}

// A failure nobody died of (a timed-out collective): once every worker has reported, the
// coordinator decides to go on live with all of them.
TEST(Decider, AReportedFailureWithoutADeathIsRecoveredFrom) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0);
  job.report(1, 1, 0, 9);
  EXPECT_TRUE(d.update().empty());  // a recovery starts; process 0 has not reported yet
  EXPECT_EQ(job.store->get(failure_key("j"))->value, "1");
  EXPECT_FALSE(job.record(1));
  job.report(1, 0, 0, 9);
  EXPECT_TRUE(d.update().empty());
  const auto m = job.record(1);
  ASSERT_TRUE(m);
  EXPECT_TRUE(m->recovery);
  EXPECT_TRUE(m->checkpoint.empty());
  EXPECT_EQ(m->step, 9);
  EXPECT_EQ(m->failures, 1);
  EXPECT_EQ(m->to.world(), 2);
  EXPECT_NE(m->cause.find("timed out"), std::string::npos) << m->cause;
  EXPECT_NE(d.status().find("1 failures"), std::string::npos);
}

// The peers of a process that timed out fail at once when it aborts its channels, and may report
// before it does: the recovery's cause is the timeout, whichever report came first.
TEST(Decider, TheCauseIsTheTimeoutNotThePeerLostItCausedWhateverReportsFirst) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0);
  job.report(1, 1, 0, 9, true, "shm channel to 0: recv of 64 bytes failed: the peer aborted",
             "peer lost");
  EXPECT_TRUE(d.update().empty());
  job.report(1, 0, 0, 9, true, "all_reduce_sum on group 'dp.0' timed out after 2 s", "timeout");
  EXPECT_TRUE(d.update().empty());
  const auto m = job.record(1);
  ASSERT_TRUE(m);
  EXPECT_NE(m->cause.find("timed out after 2 s"), std::string::npos) << m->cause;
  EXPECT_EQ(m->cause.find("aborted"), std::string::npos) << m->cause;
}

// A checkpoint of step 5 (only its meta matters to the decider).
std::string checkpoint_of_step_5(const Job& job) {
  const std::string ck = (job.dir / "ck" / "step-00000005").string();
  store::CheckpointWriter w(ck, 0);
  const float x = 1;
  w.add("x", DType::f32, Shape{1}, Box::of(Shape{1}), &x);
  w.write_rank_file();
  w.commit(1, {{"step", 5}, {"cursor", 60}});
  return ck;
}

// A restore that fails every time (its checkpoint unreadable wherever it is held) would make
// each recovery choose the same checkpoint again: after kMaxRepeatedRestores recoveries from one
// checkpoint that no worker got past, the decider stops the job, saying why.
TEST(Decider, ARestoreThatKeepsFailingStopsTheJobInsteadOfRetryingForEver) {
  Job job;
  const std::string ck = checkpoint_of_step_5(job);
  Decider d(job.cfg, job.store, "j", 2, 0);
  d.set_checkpoint_finder([ck] { return std::optional<std::string>(ck); });
  int generation = 0;
  for (int failure = 1; failure <= kMaxRepeatedRestores; ++failure) {
    // Both processes fail while restoring: they hold no state.
    job.report(failure, 0, generation, 0, /*valid=*/false);
    job.report(failure, 1, generation, 0, /*valid=*/false);
    d.update();
    d.update();
    const auto m = job.record(generation + 1);
    ASSERT_TRUE(m) << "failure " << failure;
    EXPECT_EQ(m->checkpoint, ck);
    EXPECT_EQ(m->step, 5);
    generation = m->generation;
  }
  job.report(kMaxRepeatedRestores + 1, 0, generation, 0, false);
  job.report(kMaxRepeatedRestores + 1, 1, generation, 0, false);
  try {
    d.update();
    d.update();
    ADD_FAILURE() << "a fourth restore from the same checkpoint was decided";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 times in a row"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(ck), std::string::npos) << e.what();
  }
}

// Kills from outside while the job restores (preemptions faster than a restore) are new
// failures, not the restore failing: the job goes on as long as they do. A worker that crashes
// while restoring (a fault of its own) counts, and stops the job as a failing restore does.
// Returns the number of restores decided before the job stopped (or `kills` if it never did).
int restores_through_deaths(int kills, bool crashed) {
  Job job("elastic: {replace_failed: true}\n");
  const std::string ck = checkpoint_of_step_5(job);
  Decider d(job.cfg, job.store, "j", 2, 0);
  d.set_checkpoint_finder([ck] { return std::optional<std::string>(ck); });
  int generation = 0, victim = 1;
  for (int failure = 1; failure <= kills; ++failure) {
    try {
      EXPECT_TRUE(d.on_exit(
          victim, false, true,
          crashed ? "was killed by signal 11 (SIGSEGV)" : "was killed by signal 9 (SIGKILL)",
          crashed));
      job.report(failure, 0, generation, 0, /*valid=*/false);  // restoring: no state yet
      const auto starts = d.update();
      const auto m = job.record(generation + 1);
      if (!m) return failure - 1;
      EXPECT_EQ(m->checkpoint, ck);
      EXPECT_EQ(starts.size(), 1u);  // the replacement
      if (starts.empty()) return failure - 1;
      victim = starts[0].process;
      generation = m->generation;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("times in a row"), std::string::npos) << e.what();
      return failure - 1;
    }
  }
  return kills;
}

TEST(Decider, KillsDuringRestoresAreNewFailuresButCrashesAreAFailingRestore) {
  EXPECT_EQ(restores_through_deaths(3 * kMaxRepeatedRestores, false), 3 * kMaxRepeatedRestores);
  EXPECT_EQ(restores_through_deaths(3 * kMaxRepeatedRestores, true), kMaxRepeatedRestores);
}

// A rollback to the same checkpoint after the workers got past it is a new failure, not the
// restore failing: it does not count towards the limit.
TEST(Decider, RollingBackToOneCheckpointAfterProgressIsNoRepeatedRestore) {
  Job job;
  // ZeRO-1: each dp rank alone holds its share of Adam's state, so losing one loses state.
  job.cfg.plan.zero_stage = 1;
  const std::string ck = checkpoint_of_step_5(job);
  Decider d(job.cfg, job.store, "j", 2, 0);
  d.set_checkpoint_finder([ck] { return std::optional<std::string>(ck); });
  int generation = 0;
  for (int failure = 1; failure <= kMaxRepeatedRestores + 2; ++failure) {
    // Process 0 died mid-update (invalid) after both got to step 7: state lost, roll back.
    job.report(failure, 0, generation, 7, /*valid=*/false);
    job.report(failure, 1, generation, 7, /*valid=*/true);
    d.update();
    d.update();
    const auto m = job.record(generation + 1);
    ASSERT_TRUE(m) << "failure " << failure;
    EXPECT_EQ(m->checkpoint, ck) << "failure " << failure;
    generation = m->generation;
  }
}

// A record some processes may have begun (registered under its rendezvous prefix, dead ones
// too) is never reused: a recovery goes one generation past every published record. And the
// scale request the failure voided is made again once the recovery is applied.
TEST(Decider, ARecoveryGoesPastAPendingRecordAndRedoesItsRequest) {
  Job job("elastic: {replace_failed: true}\n");
  Decider d(job.cfg, job.store, "j", 2, 0);
  d.scale(3);
  ASSERT_EQ(d.update().size(), 1u);  // process 2 starts for generation 1
  EXPECT_TRUE(d.on_exit(1, false, true, "was killed by signal 9 (SIGKILL)"));
  job.report(1, 0, 0, 4);
  const auto starts = d.update();  // process 2 prepared only: it is not waited for
  const auto m = job.record(2);
  ASSERT_TRUE(m);
  EXPECT_TRUE(m->recovery);
  EXPECT_EQ(m->generation, 2);
  EXPECT_EQ(m->to.world(), 2);  // the survivor and its replacement
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].process, 3);
  EXPECT_EQ(starts[0].generation, 2);
  // A late report of the world the failure replaced says nothing.
  job.progress(0, 5);
  EXPECT_TRUE(d.update().empty());
  EXPECT_FALSE(job.record(3));
  job.progress(2, 4);
  d.update();
  const auto again = job.record(3);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->request, 1);
  EXPECT_EQ(again->to.world(), 3);
  EXPECT_EQ(again->from_members, m->to_members);
}

TEST(Decider, OneDeciderPerJob) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0);
  EXPECT_THROW(Decider(job.cfg, job.store, "j", 2, 0), ConfigError);
  Decider other(job.cfg, job.store, "k", 2, 0);  // another job: its own keys
  // A hand edit of the generation: the next decision is refused, not interleaved.
  job.store->set(generation_key("j"), "7");
  d.scale(3);
  EXPECT_THROW(d.update(), ConfigError);
  EXPECT_FALSE(job.record(1));
}

// The worker's side: what it follows, and what it refuses to apply.
TEST(RecordFeed, FollowsRecordsAndIgnoresWhatNoCoordinatorWrote) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0);
  RecordFeed feed(job.store, "j");
  d.scale(3);
  d.update();
  const auto deadline = RecordFeed::Clock::now() + 5s;
  ASSERT_TRUE(feed.wait_until([](const auto& v) { return v.record(1) != nullptr; }, deadline));
  // A malformed record and one whose number is not its key's are dropped with a warning.
  job.store->set(record_key("j", 2), "{not json");
  job.store->set(record_key("j", 3), job.record(1)->to_json().dump());
  job.progress(1, 3);
  ASSERT_TRUE(feed.wait_until([](const auto& v) { return v.progress.generation == 1; }, deadline));
  const auto v = feed.view();
  EXPECT_EQ(v.records.size(), 1u);
  EXPECT_EQ(v.record(1)->to.world(), 3);
  // A record erased by hand stays known to those who saw it.
  job.store->erase(record_key("j", 1));
  job.progress(1, 4);
  ASSERT_TRUE(feed.wait_until([](const auto& v) { return v.progress.step == 4; }, deadline));
  EXPECT_NE(feed.view().record(1), nullptr);
}

// The processes a switch starts report their buffers built; a scale-up's members wait for that.
TEST(RecordFeed, KnowsWhichStartedProcessesHaveBuiltTheirBuffers) {
  Job job;
  RecordFeed feed(job.store, "j");
  EXPECT_TRUE(feed.prepared(3, {}));
  EXPECT_FALSE(feed.prepared(3, {4}));
  job.store->set(prepared_key("j", 3, 4), "built");
  job.store->set("/tessel/j/reports/prepared/x/5", "built");  // a hand edit: ignored
  job.store->set(prepared_key("j", 2, 5), "built");           // another generation's
  job.progress(0, 1);
  const auto deadline = RecordFeed::Clock::now() + 5s;
  ASSERT_TRUE(feed.wait_until([](const auto& v) { return v.progress.step == 1; }, deadline));
  EXPECT_TRUE(feed.prepared(3, {4}));
  EXPECT_FALSE(feed.prepared(3, {4, 5}));
  job.store->set(prepared_key("j", 3, 5), "built");
  job.progress(0, 2);
  ASSERT_TRUE(feed.wait_until([](const auto& v) { return v.progress.step == 2; }, deadline));
  EXPECT_TRUE(feed.prepared(3, {4, 5}));
  EXPECT_EQ(feed.view().prepared.at(2), (std::set<int>{5}));
}

// A feed that fell behind the store's history (events lost to it) reads the keys again.
TEST(RecordFeed, CatchesUpAfterTheHistoryIsCompacted) {
  Job job;
  auto small = std::make_shared<comm::MemoryStore>(2);
  Decider d(job.cfg, small, "j", 2, 0);
  RecordFeed feed(small, "j");
  for (int i = 0; i < 20; ++i) small->set(progress_key("j"), Progress{0, i, 0}.to_json().dump());
  d.scale(3);
  d.update();
  ASSERT_TRUE(feed.wait_until([](const auto& v) { return v.record(1) != nullptr; },
                              RecordFeed::Clock::now() + 5s));
  EXPECT_EQ(feed.view().progress.step, 19);
}

}  // namespace
}  // namespace tessel::elastic
