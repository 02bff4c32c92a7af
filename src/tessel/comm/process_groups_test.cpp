#include "tessel/comm/process_groups.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/testing/testing.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;

std::vector<GridLayout> all_layouts_up_to(int max_world) {
  std::vector<std::array<Axis, 3>> orders;
  std::array<Axis, 3> order{Axis::kTp, Axis::kDp, Axis::kPp};
  std::sort(order.begin(), order.end());
  do orders.push_back(order);
  while (std::next_permutation(order.begin(), order.end()));

  std::vector<GridLayout> layouts;
  for (int dp = 1; dp <= max_world; ++dp) {
    for (int tp = 1; dp * tp <= max_world; ++tp) {
      for (int pp = 1; dp * tp * pp <= max_world; ++pp) {
        for (const auto& o : orders) layouts.push_back(GridLayout{dp, tp, pp, o});
      }
    }
  }
  return layouts;
}

std::string describe(const GridLayout& l) {
  std::string s = "dp=" + std::to_string(l.dp) + " tp=" + std::to_string(l.tp) +
                  " pp=" + std::to_string(l.pp) + " order=";
  for (Axis a : l.order) s += std::string(axis_name(a)) + ",";
  return s;
}

TEST(ProcessGroupsTest, DefaultOrderIsTpInnermostThenDpThenPp) {
  for (const auto& layout : all_layouts_up_to(8)) {
    if (layout.order != std::array<Axis, 3>{Axis::kTp, Axis::kDp, Axis::kPp}) continue;
    for (int pp = 0; pp < layout.pp; ++pp) {
      for (int dp = 0; dp < layout.dp; ++dp) {
        for (int tp = 0; tp < layout.tp; ++tp) {
          const int rank = pp * layout.dp * layout.tp + dp * layout.tp + tp;
          EXPECT_EQ(rank_of(layout, GridCoord{dp, tp, pp}), rank) << describe(layout);
          EXPECT_EQ(coord_of(layout, rank), (GridCoord{dp, tp, pp})) << describe(layout);
        }
      }
    }
  }
}

TEST(ProcessGroupsTest, CoordinatesRoundTripForEveryOrder) {
  for (const auto& layout : all_layouts_up_to(8)) {
    std::set<std::tuple<int, int, int>> seen;
    for (int r = 0; r < layout.world_size(); ++r) {
      const GridCoord c = coord_of(layout, r);
      EXPECT_EQ(rank_of(layout, c), r) << describe(layout);
      seen.insert({c.dp, c.tp, c.pp});
    }
    EXPECT_EQ(int(seen.size()), layout.world_size()) << describe(layout);
    // The innermost axis varies fastest.
    if (layout.extent(layout.order[0]) > 1) {
      EXPECT_EQ(coord_of(layout, 1)[layout.order[0]], 1) << describe(layout);
    }
  }
}

// For every layout with at most 8 ranks: the groups of each axis partition the world, every
// member of a group derives the same group (name and member order), and members differ only in
// the group's axis.
TEST(ProcessGroupsTest, AxisGroupsPartitionTheWorldConsistently) {
  for (const auto& layout : all_layouts_up_to(8)) {
    const int world = layout.world_size();
    for (Axis axis : {Axis::kTp, Axis::kDp, Axis::kPp}) {
      std::map<std::string, std::vector<int>> groups;
      std::vector<int> times_seen(size_t(world), 0);
      for (int r = 0; r < world; ++r) {
        const GroupSpec g = axis_group(layout, r, axis);
        ASSERT_EQ(g.size(), layout.extent(axis)) << describe(layout);
        ASSERT_EQ(g.members[g.rank_in_group], r) << describe(layout);
        EXPECT_EQ(g.rank_in_group, coord_of(layout, r)[axis]) << describe(layout);
        auto [it, inserted] = groups.emplace(g.name, g.members);
        EXPECT_EQ(it->second, g.members) << describe(layout) << " group " << g.name;
        if (inserted) {
          for (int m : g.members) ++times_seen[m];
        }
        const GridCoord me = coord_of(layout, r);
        for (size_t i = 0; i < g.members.size(); ++i) {
          GridCoord c = coord_of(layout, g.members[i]);
          EXPECT_EQ(c[axis], int(i)) << describe(layout);
          c[axis] = me[axis];
          EXPECT_EQ(c, me) << describe(layout) << " member " << g.members[i];
        }
      }
      EXPECT_EQ(int(groups.size()), world / layout.extent(axis)) << describe(layout);
      for (int r = 0; r < world; ++r) EXPECT_EQ(times_seen[r], 1) << describe(layout);
      for (const auto& [name, members] : groups) {
        const std::string prefix = std::string(axis_name(axis)) + ".";
        ASSERT_EQ(name.rfind(prefix, 0), 0u) << name;
        const int index = std::stoi(name.substr(prefix.size()));
        EXPECT_TRUE(index >= 0 && index < world / layout.extent(axis)) << name;
      }
    }
  }
}

TEST(ProcessGroupsTest, EmbeddingGroupJoinsFirstAndLastStage) {
  for (const auto& layout : all_layouts_up_to(8)) {
    std::map<std::string, std::vector<int>> groups;
    for (int r = 0; r < layout.world_size(); ++r) {
      const GridCoord me = coord_of(layout, r);
      const auto g = embedding_group(layout, r);
      const bool end_stage = me.pp == 0 || me.pp == layout.pp - 1;
      ASSERT_EQ(g.has_value(), end_stage) << describe(layout) << " rank " << r;
      if (!g) continue;
      GridCoord first = me, last = me;
      first.pp = 0;
      last.pp = layout.pp - 1;
      std::vector<int> expected{rank_of(layout, first)};
      if (layout.pp > 1) expected.push_back(rank_of(layout, last));
      EXPECT_EQ(g->members, expected) << describe(layout);
      EXPECT_EQ(g->members[g->rank_in_group], r) << describe(layout);
      auto [it, inserted] = groups.emplace(g->name, g->members);
      EXPECT_EQ(it->second, g->members) << describe(layout) << " " << g->name;
    }
    EXPECT_EQ(int(groups.size()), layout.dp * layout.tp) << describe(layout);
  }
}

TEST(ProcessGroupsTest, WorkedExample) {
  // dp=2, tp=2, pp=2, default order: rank 5 = pp 1, dp 0, tp 1.
  const GridLayout layout{2, 2, 2};
  EXPECT_EQ(coord_of(layout, 5), (GridCoord{0, 1, 1}));
  EXPECT_EQ(axis_group(layout, 5, Axis::kTp).members, (std::vector<int>{4, 5}));
  EXPECT_EQ(axis_group(layout, 5, Axis::kDp).members, (std::vector<int>{5, 7}));
  EXPECT_EQ(axis_group(layout, 5, Axis::kPp).members, (std::vector<int>{1, 5}));
  EXPECT_EQ(embedding_group(layout, 5)->members, (std::vector<int>{1, 5}));
  EXPECT_EQ(axis_group(layout, 5, Axis::kTp).name, "tp.2");
}

TEST(ProcessGroupsTest, RejectsInvalidLayouts) {
  EXPECT_THROW(validate(GridLayout{0, 1, 1}), ConfigError);
  EXPECT_THROW(validate(GridLayout{1, 1, 1, {Axis::kTp, Axis::kTp, Axis::kPp}}), ConfigError);
  EXPECT_THROW(coord_of(GridLayout{2, 1, 1}, 2), InvalidArgumentError);
  tessel::testing::TempDir dir;
  StoreOptions store{dir.path().string(), "job", 0, 1s};
  EXPECT_THROW(connect_process_groups(store, GridLayout{2, 2, 1}, 0, 3), ConfigError);
}

// Connects every group for real and all-reduces inside each: a group's sum must equal the sum of
// its members' contributions, which shows each communicator reached exactly its members.
void connect_and_reduce(const GridLayout& layout) {
  const int world = layout.world_size();
  tessel::testing::TempDir dir;
  StoreOptions store{(dir.path() / "store").string(), "groups-job", 3, 20s};
  auto outcomes = testing::run_ranks(world, 40s, [&](int rank) {
    ProcessGroups g = connect_process_groups(store, layout, rank, world, 20s);
    CHILD_CHECK(g.coord == coord_of(layout, rank), rank, "coord");
    auto contribution = [](int r) { return double(1 << r); };  // distinct bits per rank
    auto check = [&](Communicator* c, const std::vector<int>& members, const char* what) {
      if (c == nullptr) return members.empty();
      if (c->size() != int(members.size())) return false;
      std::vector<double> v(3, contribution(rank));
      c->all_reduce_sum(v.data(), v.size());
      double expected = 0;
      for (int m : members) expected += contribution(m);
      if (v[0] != expected || v[2] != expected) {
        std::fprintf(stderr, "[rank %d] %s: got %g, want %g\n", rank, what, v[0], expected);
        return false;
      }
      return true;
    };
    CHILD_CHECK(check(g.world.get(), world_group(layout, rank).members, "world"), rank, "world");
    CHILD_CHECK(check(g.tp.get(), axis_group(layout, rank, Axis::kTp).members, "tp"), rank, "tp");
    CHILD_CHECK(check(g.dp.get(), axis_group(layout, rank, Axis::kDp).members, "dp"), rank, "dp");
    CHILD_CHECK(check(g.pp.get(), axis_group(layout, rank, Axis::kPp).members, "pp"), rank, "pp");
    auto embed = embedding_group(layout, rank);
    CHILD_CHECK(check(g.embed.get(), embed ? embed->members : std::vector<int>{}, "embed"), rank,
                "embed");
    return testing::kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

TEST(ProcessGroupsTest, ConnectsDataAndTensorGroupsOfFourRanks) {
  connect_and_reduce(GridLayout{2, 2, 1});
}

TEST(ProcessGroupsTest, ConnectsPipelineAndEmbeddingGroupsOfFourRanks) {
  connect_and_reduce(GridLayout{1, 2, 2});
}

// dp=2 x tp=1 x pp=1: world, dp and dp_grad have both ranks; tp, pp and embed are size-1 groups.
// Rank 0 runs the runtime's pattern (a background thread all-reducing on dp_grad while the main
// thread works) and aborts all its groups from the main thread. Rank 1 is blocked on rank 0 in
// two groups at once (a receive on world, the dp_grad all-reduce loop on a second thread) and
// afterwards uses dp, which had nothing pending: all three must fail with PeerLostError. Every
// timeout is 30 s and the parent's deadline 20 s, and rank 0 makes no call on world or dp (and
// stays alive) until rank 1 is done, so only the abort's closing of the connections of every
// group can end rank 1's waits.
TEST(ProcessGroupsTest, AbortBreaksEveryGroup) {
  const GridLayout layout{2, 1, 1};
  const std::string reason = "peer lost on group 'tp.0' during step 3";
  tessel::testing::TempDir dir;
  StoreOptions store{(dir.path() / "store").string(), "abort-job", 0, 20s};
  const auto done_file = dir.path() / "rank1.done";
  auto outcomes = testing::run_ranks(2, 20s, [&](int rank) {
    ProcessGroups g = connect_process_groups(store, layout, rank, 2, 30s);
    CHILD_CHECK(g.world && g.tp && g.dp && g.pp && g.embed && g.dp_grad, rank, "groups missing");
    auto failure_of = [&](auto&& f) -> std::string {
      try {
        f();
      } catch (const PeerLostError& e) {
        return e.what();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] not a PeerLostError: %s\n", rank, e.what());
        return "";
      }
      return "";
    };
    std::string background;
    std::thread grad([&] {
      background = failure_of([&] {
        std::vector<float> v(size_t(1) << 16, 1.f);
        for (int step = 0; step < 1000000; ++step) g.dp_grad->all_reduce_sum(v.data(), v.size());
      });
    });

    int64_t x = 0;
    if (rank == 1) {
      auto q = g.world->recv(&x, sizeof(x), 0, 1);  // rank 0 never sends it
      const std::string world = failure_of([&] { q.wait(); });
      grad.join();
      const std::string dp = failure_of([&] { g.dp->barrier(); });
      std::ofstream(done_file).put('x');
      CHILD_CHECK(!world.empty(), rank, "world recv did not fail with PeerLostError");
      CHILD_CHECK(!background.empty(), rank, "dp_grad loop did not fail with PeerLostError");
      CHILD_CHECK(!dp.empty(), rank, "dp barrier did not fail with PeerLostError");
      return testing::kChildOk;
    }

    auto pending = g.world->recv(&x, sizeof(x), 1, 2);  // never completed nor waited for
    std::this_thread::sleep_for(100ms);
    g.abort(reason);
    grad.join();
    CHILD_CHECK(background.find(reason) != std::string::npos, rank,
                "dp_grad loop: '" + background + "'");
    CHILD_CHECK(background.find("group 'dpgrad.0'") != std::string::npos, rank, background);
    while (!std::filesystem::exists(done_file)) std::this_thread::sleep_for(1ms);
    const std::pair<const char*, Communicator*> groups[] = {
        {"world", g.world.get()}, {"tp", g.tp.get()},       {"dp", g.dp.get()},
        {"pp", g.pp.get()},       {"embed", g.embed.get()}, {"dp_grad", g.dp_grad.get()}};
    for (const auto& [name, c] : groups) {
      const std::string what = failure_of([&] { c->barrier(); });
      CHILD_CHECK(what.find(reason) != std::string::npos, rank,
                  std::string(name) + " barrier after abort: '" + what + "'");
    }
    g.abort("again");          // idempotent
    return testing::kChildOk;  // `pending` is destroyed here, after the abort: must not block
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

// One signal stops a whole world, connecting or connected. dp=2 x tp=2: rank 3 joins only the
// world and its tp group (by hand) and then idles, so rank 1 is left waiting in its dp group's
// rendezvous (dp.1 = {1, 3}) while ranks 0 and 2 connect all their groups. Ranks 0 and 2 then
// fire their signals: every group breaks (world, tp, dp and dp_grad with PeerLostError; the
// size-1 pp and embed groups, which only the signal can reach, naming its reason). Rank 1 fires
// its signal last: connect_process_groups throws PeerLostError naming the aborted rendezvous.
// Store timeouts are 60 s, the deadline 20 s.
TEST(ProcessGroupsTest, OneSignalAbortsAWorldConnectingOrConnected) {
  const GridLayout layout{2, 2, 1};
  tessel::testing::TempDir dir;
  const StoreOptions store{(dir.path() / "store").string(), "signal-job", 0, 60s};
  auto file = [&](const std::string& name) { return dir.path() / name; };
  auto wait_for = [&](const std::string& name) {
    while (!std::filesystem::exists(file(name))) std::this_thread::sleep_for(1ms);
  };
  auto outcomes = testing::run_ranks(4, 20s, [&](int rank) {
    if (rank == 3) {
      auto world = Communicator::connect(store, "world", 3, 4, 30s);
      const GroupSpec tp = axis_group(layout, 3, Axis::kTp);
      auto tp_group = Communicator::connect(store, tp.name, tp.rank_in_group, tp.size(), 30s);
      wait_for("done.1");
      return testing::kChildOk;
    }
    StoreOptions o = store;
    o.abort_signal = std::make_shared<AbortSignal>();
    const std::string reason = "rank " + std::to_string(rank) + " saw recovery 2";
    if (rank == 1) {
      std::thread aborter([&] {
        wait_for("aborted.0");
        wait_for("aborted.2");
        std::this_thread::sleep_for(100ms);
        o.abort_signal->abort(reason);
      });
      std::string what;
      try {
        connect_process_groups(o, layout, rank, 4, 30s);
      } catch (const PeerLostError& e) {
        what = e.what();
      }
      aborter.join();
      std::ofstream(file("done.1")).put('x');
      CHILD_CHECK(what.find("rendezvous aborted by this process: " + reason) != std::string::npos,
                  rank, "connect_process_groups: '" + what + "'");
      CHILD_CHECK(what.find("group 'dp.1'") != std::string::npos, rank, what);
      return testing::kChildOk;
    }
    ProcessGroups g = connect_process_groups(o, layout, rank, 4, 30s);
    o.abort_signal->abort(reason);
    std::ofstream(file("aborted." + std::to_string(rank))).put('x');
    const std::pair<const char*, Communicator*> groups[] = {
        {"world", g.world.get()}, {"tp", g.tp.get()},       {"dp", g.dp.get()},
        {"pp", g.pp.get()},       {"embed", g.embed.get()}, {"dp_grad", g.dp_grad.get()}};
    for (const auto& [name, c] : groups) {
      CHILD_CHECK(c != nullptr, rank, std::string(name) + " missing");
      std::string what;
      try {
        c->barrier();
      } catch (const PeerLostError& e) {
        what = e.what();
      }
      CHILD_CHECK(!what.empty(), rank, std::string(name) + ": barrier after the signal passed");
      if (c->size() == 1) {
        CHILD_CHECK(what.find(reason) != std::string::npos, rank, std::string(name) + ": " + what);
      }
    }
    return testing::kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

}  // namespace
}  // namespace tessel::comm
