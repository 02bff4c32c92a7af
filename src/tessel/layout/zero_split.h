// ZeRO-1: how a flat buffer of optimizer state is split over the data-parallel ranks.
//
// One definition for the state layout (which rank's checkpoint and transfers hold which range)
// and the runtime (which range a rank updates, and the counts of its reduce-scatter and
// all-gather): the two must agree element for element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessel::layout {

// A buffer of n elements split over dp ranks, contiguous and as even as possible: the first
// n % dp ranks own one element more (reduce_scatter_sum / all_gather_v take uneven counts, so
// nothing is padded). Rank r owns [lo, lo + n_own); counts[i] is rank i's share.
struct ZeroSplit {
  std::vector<size_t> counts;
  int64_t lo = 0, n_own = 0;
};
ZeroSplit zero_split(int64_t n, int64_t dp, int64_t r);

}  // namespace tessel::layout
