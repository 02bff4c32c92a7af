#include "tessel/tensor/strided_region.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/tensor/region_test_util.h"

namespace tessel {
namespace {

using test_util::region_offsets;

TEST(StridedRegion, OfBoxInAnArray) {
  // Rows 1..2, columns 3..5 of a [4, 6] array.
  const StridedRegion r = StridedRegion::of_box(Box({1, 3}, {3, 6}), Shape{4, 6});
  EXPECT_EQ(r, (StridedRegion{9, {6, 1}, {2, 3}}));
  EXPECT_EQ(region_offsets(r), (std::vector<int64_t>{9, 10, 11, 15, 16, 17}));
  // The same box inside an array holding only rows 1..3 of that tensor.
  EXPECT_EQ(StridedRegion::of_box(Box({1, 3}, {3, 6}), Box({1, 0}, {4, 6})),
            (StridedRegion{3, {6, 1}, {2, 3}}));
  // 1-d to 4-d: the offset of the box's first element, the array's row-major strides.
  EXPECT_EQ(StridedRegion::of_box(Box({2}, {5}), Shape{9}), (StridedRegion{2, {1}, {3}}));
  EXPECT_EQ(StridedRegion::of_box(Box({1, 0, 2}, {2, 3, 4}), Shape{2, 3, 4}),
            (StridedRegion{14, {12, 4, 1}, {1, 3, 2}}));
  EXPECT_EQ(StridedRegion::of_box(Box({0, 1, 1, 0}, {2, 2, 3, 5}), Box({0, 0, 1, 0}, {2, 3, 3, 5})),
            (StridedRegion{10, {30, 10, 5, 1}, {2, 1, 2, 5}}));
  // Rank 0: the one element.
  EXPECT_EQ(StridedRegion::of_box(Box::of(Shape{}), Shape{}), (StridedRegion{0, {}, {}}));
  // An empty box anywhere in the frame (or at its end): no elements, offset 0.
  const StridedRegion e = StridedRegion::of_box(Box({4, 0}, {4, 6}), Shape{4, 6});
  EXPECT_TRUE(e.empty());
  EXPECT_EQ(e.offset, 0);
  EXPECT_EQ(e.end(), 0);
  // Outside the frame, or of another rank.
  EXPECT_THROW(StridedRegion::of_box(Box({0, 0}, {5, 6}), Shape{4, 6}), InvalidArgumentError);
  EXPECT_THROW(StridedRegion::of_box(Box({0, 0}, {2, 2}), Box({1, 0}, {4, 6})),
               InvalidArgumentError);
  EXPECT_THROW(StridedRegion::of_box(Box({0}, {2}), Shape{4, 6}), InvalidArgumentError);
}

TEST(StridedRegion, DenseNumelEndContiguous) {
  EXPECT_EQ(StridedRegion::dense(Shape{2, 3, 4}), (StridedRegion{0, {12, 4, 1}, {2, 3, 4}}));
  const StridedRegion r{7, {12, 1}, {3, 4}};
  EXPECT_EQ(r.numel(), 12);
  EXPECT_EQ(r.end(), 7 + 2 * 12 + 3 + 1);
  EXPECT_FALSE(r.contiguous());
  EXPECT_EQ(r.str(), "offset 7, strides [12, 1], extents [3, 4]");
  EXPECT_TRUE((StridedRegion{7, {4, 1}, {3, 4}}).contiguous());   // whole rows
  EXPECT_TRUE((StridedRegion{7, {12, 1}, {1, 4}}).contiguous());  // one row
  EXPECT_TRUE((StridedRegion{7, {100, 4, 1}, {1, 2, 4}}).contiguous());
  EXPECT_FALSE((StridedRegion{7, {12, 2}, {1, 4}}).contiguous());  // every other element
  EXPECT_TRUE((StridedRegion{7, {12, 2}, {1, 1}}).contiguous());   // one element
  EXPECT_TRUE((StridedRegion{7, {12, 2}, {0, 4}}).contiguous());   // empty
  EXPECT_TRUE((StridedRegion{3, {}, {}}).contiguous());
  EXPECT_EQ((StridedRegion{3, {}, {}}).numel(), 1);
  EXPECT_EQ((StridedRegion{3, {}, {}}).end(), 4);
  EXPECT_EQ((StridedRegion{3, {4, 1}, {2, -1}}).numel(), 0);
}

TEST(StridedRegion, CheckInside) {
  const StridedRegion r{7, {12, 1}, {3, 4}};  // reaches element 34
  check_region_inside(r, 35, "test");
  EXPECT_THROW(check_region_inside(r, 34, "test"), InvalidArgumentError);
  EXPECT_THROW(check_region_inside(StridedRegion{-1, {1}, {2}}, 10, "test"), InvalidArgumentError);
  EXPECT_THROW(check_region_inside(StridedRegion{5, {-1}, {2}}, 10, "test"), InvalidArgumentError);
  EXPECT_THROW(check_region_inside(StridedRegion{0, {1}, {2, 2}}, 10, "test"),
               InvalidArgumentError);
  check_region_inside(StridedRegion{1000, {1}, {0}}, 10, "test");  // empty: fits anywhere
  try {
    check_region_inside(r, 20, "old buffer");
    ADD_FAILURE();
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("old buffer region (offset 7"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tessel
