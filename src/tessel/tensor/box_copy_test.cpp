#include "tessel/tensor/box_copy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/tensor/region_test_util.h"

namespace tessel {
namespace {

using test_util::naive_copy;
using test_util::random_region;
using test_util::region_offsets;

std::vector<std::byte> random_bytes(size_t n, std::mt19937& rng) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(rng() & 0xff);
  return v;
}

TEST(BoxCopy, MatchesElementwiseCopyOnRandomBoxes) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    int rank = 1 + trial % 4;
    std::vector<int64_t> sdims(rank), ddims(rank), lo(rank), hi(rank), dlo(rank);
    for (int d = 0; d < rank; ++d) {
      sdims[d] = 1 + rng() % 6;
      lo[d] = rng() % sdims[d];
      hi[d] = lo[d] + rng() % (sdims[d] - lo[d] + 1);
      ddims[d] = (hi[d] - lo[d]) + rng() % 3;
      dlo[d] = rng() % (ddims[d] - (hi[d] - lo[d]) + 1);
    }
    Shape ss(sdims), ds(ddims);
    Box box(lo, hi);
    std::vector<int32_t> src(ss.numel()), dst(ds.numel(), -1), expect(ds.numel(), -1);
    std::iota(src.begin(), src.end(), 0);
    // Expected result by visiting every destination index.
    auto sst = ss.strides(), dst_strides = ds.strides();
    for (int64_t flat = 0; flat < box.volume(); ++flat) {
      int64_t rem = flat, so = 0, doff = 0;
      for (int d = rank - 1; d >= 0; --d) {
        int64_t i = rem % box.extent(d);
        rem /= box.extent(d);
        so += (lo[d] + i) * sst[d];
        doff += (dlo[d] + i) * dst_strides[d];
      }
      expect[doff] = src[so];
    }
    copy_box(src.data(), ss, box, dst.data(), ds, dlo, sizeof(int32_t));
    ASSERT_EQ(dst, expect) << "trial " << trial << " box " << box.str();
  }
}

TEST(BoxCopy, PackUnpackRoundTrip) {
  Tensor t = Tensor::empty({5, 7, 3});
  auto s = t.span<float>();
  std::iota(s.begin(), s.end(), 0.0f);
  Box box({1, 2, 0}, {4, 6, 2});
  std::vector<float> packed(box.volume());
  pack_box(t.raw(), t.shape(), box, packed.data(), 4);
  EXPECT_EQ(packed[0], s[1 * 21 + 2 * 3 + 0]);
  Tensor u = Tensor::zeros({5, 7, 3});
  unpack_box(packed.data(), box, u.raw(), u.shape(), 4);
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 7; ++j)
      for (int64_t k = 0; k < 3; ++k) {
        float want = box.contains_point({i, j, k}) ? s[i * 21 + j * 3 + k] : 0.0f;
        ASSERT_EQ(u.data<float>()[i * 21 + j * 3 + k], want);
      }
}

TEST(BoxCopy, RejectsBoxesOutsideArrays) {
  std::vector<float> a(12), b(12);
  EXPECT_THROW(
      copy_box(a.data(), Shape{3, 4}, Box({0, 0}, {4, 4}), b.data(), Shape{3, 4}, {0, 0}, 4),
      InvalidArgumentError);
  EXPECT_THROW(
      copy_box(a.data(), Shape{3, 4}, Box({0, 0}, {2, 2}), b.data(), Shape{3, 4}, {2, 0}, 4),
      InvalidArgumentError);
  EXPECT_THROW(copy_box(a.data(), Shape{3, 4}, Box({0}, {2}), b.data(), Shape{3, 4}, {0, 0}, 4),
               InvalidArgumentError);
  Tensor t = Tensor::zeros({2, 2});
  Tensor i = Tensor::zeros({2, 2}, DType::i32);
  EXPECT_THROW(copy_box(t, Box::of(t.shape()), i, {0, 0}), InvalidArgumentError);
}

TEST(BoxCopy, EmptyAndScalarBoxes) {
  std::vector<float> a(12, 1.0f), b(12, -1.0f);
  // An empty box copies nothing, wherever it sits.
  copy_box(a.data(), Shape{3, 4}, Box({3, 1}, {3, 4}), b.data(), Shape{3, 4}, {3, 4}, 4);
  EXPECT_EQ(std::count(b.begin(), b.end(), -1.0f), 12);
  float x = 5.0f, y = 0.0f;
  copy_box(&x, Shape{}, Box::of(Shape{}), &y, Shape{}, {}, sizeof(float));
  EXPECT_EQ(y, 5.0f);
}

// The regions of the former layout::StridedRegion tests: gather, scatter and copy_region of
// strided regions with offsets, the innermost stride 1 or not.
TEST(RegionCopy, GatherScatterRoundTrip) {
  std::vector<float> buf(80);
  std::iota(buf.begin(), buf.end(), 0.0f);
  const std::span<const float> cbuf(buf);
  StridedRegion r{7, {12, 1}, {3, 4}};  // rows 0..2, columns 7..10 of a [5, 12] array
  EXPECT_EQ(r.numel(), 12);
  EXPECT_EQ(r.end(), 7 + 2 * 12 + 3 + 1);
  std::vector<float> packed(12);
  gather(cbuf, r, std::span(packed));
  EXPECT_EQ(packed[0], 7.0f);
  EXPECT_EQ(packed[4], 19.0f);
  EXPECT_EQ(packed[11], 34.0f);
  std::vector<float> out(80, -1.0f);
  scatter(std::span<const float>(packed), r, std::span(out));
  for (int64_t f : region_offsets(r)) EXPECT_EQ(out[size_t(f)], buf[size_t(f)]);
  EXPECT_EQ(std::count(out.begin(), out.end(), -1.0f), 80 - 12);
  StridedRegion col{3, {12, 4}, {2, 3}};  // non-unit innermost stride
  std::vector<float> p2(6);
  gather(cbuf, col, std::span(p2));
  EXPECT_EQ(p2, (std::vector<float>{3, 7, 11, 15, 19, 23}));

  // copy_region == gather then scatter, for regions of rank 0 to 3 and any strides.
  const std::vector<std::pair<StridedRegion, StridedRegion>> pairs = {
      {{5, {}, {}}, {9, {}, {}}},
      {{2, {1}, {7}}, {40, {1}, {7}}},
      {{7, {12, 1}, {3, 4}}, {1, {5, 1}, {3, 4}}},
      {{3, {12, 4}, {2, 3}}, {0, {1, 2}, {2, 3}}},
      {{0, {20, 5, 1}, {2, 3, 4}}, {30, {12, 4, 1}, {2, 3, 4}}},
  };
  for (const auto& [from, to] : pairs) {
    std::vector<float> want(80, -1.0f), got(80, -1.0f), staged(size_t(from.numel()));
    gather(cbuf, from, std::span(staged));
    scatter(std::span<const float>(staged), to, std::span(want));
    copy_region(cbuf, from, std::span(got), to);
    EXPECT_EQ(got, want) << to.offset;
  }
  EXPECT_THROW(copy_region(cbuf, r, std::span(out), col), InvalidArgumentError);
}

// Every copy against the naive element-by-element loop: random extents of rank 1 to 4 (zero
// extents included), regions at random places of padded buffers, the innermost stride 1 or not,
// elements of 1, 2, 4, 8 and 12 bytes.
TEST(RegionCopy, MatchesTheNaiveLoopOnRandomRegions) {
  std::mt19937 rng(11);
  const size_t elem_sizes[] = {1, 2, 4, 8, 12};
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t rank = 1 + size_t(trial) % 4;
    std::vector<int64_t> extents(rank);
    for (auto& e : extents) e = int64_t(rng() % 5) + (rng() % 16 == 0 ? -1 : 0);
    for (auto& e : extents) e = std::max<int64_t>(e, 0);
    const size_t es = elem_sizes[rng() % 5];
    int64_t sn = 0, dn = 0;
    const StridedRegion from = random_region(extents, rng, sn, rng() % 4 != 0);
    const StridedRegion to = random_region(extents, rng, dn, rng() % 4 != 0);
    const auto src = random_bytes(size_t(sn) * es, rng);
    const auto init = random_bytes(size_t(dn) * es, rng);
    auto want = init, got = init;
    naive_copy(src.data(), from, want.data(), to, es);
    copy_region(std::span(src), from, std::span(got), to, es);
    ASSERT_EQ(got, want) << "trial " << trial << ": " << from.str() << " -> " << to.str();

    // gather and scatter are the copies to and from a packed buffer.
    const StridedRegion packed = StridedRegion::dense(Shape(extents));
    std::vector<std::byte> p_want(size_t(from.numel()) * es), p_got(p_want.size());
    naive_copy(src.data(), from, p_want.data(), packed, es);
    gather(std::span(src), from, std::span(p_got), es);
    ASSERT_EQ(p_got, p_want) << "trial " << trial;
    auto s_want = init, s_got = init;
    naive_copy(p_want.data(), packed, s_want.data(), to, es);
    scatter(std::span<const std::byte>(p_want), to, std::span(s_got), es);
    ASSERT_EQ(s_got, s_want) << "trial " << trial;
  }
}

TEST(RegionCopy, WholeAndContiguousRegionsCopyAsOneBlock) {
  // A whole [2, 3, 4] array into the middle of a longer buffer: one memcpy's worth.
  std::vector<int16_t> src(24), dst(40, -1);
  std::iota(src.begin(), src.end(), int16_t(0));
  const StridedRegion whole = StridedRegion::of_box(Box::of(Shape{2, 3, 4}), Shape{2, 3, 4});
  copy_region(std::span<const int16_t>(src), whole, std::span(dst),
              StridedRegion{10, {12, 4, 1}, {2, 3, 4}});
  EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin() + 10));
  EXPECT_EQ(std::count(dst.begin(), dst.end(), int16_t(-1)), 16);
}

TEST(RegionCopy, RejectsRegionsOutsideTheirBuffers) {
  std::vector<float> a(20), b(20);
  const std::span<const float> ca(a);
  const StridedRegion r{7, {5, 1}, {3, 3}};  // last element 7 + 10 + 2 = 19: fits exactly
  copy_region(ca, r, std::span(b), r);
  const StridedRegion past{8, {5, 1}, {3, 3}};
  EXPECT_THROW(copy_region(ca, past, std::span(b), r), InvalidArgumentError);
  EXPECT_THROW(copy_region(ca, r, std::span(b), past), InvalidArgumentError);
  EXPECT_THROW(copy_region(ca.first(19), r, std::span(b), r), InvalidArgumentError);
  std::vector<float> small(8);
  EXPECT_THROW(gather(ca, r, std::span(small)), InvalidArgumentError);  // packed side: 9 needed
  EXPECT_THROW(scatter(std::span<const float>(small), r, std::span(b)), InvalidArgumentError);
  EXPECT_THROW(
      copy_region(ca, StridedRegion{-1, {1}, {3}}, std::span(b), StridedRegion{0, {1}, {3}}),
      InvalidArgumentError);
  EXPECT_THROW(
      copy_region(ca, StridedRegion{4, {-1}, {3}}, std::span(b), StridedRegion{0, {1}, {3}}),
      InvalidArgumentError);
  EXPECT_THROW(copy_region(ca, StridedRegion{0, {1}, {3, 1}}, std::span(b),
                           StridedRegion{0, {1, 1}, {3, 1}}),
               InvalidArgumentError);  // strides do not match the extents
  // An empty region lies in any buffer.
  copy_region(ca, StridedRegion{100, {5, 1}, {0, 3}}, std::span(b),
              StridedRegion{50, {1, 1}, {0, 3}});
}

// Decision: overlapping source and destination are refused (memcpy's runs would read what they
// have already written). The test is on the byte ranges from each region's first to its last
// element, so regions that interleave without sharing an element are refused too.
TEST(RegionCopy, RefusesOverlappingSourceAndDestination) {
  std::vector<float> buf(40);
  std::iota(buf.begin(), buf.end(), 0.0f);
  const std::span<const float> src(buf);
  const std::span<float> dst(buf);
  // Shifted by two: overlapping.
  EXPECT_THROW(copy_region(src, StridedRegion{0, {1}, {10}}, dst, StridedRegion{2, {1}, {10}}),
               InvalidArgumentError);
  // The same elements.
  EXPECT_THROW(copy_region(src, StridedRegion{5, {1}, {4}}, dst, StridedRegion{5, {1}, {4}}),
               InvalidArgumentError);
  // Columns 0..1 and 2..3 of a [5, 4] array: no common element, but interleaved.
  EXPECT_THROW(
      copy_region(src, StridedRegion{0, {4, 1}, {5, 2}}, dst, StridedRegion{2, {4, 1}, {5, 2}}),
      InvalidArgumentError);
  // gather into the buffer it reads.
  EXPECT_THROW(gather(src, StridedRegion{3, {1}, {4}}, dst.subspan(4)), InvalidArgumentError);
  // Disjoint ranges of one buffer are fine: elements 0..9 to 20..29.
  copy_region(src, StridedRegion{0, {1}, {10}}, dst, StridedRegion{20, {1}, {10}});
  for (int i = 0; i < 10; ++i) EXPECT_EQ(buf[size_t(20 + i)], float(i));
  // So are ranges that touch without sharing a byte, and empty regions anywhere.
  copy_region(src, StridedRegion{0, {1}, {10}}, dst, StridedRegion{10, {1}, {10}});
  copy_region(src, StridedRegion{0, {1}, {0}}, dst, StridedRegion{0, {1}, {0}});
}

}  // namespace
}  // namespace tessel
