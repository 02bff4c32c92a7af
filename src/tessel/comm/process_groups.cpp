#include "tessel/comm/process_groups.h"

#include <algorithm>

#include "tessel/core/check.h"

namespace tessel::comm {

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::kTp:
      return "tp";
    case Axis::kDp:
      return "dp";
    case Axis::kPp:
      return "pp";
  }
  return "?";
}

int GridLayout::extent(Axis axis) const {
  switch (axis) {
    case Axis::kTp:
      return tp;
    case Axis::kDp:
      return dp;
    case Axis::kPp:
      return pp;
  }
  return 0;
}

int& GridCoord::operator[](Axis axis) {
  switch (axis) {
    case Axis::kTp:
      return tp;
    case Axis::kDp:
      return dp;
    default:
      return pp;
  }
}

int GridCoord::operator[](Axis axis) const {
  return const_cast<GridCoord&>(*this)[axis];
}

void validate(const GridLayout& layout) {
  TESSEL_CHECK(layout.dp >= 1 && layout.tp >= 1 && layout.pp >= 1, ConfigError,
               "parallel layout dp={} tp={} pp={}: every degree must be at least 1", layout.dp,
               layout.tp, layout.pp);
  for (Axis a : {Axis::kTp, Axis::kDp, Axis::kPp}) {
    TESSEL_CHECK(std::count(layout.order.begin(), layout.order.end(), a) == 1, ConfigError,
                 "parallel layout order must name tp, dp and pp exactly once ({} appears {} times)",
                 axis_name(a), std::count(layout.order.begin(), layout.order.end(), a));
  }
}

GridCoord coord_of(const GridLayout& layout, int rank) {
  validate(layout);
  TESSEL_CHECK(rank >= 0 && rank < layout.world_size(), InvalidArgumentError,
               "rank {} outside the world of {} ranks", rank, layout.world_size());
  GridCoord c;
  int rest = rank;
  for (Axis a : layout.order) {
    c[a] = rest % layout.extent(a);
    rest /= layout.extent(a);
  }
  return c;
}

int rank_of(const GridLayout& layout, const GridCoord& coord) {
  validate(layout);
  int rank = 0;
  int stride = 1;
  for (Axis a : layout.order) {
    TESSEL_CHECK(coord[a] >= 0 && coord[a] < layout.extent(a), InvalidArgumentError,
                 "{} coordinate {} outside [0, {})", axis_name(a), coord[a], layout.extent(a));
    rank += coord[a] * stride;
    stride *= layout.extent(a);
  }
  return rank;
}

namespace {

// Index of the group of `axis` containing coordinate c: the remaining coordinates read as a
// mixed-radix number, innermost first as in the layout.
int group_index(const GridLayout& layout, const GridCoord& c, Axis axis) {
  int index = 0;
  int stride = 1;
  for (Axis a : layout.order) {
    if (a == axis) continue;
    index += c[a] * stride;
    stride *= layout.extent(a);
  }
  return index;
}

}  // namespace

GroupSpec axis_group(const GridLayout& layout, int rank, Axis axis) {
  const GridCoord me = coord_of(layout, rank);
  GroupSpec g;
  g.name = std::string(axis_name(axis)) + "." + std::to_string(group_index(layout, me, axis));
  for (int i = 0; i < layout.extent(axis); ++i) {
    GridCoord c = me;
    c[axis] = i;
    g.members.push_back(rank_of(layout, c));
  }
  g.rank_in_group = me[axis];
  return g;
}

std::optional<GroupSpec> embedding_group(const GridLayout& layout, int rank) {
  const GridCoord me = coord_of(layout, rank);
  const int last = layout.pp - 1;
  if (me.pp != 0 && me.pp != last) return std::nullopt;
  GroupSpec g;
  // The (dp, tp) pair numbered like a pp group: the pp axis left out.
  g.name = "embed." + std::to_string(group_index(layout, me, Axis::kPp));
  GridCoord first = me;
  first.pp = 0;
  g.members.push_back(rank_of(layout, first));
  if (last != 0) {
    GridCoord end = me;
    end.pp = last;
    g.members.push_back(rank_of(layout, end));
  }
  g.rank_in_group = me.pp == 0 ? 0 : 1;
  return g;
}

GroupSpec world_group(const GridLayout& layout, int rank) {
  validate(layout);
  TESSEL_CHECK(rank >= 0 && rank < layout.world_size(), InvalidArgumentError,
               "rank {} outside the world of {} ranks", rank, layout.world_size());
  GroupSpec g;
  g.name = "world";
  for (int i = 0; i < layout.world_size(); ++i) g.members.push_back(i);
  g.rank_in_group = rank;
  return g;
}

void ProcessGroups::abort(const std::string& reason) noexcept {
  // dp_grad first: its background thread may be blocked in a wait right now.
  for (auto* c : {&dp_grad, &world, &tp, &dp, &pp, &embed}) {
    if (*c) (*c)->abort(reason);
  }
}

ProcessGroups connect_process_groups(const StoreOptions& store, const GridLayout& layout,
                                     int world_rank, int world_size,
                                     std::chrono::milliseconds timeout,
                                     const TransportOptions& transport) {
  validate(layout);
  TESSEL_CHECK(world_size == layout.world_size(), ConfigError,
               "world of {} ranks cannot be split into dp={} x tp={} x pp={} ({} ranks)",
               world_size, layout.dp, layout.tp, layout.pp, layout.world_size());
  ProcessGroups groups;
  groups.layout = layout;
  groups.coord = coord_of(layout, world_rank);
  auto join = [&](const GroupSpec& g) {
    return Communicator::connect(store, g.name, g.rank_in_group, g.size(), timeout, transport);
  };
  groups.world = join(world_group(layout, world_rank));
  groups.tp = join(axis_group(layout, world_rank, Axis::kTp));
  groups.dp = join(axis_group(layout, world_rank, Axis::kDp));
  groups.pp = join(axis_group(layout, world_rank, Axis::kPp));
  if (auto g = embedding_group(layout, world_rank)) groups.embed = join(*g);
  if (layout.dp > 1) {
    auto g = axis_group(layout, world_rank, Axis::kDp);
    g.name = "dpgrad" + g.name.substr(2);  // "dp.<i>" -> "dpgrad.<i>"
    groups.dp_grad = join(g);
  }
  return groups;
}

}  // namespace tessel::comm
