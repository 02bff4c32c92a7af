#include "tessel/tensor/box.h"

#include <gtest/gtest.h>

#include "tessel/core/error.h"

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

}  // namespace
}  // namespace tessel
