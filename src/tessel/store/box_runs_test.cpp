#include "tessel/store/box_runs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "tessel/core/error.h"

namespace tessel::store {
namespace {

Box random_box_inside(const Box& outer, std::mt19937& rng) {
  std::vector<int64_t> lo(outer.rank()), hi(outer.rank());
  for (size_t d = 0; d < outer.rank(); ++d) {
    std::uniform_int_distribution<int64_t> u(outer.lo(d), outer.hi(d));
    int64_t a = u(rng), b = u(rng);
    lo[d] = std::min(a, b);
    hi[d] = std::max(a, b);
  }
  return Box(lo, hi);
}

// Element (as a flat index of the logical tensor) at each position of an array over `frame`.
std::vector<int64_t> fill_frame(const Box& frame, const Shape& logical) {
  std::vector<int64_t> out(size_t(frame.volume()));
  auto strides = logical.strides();
  std::vector<int64_t> idx(frame.lo());
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t flat = 0;
    for (size_t d = 0; d < idx.size(); ++d) flat += idx[d] * strides[d];
    out[i] = flat;
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < frame.hi(d)) break;
      idx[d] = frame.lo(d);
    }
  }
  return out;
}

TEST(BoxRuns, CopyingTheRunsMovesExactlyTheRegion) {
  std::mt19937 rng(7);
  const Shape logical{5, 6, 7};
  for (int trial = 0; trial < 300; ++trial) {
    const Box src = random_box_inside(Box::of(logical), rng);
    const Box dst = random_box_inside(Box::of(logical), rng);
    const Box region = random_box_inside(src.intersect(dst), rng);
    const auto src_data = fill_frame(src, logical);
    std::vector<int64_t> out(size_t(dst.volume()), -1);
    const auto runs = box_runs(region, src, dst, sizeof(int64_t));
    for (size_t i = 0; i < runs.size(); ++i) {
      if (i > 0) {
        EXPECT_GT(runs[i].src, runs[i - 1].src);
        EXPECT_GT(runs[i].dst, runs[i - 1].dst);
        // Maximal: a run that continues the previous one on both sides would have merged.
        EXPECT_FALSE(runs[i - 1].src + runs[i - 1].len == runs[i].src &&
                     runs[i - 1].dst + runs[i - 1].len == runs[i].dst);
      }
      std::memcpy(reinterpret_cast<char*>(out.data()) + runs[i].dst,
                  reinterpret_cast<const char*>(src_data.data()) + runs[i].src, runs[i].len);
    }
    // Expected: the region's elements at their places in dst, -1 elsewhere.
    const auto dst_ids = fill_frame(dst, logical);
    const auto region_ids = fill_frame(region, logical);
    std::vector<int64_t> expect(size_t(dst.volume()), -1);
    for (size_t i = 0; i < dst_ids.size(); ++i)
      if (std::find(region_ids.begin(), region_ids.end(), dst_ids[i]) != region_ids.end())
        expect[i] = dst_ids[i];
    ASSERT_EQ(out, expect) << "region " << region.str() << " src " << src.str() << " dst "
                           << dst.str();
  }
}

TEST(BoxRuns, WholeFramesAreOneRun) {
  const Box b({1, 0, 0}, {3, 4, 5});
  auto runs = box_runs(b, b, b, 2);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0], (ByteRun{0, 0, 2 * 4 * 5 * 2}));
  // Rows of a column slice stay separate runs.
  EXPECT_EQ(box_runs(Box({0, 1}, {3, 2}), Box({0, 0}, {3, 4}), Box({0, 1}, {3, 2}), 4).size(), 3u);
  EXPECT_TRUE(box_runs(Box({1, 1, 0}, {1, 2, 3}), b, b, 4).empty());
  EXPECT_EQ(box_runs(Box({}, {}), Box({}, {}), Box({}, {}), 8).size(), 1u);  // scalar
  EXPECT_THROW(box_runs(Box({0}, {5}), Box({0}, {4}), Box({0}, {5}), 4), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::store
