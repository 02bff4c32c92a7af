#include "tessel/tensor/region_runs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/tensor/region_test_util.h"

namespace tessel {
namespace {

using test_util::naive_copy;
using test_util::random_region;

struct ElemRun {
  int64_t src, dst, len;
  bool operator==(const ElemRun&) const = default;
};

std::vector<ElemRun> runs_of(const StridedRegion& src, const StridedRegion& dst) {
  std::vector<ElemRun> out;
  for_each_run(src, dst, [&](int64_t s, int64_t d, int64_t n) { out.push_back({s, d, n}); });
  return out;
}

// The runs of moving `region` (tensor coordinates) from an array holding the box `src` to one
// holding the box `dst`, in bytes (what the store's piece reads use).
std::vector<ByteRun> box_runs(const Box& region, const Box& src, const Box& dst, size_t elem_size) {
  return byte_runs(StridedRegion::of_box(region, src), StridedRegion::of_box(region, dst),
                   elem_size);
}

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

// (The store's former box_runs tests, on the engine it now uses.)
TEST(RegionRuns, CopyingTheRunsOfABoxMovesExactlyTheBox) {
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

TEST(RegionRuns, WholeFramesAreOneRun) {
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

TEST(RegionRuns, WholeTensorsAreOneRunInEveryRank) {
  const std::vector<Shape> shapes = {Shape{7}, Shape{3, 5}, Shape{2, 3, 4}, Shape{2, 1, 3, 4}};
  for (const Shape& s : shapes) {
    const StridedRegion whole = StridedRegion::of_box(Box::of(s), s);
    EXPECT_TRUE(whole.contiguous());
    EXPECT_EQ(runs_of(whole, whole), (std::vector<ElemRun>{{0, 0, s.numel()}})) << s.str();
    // Also into a contiguous stretch in the middle of another buffer (the fully-contiguous
    // fast path: one run whatever the strides say about the dimensions).
    StridedRegion shifted = whole;
    shifted.offset = 9;
    EXPECT_EQ(runs_of(whole, shifted), (std::vector<ElemRun>{{0, 9, s.numel()}})) << s.str();
  }
}

TEST(RegionRuns, RowsMergeWhenContiguousOnBothSides) {
  // Rows 1..3 of a [4, 6] array to rows 0..2 of a [3, 6] array: whole rows on both sides.
  const Box rows({1, 0}, {4, 6});
  EXPECT_EQ(runs_of(StridedRegion::of_box(rows, Shape{4, 6}),
                    StridedRegion::of_box(rows, Box({1, 0}, {4, 6}))),
            (std::vector<ElemRun>{{6, 0, 18}}));
  // Whole rows in the source but padded rows in the destination: one run per row.
  EXPECT_EQ(runs_of(StridedRegion::of_box(rows, Shape{4, 6}), StridedRegion{0, {8, 1}, {3, 6}}),
            (std::vector<ElemRun>{{6, 0, 6}, {12, 8, 6}, {18, 16, 6}}));
  // A middle dimension spanned whole merges with the innermost: [2, 3, 4] box [0:2, 1:3, 0:4]
  // is one run of 8 per outer index.
  const Shape s{2, 3, 4};
  const StridedRegion mid = StridedRegion::of_box(Box({0, 1, 0}, {2, 3, 4}), s);
  EXPECT_EQ(runs_of(mid, StridedRegion::dense(Shape{2, 2, 4})),
            (std::vector<ElemRun>{{4, 0, 8}, {16, 8, 8}}));
  // Outer dimensions merge too: whole [2, 3] planes of [2, 3, 4] at columns 0..1 are 6 runs,
  // the row and plane dimensions acting as one.
  const StridedRegion cols = StridedRegion::of_box(Box({0, 0, 0}, {2, 3, 2}), s);
  EXPECT_EQ(runs_of(cols, StridedRegion::dense(Shape{2, 3, 2})).size(), 6u);
  // Extent-1 dimensions do not break a run.
  EXPECT_EQ(
      runs_of(StridedRegion{5, {100, 7, 1}, {1, 1, 7}}, StridedRegion{0, {3, 9, 1}, {1, 1, 7}}),
      (std::vector<ElemRun>{{5, 0, 7}}));
}

TEST(RegionRuns, EmptyScalarAndStridedRegions) {
  int calls = 0;
  auto count = [&](int64_t, int64_t, int64_t) { ++calls; };
  // Zero extents, in any dimension: no run.
  for_each_run(StridedRegion{3, {4, 1}, {0, 4}}, StridedRegion{0, {4, 1}, {0, 4}}, count);
  for_each_run(StridedRegion{3, {4, 1}, {2, 0}}, StridedRegion{0, {4, 1}, {2, 0}}, count);
  for_each_run(StridedRegion{0, {12, 4, 1}, {2, 0, 4}}, StridedRegion{0, {12, 4, 1}, {2, 0, 4}},
               count);
  EXPECT_EQ(calls, 0);
  EXPECT_TRUE(byte_runs(StridedRegion{0, {1}, {0}}, StridedRegion{0, {1}, {0}}, 4).empty());
  // Rank 0: one element.
  EXPECT_EQ(runs_of(StridedRegion{5, {}, {}}, StridedRegion{9, {}, {}}),
            (std::vector<ElemRun>{{5, 9, 1}}));
  // A non-unit innermost stride on either side: element by element.
  EXPECT_EQ(runs_of(StridedRegion{3, {12, 4}, {2, 3}}, StridedRegion{0, {3, 1}, {2, 3}}).size(),
            6u);
  EXPECT_EQ(
      runs_of(StridedRegion{0, {3, 1}, {2, 3}}, StridedRegion{0, {1, 2}, {2, 3}}),
      (std::vector<ElemRun>{{0, 0, 1}, {1, 2, 1}, {2, 4, 1}, {3, 1, 1}, {4, 3, 1}, {5, 5, 1}}));
  // Extents must match.
  EXPECT_THROW(for_each_run(StridedRegion{0, {1}, {3}}, StridedRegion{0, {1}, {4}}, count),
               InvalidArgumentError);
  EXPECT_THROW(for_each_run(StridedRegion{0, {1}, {3}}, StridedRegion{0, {}, {3}}, count),
               InvalidArgumentError);
  EXPECT_THROW(byte_runs(StridedRegion{-2, {1}, {3}}, StridedRegion{0, {1}, {3}}, 4),
               InvalidArgumentError);
}

// The runs move exactly the naive loop's elements, cover each element once in packed order, and
// are maximal, for random regions of rank 1 to 4.
TEST(RegionRuns, MatchTheNaiveLoopOnRandomRegions) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t rank = 1 + size_t(trial) % 4;
    std::vector<int64_t> extents(rank);
    for (auto& e : extents) e = int64_t(rng() % 5);
    int64_t sn = 0, dn = 0;
    const StridedRegion from = random_region(extents, rng, sn, rng() % 4 != 0);
    const StridedRegion to = random_region(extents, rng, dn, rng() % 4 != 0);
    std::vector<int32_t> src(static_cast<size_t>(sn));
    for (auto& v : src) v = int32_t(rng());
    std::vector<int32_t> want(size_t(dn), -1), got(size_t(dn), -1);
    naive_copy(reinterpret_cast<const std::byte*>(src.data()), from,
               reinterpret_cast<std::byte*>(want.data()), to, sizeof(int32_t));
    const auto runs = runs_of(from, to);
    int64_t total = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
      const ElemRun& r = runs[i];
      ASSERT_GT(r.len, 0);
      ASSERT_TRUE(r.src >= 0 && r.src + r.len <= sn && r.dst >= 0 && r.dst + r.len <= dn);
      if (i > 0) {
        const ElemRun& p = runs[i - 1];
        EXPECT_FALSE(p.src + p.len == r.src && p.dst + p.len == r.dst) << "trial " << trial;
      }
      std::copy_n(src.begin() + r.src, r.len, got.begin() + r.dst);
      total += r.len;
    }
    EXPECT_EQ(total, from.numel());
    ASSERT_EQ(got, want) << "trial " << trial << ": " << from.str() << " -> " << to.str();
    // byte_runs are the same runs, in bytes.
    const auto bytes = byte_runs(from, to, 4);
    ASSERT_EQ(bytes.size(), runs.size());
    for (size_t i = 0; i < runs.size(); ++i)
      EXPECT_EQ(bytes[i], (ByteRun{uint64_t(runs[i].src) * 4, uint64_t(runs[i].dst) * 4,
                                   uint64_t(runs[i].len) * 4}));
  }
}

}  // namespace
}  // namespace tessel
