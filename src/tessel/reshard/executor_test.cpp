// The networked executor: real processes (forked) on loopback, a union world over the old and new
// processes, leaving processes that only send and joining ones that only receive.
#include "tessel/reshard/executor.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/core/error.h"
#include "tessel/process/fork_children.h"  // run_ranks runs the processes
#include "tessel/reshard/reshard_test_util.h"
#include "tessel/testing/testing.h"

namespace tessel::reshard {
namespace {

using namespace std::chrono_literals;
using comm::testing::kChildOk;
using comm::testing::run_ranks;
using layout::Plan;
using layout::ScalarState;
using layout::StateLayout;
using model::ModelConfig;
using testing::RankState;
using testing::StateUniverse;

constexpr uint64_t kSeed = 7;

Plan make_plan(int dp, int tp, int pp, int zero = 0, std::vector<int> lps = {}) {
  Plan p;
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  p.zero_stage = zero;
  p.layers_per_stage = std::move(lps);
  return p;
}

comm::StoreOptions store_in(const tessel::testing::TempDir& dir, const std::string& job) {
  return testing::transition_store(dir.path(), job, 20s);
}

struct Case {
  std::string name;
  ModelConfig config;
  Plan a, b;
  std::vector<int> old_ids, new_ids;
};

// Every process of the case runs this: reshard its ids-filled old state (if any) and compare
// what it ends with against a fresh B; joiners also receive the scalar state.
int run_process(const Case& c, const tessel::testing::TempDir& dir, int process, bool direct,
                int lanes) {
  const auto A = StateLayout::build(c.config, c.a);
  const auto B = StateLayout::build(c.config, c.b);
  std::vector<int> old_hosts(c.old_ids.size(), 0), new_hosts(c.new_ids.size(), 0);
  const auto plan = TransferPlan::build(A, B, old_hosts, new_hosts, c.old_ids, c.new_ids);
  const StateUniverse u(c.config, kSeed);
  const auto store = store_in(dir, c.name + (direct ? "-direct" : "-net") + std::to_string(lanes));
  auto world = connect_transition_world(store, plan, process, 20s);
  const auto lane_worlds = connect_transition_lanes(store, plan, process, lanes, 20s);
  ExecuteOptions how;
  how.same_host_direct = direct;
  for (const auto& l : lane_worlds) how.lanes.push_back(l.get());

  const int i = plan.old_rank_of(process), j = plan.new_rank_of(process);
  ProcessBuffers io;
  RankState old_state, new_state;
  if (i >= 0) {
    old_state = testing::filled_state(A, i, u, true);
    io.old_buffers = old_state.const_spans();
  }
  if (j >= 0) {
    new_state = testing::empty_state(B, j);
    io.new_buffers = new_state.spans();
  }
  const auto stats = execute(plan, process, *world, io, how);
  int64_t incoming = 0;
  for (const auto& m : plan.messages())
    if (m.dst_process == process) incoming += m.bytes();
  CHILD_CHECK(stats.bytes_read_directly == (direct ? incoming : 0) &&
                  stats.bytes_received == (direct ? 0 : incoming),
              process, c.name + ": the messages did not take the transport asked for");
  if (j >= 0) {
    CHILD_CHECK(new_state == testing::filled_state(B, j, u, true), process,
                c.name + ": new rank " + std::to_string(j) + " differs from a fresh B");
  }
  // Each old rank offers a different step, so the result shows whose was shared: the lowest
  // old rank whose state is not lost.
  auto scalars = [](int old_rank) { return ScalarState{5 + old_rank, 5, 640, {1, 2, 3}}; };
  int root = 0;
  while (c.old_ids[size_t(root)] == TransferPlan::kLost) ++root;
  const ScalarState mine = scalars(i);
  const ScalarState got = share_scalar_state(plan, process, *world, i >= 0 ? &mine : nullptr);
  CHILD_CHECK(got == scalars(root), process, c.name + ": scalar state");
  return kChildOk;
}

void run_case(const Case& c) {
  SCOPED_TRACE(c.name);
  tessel::testing::TempDir dir;
  const auto A = StateLayout::build(c.config, c.a);
  const auto B = StateLayout::build(c.config, c.b);
  const auto plan =
      TransferPlan::build(A, B, std::vector<int>(c.old_ids.size(), 0),
                          std::vector<int>(c.new_ids.size(), 0), c.old_ids, c.new_ids);
  ASSERT_GT(plan.stats().bytes_moved, 0);
  const auto& procs = plan.processes();
  // Both transports: over the network (on one stream per pair, and on three: the world and two
  // lanes), and read straight from the senders' memory.
  for (auto [direct, lanes] : {std::pair{false, 0}, {false, 2}, {true, 0}}) {
    SCOPED_TRACE(direct ? "direct reads" : "network, " + std::to_string(lanes) + " lanes");
    const auto outcomes = run_ranks(int(procs.size()), 60s, [&](int u) {
      return run_process(c, dir, procs[size_t(u)], direct, lanes);
    });
    for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << comm::testing::describe(outcomes);
  }
}

// Two processes: process 1 joins (only receives) a tp-2 layout of process 0's single-rank job.
TEST(ReshardExecutor, JoiningProcessOnlyReceives) {
  run_case({"join2",
            ModelConfig::preset("gpt2-tiny"),
            make_plan(1, 1, 1),
            make_plan(1, 2, 1),
            {0},
            {0, 1}});
}

// Three processes: tp 2 on {0, 1} -> pp 2 on {1, 2}; 0 leaves (only sends), 2 joins.
TEST(ReshardExecutor, LeavingProcessOnlySends) {
  run_case({"leave3",
            ModelConfig::preset("gpt2-tiny"),
            make_plan(1, 2, 1, 0),
            make_plan(1, 1, 2, 0, {3, 5}),
            {0, 1},
            {2, 1}});
}

// Four processes: llama pp 3 (uneven) on {0, 1, 2} -> dp 3 ZeRO-1 on {3, 2, 1}: 0 leaves, 3
// joins, the survivors change rank.
TEST(ReshardExecutor, FourProcessesWithGqaAndZero) {
  run_case({"four",
            ModelConfig::preset("llama-tiny"),
            make_plan(1, 1, 3, 0, {2, 5, 1}),
            make_plan(3, 1, 1, 1),
            {0, 1, 2},
            {3, 2, 1}});
}

// Old rank 0's state is lost (its process 0 is back, empty): dp 3 -> tp 2 from the surviving
// replicas on processes 2 and 1; old rank 1 (process 2) shares the scalar state.
TEST(ReshardExecutor, OldRankZeroLost) {
  run_case({"lost0",
            ModelConfig::preset("gpt2-tiny"),
            make_plan(3, 1, 1),
            make_plan(1, 2, 1),
            {TransferPlan::kLost, 2, 1},
            {0, 1}});
}

// A peer that never executes: the waiting receive ends with TimeoutError, not a hang.
TEST(ReshardExecutor, ReceivesAreBoundedByTheTimeout) {
  tessel::testing::TempDir dir;
  const auto config = ModelConfig::preset("gpt2-tiny");
  const auto L = StateLayout::build(config, make_plan(1, 1, 1));
  // Old rank 0 is process 1, new rank 0 is process 0: everything must travel from 1 to 0.
  const auto plan = TransferPlan::build(L, L, {0}, {0}, {1}, {0});
  const auto outcomes = run_ranks(2, 30s, [&](int process) {
    auto store = store_in(dir, "timeout");
    auto world = connect_transition_world(store, plan, process, 200ms);
    if (process == 1) {  // holds the data but never sends it
      std::this_thread::sleep_for(800ms);
      return kChildOk;
    }
    RankState fresh = testing::empty_state(L, 0);
    ProcessBuffers io;
    io.new_buffers = fresh.spans();
    const auto thrown =
        comm::testing::what_throws(process, [&] { execute(plan, process, *world, io); });
    CHILD_CHECK(thrown == comm::testing::Thrown::kTimeout, process,
                comm::testing::thrown_name(thrown));
    return kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << comm::testing::describe(outcomes);
}

// One process, a world of one (no network): kept buffers are copied, dropped kinds ignored;
// buffers or worlds that do not match the plan are rejected.
TEST(ReshardExecutor, SingleProcessAndArgumentChecks) {
  tessel::testing::TempDir dir;
  const auto config = ModelConfig::preset("gpt2-tiny");
  const StateUniverse u(config, kSeed);
  const auto full = StateLayout::build(config, make_plan(1, 1, 1));
  const auto params = StateLayout::build(config, make_plan(1, 1, 1), {layout::StateKind::param});
  const auto plan = TransferPlan::build(full, params, {0}, {0});  // keeps params, drops Adam
  ASSERT_EQ(plan.processes().size(), 1u);
  EXPECT_EQ(plan.stats().kept_bytes, plan.stats().total_bytes);

  auto world = comm::Communicator::connect(store_in(dir, "single"), kTransitionGroup, 0, 1, 5s);
  RankState old_state = testing::filled_state(full, 0, u, true);
  RankState new_state = testing::empty_state(params, 0);
  execute(plan, 0, *world, {old_state.const_spans(), new_state.spans()});
  EXPECT_TRUE(new_state == testing::filled_state(params, 0, u, true));

  EXPECT_THROW(execute(plan, 0, *world, {old_state.const_spans(), {}}), InvalidArgumentError);
  new_state.buffers[0].resize(10);
  EXPECT_THROW(execute(plan, 0, *world, {old_state.const_spans(), new_state.spans()}),
               InvalidArgumentError);
  // The union world of this plan has two processes.
  const auto two = TransferPlan::build(full, full, {0}, {0}, {0}, {1});
  EXPECT_THROW(execute(two, 0, *world, {old_state.const_spans(), {}}), InvalidArgumentError);
}

// With every old rank lost nobody holds the scalar state: share_scalar_state says so at once.
TEST(ReshardExecutor, ScalarStateNeedsAnOldRankThatIsNotLost) {
  tessel::testing::TempDir dir;
  const auto config = ModelConfig::preset("gpt2-tiny");
  const auto full = StateLayout::build(config, make_plan(1, 1, 1));
  const auto nothing = StateLayout::build(config, make_plan(1, 1, 1), {});  // needs no state
  const auto plan = TransferPlan::build(full, nothing, {0}, {0}, {TransferPlan::kLost}, {0});
  EXPECT_EQ(plan.processes(), std::vector<int>{0});
  auto world = comm::Communicator::connect(store_in(dir, "all-lost"), kTransitionGroup, 0, 1, 5s);
  const ScalarState mine{1, 1, 1, {}};
  EXPECT_THROW(share_scalar_state(plan, 0, *world, &mine), InvalidArgumentError);
  // Nothing to move, and the lost rank's buffers need not be given.
  execute_in_memory(plan, {{}}, {{}});
}

// ZeRO-1 dp 2 -> dp 1 on process 0: its parameter buffer is kept, and may be passed as its own
// new buffer (left alone); the Adam halves are a local copy and a message.
TEST(ReshardExecutor, KeptBufferMayBeItsOldBuffer) {
  const auto config = ModelConfig::preset("llama-tiny");
  const StateUniverse u(config, kSeed);
  const auto A = StateLayout::build(config, make_plan(2, 1, 1, 1));
  const auto B = StateLayout::build(config, make_plan(1, 1, 1, 1));
  const auto plan = TransferPlan::build(A, B, {0, 0}, {0});
  const int pb = B.buffer_id(0, 0, layout::StateKind::param);
  const int pa = A.buffer_id(0, 0, layout::StateKind::param);
  ASSERT_EQ(plan.kept_from(0, pb), pa);

  RankState a0 = testing::filled_state(A, 0, u, true), a1 = testing::filled_state(A, 1, u, true);
  RankState b0 = testing::empty_state(B, 0);
  std::vector<std::span<float>> news = b0.spans();
  news[size_t(pb)] = std::span<float>(a0.buffers[size_t(pa)]);  // the old buffer itself
  execute_in_memory(plan, {a0.const_spans(), a1.const_spans()}, {news});
  b0.buffers[size_t(pb)] = a0.buffers[size_t(pa)];
  EXPECT_TRUE(b0 == testing::filled_state(B, 0, u, true));
}

}  // namespace
}  // namespace tessel::reshard
