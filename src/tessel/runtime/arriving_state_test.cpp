// The optimizer state of a switch between hosts, moved on a background thread after the pause:
// real processes on loopback (two "hosts"), the Adam moments' part of the transfer plan, on the
// union world and one lane.
#include "tessel/runtime/arriving_state.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>

#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/core/error.h"
#include "tessel/process/fork_children.h"  // run_ranks runs the processes
#include "tessel/reshard/reshard_test_util.h"
#include "tessel/runtime/rank_trainer.h"
#include "tessel/testing/testing.h"

namespace tessel::runtime {
namespace {

using namespace std::chrono_literals;
using comm::testing::kChildOk;
using comm::testing::run_ranks;
using layout::StateKind;
using layout::StateLayout;
using reshard::Transfer;
using reshard::TransferPlan;

comm::StoreOptions store_in(const tessel::testing::TempDir& dir, const std::string& job) {
  return reshard::testing::transition_store(dir.path(), job, 5s);
}

struct Fixture {
  model::ModelConfig config = model::ModelConfig::preset("gpt2-tiny");
  StateLayout layout = StateLayout::build(config, layout::Plan{});
  // Process 1 (host 1) holds the state; process 0 (host 0) takes it over: everything travels.
  TransferPlan plan = TransferPlan::build(layout, layout, {1}, {0}, {1}, {0});
  TransferPlan adam =
      plan.part([](const Transfer& tr) { return tr.kind != StateKind::param; }, false);
  reshard::testing::StateUniverse universe{config, 11};
};

// Runs `process`'s side: 1 sends its filled state unless `sender_dies` (it connects, then exits),
// 0 receives; returns what 0's wait() threw.
int run_process(const Fixture& f, const tessel::testing::TempDir& dir, int process,
                bool sender_dies) {
  const auto store = store_in(dir, sender_dies ? "dies" : "lives");
  auto world = reshard::connect_transition_world(store, f.adam, process, 5s);
  auto lanes = reshard::connect_transition_lanes(store, f.adam, process, 1, 5s);
  if (process == 1 && sender_dies) return kChildOk;
  auto old_state = reshard::testing::filled_state(f.layout, 0, f.universe, true);
  auto new_state = reshard::testing::empty_state(f.layout, 0);
  reshard::ProcessBuffers buffers;
  if (process == 1)
    buffers.old_buffers = old_state.const_spans();
  else
    buffers.new_buffers = new_state.spans();
  ArrivingState arriving(f.adam, process, std::move(world), std::move(lanes), buffers, {}, nullptr);
  CHILD_CHECK(arriving.receives() == (process == 0), process, "receives()");
  const auto caught = comm::testing::catch_error(process, [&] { arriving.wait(); });
  if (sender_dies) {
    CHILD_CHECK(caught.kind == comm::testing::Thrown::kPeerLost ||
                    caught.kind == comm::testing::Thrown::kTimeout,
                process, "a lost sender must fail the transfer: " + caught.what);
    return kChildOk;
  }
  CHILD_CHECK(caught.kind == comm::testing::Thrown::kNothing, process, caught.what);
  if (process == 0) {
    // The Adam moments arrived exactly; the parameters are not this part's.
    const auto want = reshard::testing::filled_state(f.layout, 0, f.universe, true);
    const auto untouched = reshard::testing::empty_state(f.layout, 0);
    for (size_t b = 0; b < f.layout.buffers(0).size(); ++b) {
      const bool param = f.layout.buffers(0)[b].kind == StateKind::param;
      const auto& expect = param ? untouched.buffers[b] : want.buffers[b];
      // Bit for bit (an unwritten element is a NaN pattern).
      const auto& got = new_state.buffers[b];
      CHILD_CHECK(got.size() == expect.size() &&
                      std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)) == 0,
                  process,
                  "buffer " + std::to_string(b) + (param ? " (param) was written" : " differs"));
    }
    CHILD_CHECK(arriving.bytes_received() == f.adam.stats().bytes_moved, process, "bytes");
  }
  return kChildOk;
}

TEST(ArrivingState, MovesTheOptimizerStateOnItsOwnThread) {
  Fixture f;
  ASSERT_GT(f.adam.stats().bytes_moved, 0);
  ASSERT_LT(f.adam.stats().bytes_moved, f.plan.stats().bytes_moved);
  tessel::testing::TempDir dir;
  const auto outcomes =
      run_ranks(2, 60s, [&](int process) { return run_process(f, dir, process, false); });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << comm::testing::describe(outcomes);
}

TEST(ArrivingState, ALostSenderFailsTheTransferWithinItsTimeout) {
  Fixture f;
  tessel::testing::TempDir dir;
  const auto outcomes =
      run_ranks(2, 60s, [&](int process) { return run_process(f, dir, process, true); });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << comm::testing::describe(outcomes);
}

}  // namespace
}  // namespace tessel::runtime
