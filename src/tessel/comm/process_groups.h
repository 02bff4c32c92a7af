// Process groups of 3D parallelism, carved from one world.
//
// A world of dp*tp*pp ranks is a grid with one coordinate per axis. By default tensor
// parallelism is innermost, then data, then pipeline:
//
//     rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
//
// so the ranks of one tp group are consecutive (they exchange the most data and should share a
// host). The order is a parameter (GridLayout::order, innermost first).
//
// Groups of this rank:
//   tp group    - ranks that differ only in tp_rank (same dp, pp), ordered by tp_rank
//   dp group    - ranks that differ only in dp_rank, ordered by dp_rank
//   pp group    - ranks that differ only in pp_rank, ordered by pp_rank (pipeline stages)
//   embed group - the first and the last pipeline stage with this rank's (dp, tp): they hold the
//                 tied input/output embedding and sum its gradient. Only ranks on the first or
//                 last stage belong to one; with pp == 1 it is just this rank.
// A member's rank inside a group is its position in the member list.
//
// The index math is pure (no processes); connect_process_groups() then joins one Communicator
// per group, each under its own store prefix ("tp.<i>", "dp.<i>", "pp.<i>", "embed.<i>",
// "world"), where <i> numbers the groups of one kind 0.. in the layout's order.
#pragma once

#include <array>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/comm/store.h"

namespace tessel::comm {

enum class Axis { kTp, kDp, kPp };
const char* axis_name(Axis axis);  // "tp", "dp", "pp"

struct GridLayout {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  std::array<Axis, 3> order{Axis::kTp, Axis::kDp, Axis::kPp};  // innermost first

  int world_size() const { return dp * tp * pp; }
  int extent(Axis axis) const;
};

struct GridCoord {
  int dp = 0;
  int tp = 0;
  int pp = 0;
  int& operator[](Axis axis);
  int operator[](Axis axis) const;
  bool operator==(const GridCoord&) const = default;
};

// Throws ConfigError unless every extent is >= 1 and `order` names each axis once.
void validate(const GridLayout& layout);

// Coordinates of `rank` and back. Throw InvalidArgumentError for ranks/coords out of range.
GridCoord coord_of(const GridLayout& layout, int rank);
int rank_of(const GridLayout& layout, const GridCoord& coord);

// A group this rank belongs to: its name (also its store key), its world ranks in group-rank
// order, and this rank's position in it.
struct GroupSpec {
  std::string name;
  std::vector<int> members;
  int rank_in_group = 0;
  int size() const { return int(members.size()); }
};

// The group along `axis` that contains `rank`: named "<axis>.<i>", where i numbers the groups of
// that axis by the remaining coordinates in layout order.
GroupSpec axis_group(const GridLayout& layout, int rank, Axis axis);

// The tied-embedding group of `rank` ("embed.<i>", i = index of the (dp, tp) pair in layout
// order), or nullopt when the rank is on a middle pipeline stage.
std::optional<GroupSpec> embedding_group(const GridLayout& layout, int rank);

// The whole world, "world".
GroupSpec world_group(const GridLayout& layout, int rank);

// One Communicator per group of this rank.
struct ProcessGroups {
  GridLayout layout;
  GridCoord coord;
  std::unique_ptr<Communicator> world;
  std::unique_ptr<Communicator> tp;
  std::unique_ptr<Communicator> dp;
  std::unique_ptr<Communicator> pp;
  std::unique_ptr<Communicator> embed;  // null on middle pipeline stages
  // A second communicator over the dp group's members ("dpgrad.<i>"), for the gradient
  // all-reduce that a background thread overlaps with backward while the main thread keeps
  // using `dp`. Null when dp == 1.
  std::unique_ptr<Communicator> dp_grad;

  // Communicator::abort on every communicator held (null ones skipped): after one group failed,
  // breaks all the others too, so that peers blocked on this process in any group fail fast and
  // no pending Request of any group blocks. Safe to call from any thread while other threads use
  // the communicators (e.g. dp_grad's background all-reduce); never throws.
  void abort(const std::string& reason) noexcept;
};

// Connects all groups of `world_rank` (world, tp, dp, pp, embed, dp_grad, in that order on every
// rank, so the sequence of blocking rendezvous cannot deadlock). Throws ConfigError when world_size
// does not equal layout.world_size(), plus whatever Communicator::connect throws.
//
// store.abort_signal (store.h), when set, is passed to every group's connect: firing it from
// another thread ends the connect in progress with PeerLostError (the groups connected before it
// are aborted and released as the error leaves), and once this returned it breaks every group as
// ProcessGroups::abort does. One call thus stops a world, connecting or connected.
//
// store.secret (store.h), when set, is passed to every group's connect too: each group's pairs
// prove membership (pair_handshake.h), and a foreign process fails the first group it joins.
ProcessGroups connect_process_groups(const StoreOptions& store, const GridLayout& layout,
                                     int world_rank, int world_size,
                                     std::chrono::milliseconds timeout = kDefaultTimeout,
                                     const TransportOptions& transport = {});

}  // namespace tessel::comm
