// The decider on several hosts, without processes: where it places processes, what a host's loss
// and a new host's slots become, and a coordinator that takes over from the store what the lost
// one decided.
#include <gtest/gtest.h>

#include <memory>

#include "tessel/comm/memory_store.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/elastic/decider.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic {
namespace {

using tessel::testing::error_of;
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
  void progress(int generation, int64_t step) {
    store->set(progress_key("j"), Progress{generation, step, 0}.to_json().dump());
  }
  Reconfiguration record(int g) {
    auto kv = store->get(record_key("j", g));
    EXPECT_TRUE(kv.has_value()) << "no record " << g;
    return Reconfiguration::from_json(nlohmann::json::parse(kv->value), kv->key);
  }
  void report(int64_t failure, int process, int rank, int64_t step) {
    FailureReport r;
    r.process = process;
    r.valid = true;
    r.generation = 0;
    r.plan = cfg.plan;
    r.members = {0, 1};
    r.rank = rank;
    r.step = step;
    r.cursor = step * 12;
    r.error = "peer lost";
    store->set(report_key("j", failure, process), r.to_json().dump());
  }
};

std::vector<Host> hosts(std::initializer_list<std::pair<int, int>> id_slots) {
  std::vector<Host> out;
  for (auto [id, slots] : id_slots) out.push_back({id, slots, "h" + std::to_string(id)});
  return out;
}

TEST(DeciderHosts, TheFirstWorldFillsHostsInOrder) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0, hosts({{5, 1}, {7, 1}}));
  const auto starts = d.initial_starts();
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_EQ(starts[0].host, 5);
  EXPECT_EQ(starts[1].host, 7);
  EXPECT_EQ(d.capacity(), 2);
  // Too few slots for the first world: refused before anything is claimed.
  Job other;
  EXPECT_NE(error_of<ConfigError>([&] {
              Decider(other.cfg, other.store, "j", 3, 0, hosts({{0, 1}, {1, 1}}));
            }).find("do not fit the hosts' 2 slots"),
            std::string::npos);
}

TEST(DeciderHosts, ANewHostsSlotsAreAScaleRequestPlacedOnIt) {
  Job job;
  Decider d(job.cfg, job.store, "j", 2, 0, hosts({{0, 1}, {1, 1}}));
  d.set_hosts(hosts({{0, 1}, {1, 1}, {2, 1}}), true);
  const auto starts = d.update();
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].host, 2);
  const auto r = job.record(1);
  EXPECT_EQ(r.to.world(), 3);
  EXPECT_EQ(r.to_hosts, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(r.from_hosts, (std::vector<int>{0, 1}));
  // The same slots again ask for nothing more; without `grow` new slots are not used.
  job.progress(1, 3);
  d.set_hosts(hosts({{0, 1}, {1, 1}, {2, 1}}), true);
  EXPECT_TRUE(d.update().empty());
  d.set_hosts(hosts({{0, 1}, {1, 1}, {2, 1}, {3, 2}}), false);
  EXPECT_TRUE(d.update().empty());
}

TEST(DeciderHosts, ALostHostIsTheDeathOfEachOfItsProcessesInOneRecovery) {
  Job job("elastic: {replace_failed: true}\n");
  Decider d(job.cfg, job.store, "j", 2, 0, hosts({{0, 1}, {1, 1}, {2, 1}}));
  // Host 1 goes with process 1; process 0 survives and reports; the replacement goes to the one
  // host with a free slot.
  d.set_hosts(hosts({{0, 1}, {2, 1}}), true);
  EXPECT_TRUE(d.update().empty());  // waiting for the survivor's report
  EXPECT_EQ(job.store->get(failure_key("j"))->value, "1");
  job.report(1, 0, 0, 4);
  const auto starts = d.update();
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].host, 2);
  const auto r = job.record(1);
  EXPECT_TRUE(r.recovery);
  EXPECT_NE(r.cause.find("worker 1 on host 1 (h1) was lost with its host"), std::string::npos)
      << r.cause;
  EXPECT_EQ(r.to_hosts, (std::vector<int>{0, 2}));
  // The lost host's agent, back, reports the exit it finally saw: counted once already.
  EXPECT_TRUE(d.on_exit(1, false, true, "was killed by signal 9 (SIGKILL)"));
  EXPECT_FALSE(d.running(1));
}

TEST(DeciderHosts, ARecoveryNeverPlansMoreWorkersThanTheSlotsLeft) {
  Job job("elastic: {replace_failed: true}\n");
  Decider d(job.cfg, job.store, "j", 2, 0, hosts({{0, 1}, {1, 1}}));
  d.set_hosts(hosts({{0, 1}}), true);
  job.report(1, 0, 0, 4);
  EXPECT_TRUE(d.update().empty());  // nothing to start: the one slot left holds the survivor
  const auto r = job.record(1);
  EXPECT_EQ(r.to.world(), 1);
  EXPECT_EQ(r.to_members, (std::vector<int>{0}));
}

// A second decider built from the store and the placements decides what the first would have.
TEST(DeciderHosts, ATakeOverGoesOnFromTheDecisionsInTheStore) {
  Job job;
  Decider::History history;
  {
    Decider first(job.cfg, job.store, "j", 2, 0, hosts({{0, 1}, {1, 1}}));
    first.set_hosts(hosts({{0, 1}, {1, 1}, {2, 1}}), true);
    for (const auto& s : first.update()) history.host_of[s.process] = s.host;
    for (const auto& s : first.initial_starts()) history.host_of[s.process] = s.host;
    history.first_members = {0, 1};
  }
  // The switch to 3 workers is pending (rank 0 has not reported generation 1).
  job.progress(0, 7);
  Decider second(job.cfg, job.store, "j", history, hosts({{0, 1}, {1, 1}, {2, 1}}));
  EXPECT_EQ(second.workers(), 3);
  EXPECT_TRUE(second.running(2));
  EXPECT_EQ(second.host_of(2), 2);
  // It publishes the next generation with compare-and-set from where the first left it.
  job.progress(1, 9);
  EXPECT_TRUE(second.update().empty());
  EXPECT_EQ(second.scale(2).rfind("ok:", 0), 0u);
  second.update();
  EXPECT_EQ(job.record(2).to.world(), 2);
  EXPECT_EQ(job.store->get(generation_key("j"))->value, "2");
}

TEST(DeciderHosts, ATakeOverRecoversFromTheLostCoordinatorsHost) {
  Job job;
  Decider::History history;
  history.first_members = {0, 1};
  {
    Decider first(job.cfg, job.store, "j", 2, 0, hosts({{0, 1}, {1, 1}}));
    for (const auto& s : first.initial_starts()) history.host_of[s.process] = s.host;
  }
  job.progress(0, 5);
  // Host 0 (the coordinator's, with process 0) is gone: the new decider counts process 0 dead.
  Decider second(job.cfg, job.store, "j", history, hosts({{1, 1}}));
  EXPECT_FALSE(second.running(0));
  EXPECT_EQ(job.store->get(failure_key("j"))->value, "1");
  job.report(1, 1, 1, 5);
  EXPECT_TRUE(second.update().empty());
  const auto r = job.record(1);
  EXPECT_TRUE(r.recovery);
  EXPECT_EQ(r.to_members, (std::vector<int>{1}));
}

TEST(DeciderHosts, ATakeOverGivesBackAGenerationClaimedWithoutARecord) {
  Job job;
  Decider::History history;
  history.first_members = {0, 1};
  {
    Decider first(job.cfg, job.store, "j", 2, 0, hosts({{0, 1}, {1, 1}}));
    for (const auto& s : first.initial_starts()) history.host_of[s.process] = s.host;
  }
  // The lost coordinator moved the counter and died before writing record 1.
  auto kv = job.store->get(generation_key("j"));
  ASSERT_TRUE(job.store->compare_and_set(generation_key("j"), kv->revision, "1"));
  Decider second(job.cfg, job.store, "j", history, hosts({{0, 1}, {1, 1}}));
  EXPECT_EQ(job.store->get(generation_key("j"))->value, "0");
  EXPECT_EQ(second.scale(1).rfind("ok:", 0), 0u);
  second.update();
  EXPECT_EQ(job.record(1).to.world(), 1);
}

}  // namespace
}  // namespace tessel::elastic
