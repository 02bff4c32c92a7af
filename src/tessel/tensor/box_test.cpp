#include "tessel/tensor/box.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "tessel/core/error.h"
#include "tessel/tensor/box_copy.h"

namespace tessel {
namespace {

TEST(Box, VolumeIntersectContains) {
  Box a({0, 0}, {4, 6});
  Box b({2, 3}, {8, 5});
  EXPECT_EQ(a.volume(), 24);
  Box c = a.intersect(b);
  EXPECT_EQ(c, Box({2, 3}, {4, 5}));
  EXPECT_EQ(c.volume(), 4);
  EXPECT_TRUE(a.contains(c));
  EXPECT_FALSE(c.contains(a));
  Box disjoint = a.intersect(Box({5, 0}, {6, 6}));
  EXPECT_TRUE(disjoint.empty());
  EXPECT_TRUE(c.contains(disjoint));
  EXPECT_TRUE(a.contains_point({3, 5}));
  EXPECT_FALSE(a.contains_point({4, 0}));
  EXPECT_EQ(c.translate({-2, -3}), Box({0, 0}, {2, 2}));
  EXPECT_EQ(c.relative_to(b), Box({0, 0}, {2, 2}));
  EXPECT_EQ(c.str(), "[2:4, 3:5]");
  EXPECT_THROW(Box({0}, {1, 2}), InvalidArgumentError);
}

TEST(Box, ScalarBoxHasVolumeOne) {
  Box s = Box::of(Shape{});
  EXPECT_EQ(s.volume(), 1);
  EXPECT_FALSE(s.empty());
}

TEST(Box, Parse) {
  Shape shape{1024, 768};
  EXPECT_EQ(Box::parse("0:512,:", shape), Box({0, 0}, {512, 768}));
  EXPECT_EQ(Box::parse(":", shape), Box({0, 0}, {1024, 768}));
  EXPECT_EQ(Box::parse("", shape), Box::of(shape));
  EXPECT_EQ(Box::parse("3, 10:", shape), Box({3, 10}, {4, 768}));
  EXPECT_EQ(Box::parse("-2:", shape), Box({1022, 0}, {1024, 768}));
  EXPECT_THROW(Box::parse("0:2000,:", shape), InvalidArgumentError);
  EXPECT_THROW(Box::parse("5:1", shape), InvalidArgumentError);
  EXPECT_THROW(Box::parse("a:b", shape), InvalidArgumentError);
  EXPECT_THROW(Box::parse("0:1,0:1,0:1", shape), InvalidArgumentError);
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
}

}  // namespace
}  // namespace tessel
