#include "tessel/comm/process_groups.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

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

}  // namespace
}  // namespace tessel::comm
