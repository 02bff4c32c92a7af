// StridedRegion: a box of elements inside a flat buffer.
//
// The element with multi-index i (0 <= i[d] < extents[d]) lies at
//   offset + sum_d i[d] * strides[d]
// elements from the start of the buffer. A region says nothing about the element type: the copy
// functions (box_copy.h) take the element size in bytes, so float state, a checkpoint's bf16
// bytes and packed staging buffers all use the same regions. The "packed order" of a region is
// row-major over its multi-index (the last index fastest).
//
// Regions come from boxes (of_box: a box of a dense row-major array that holds some other box of
// the same tensor, e.g. a shard), from dense() for a packed staging buffer, or are written out
// directly (a piece of training state inside a flat buffer: layout/state_layout.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessel/tensor/box.h"
#include "tessel/tensor/shape.h"

namespace tessel {

struct StridedRegion {
  int64_t offset = 0;
  std::vector<int64_t> strides;
  std::vector<int64_t> extents;

  // `box` inside a dense row-major array that holds the box `frame` of the same index space (a
  // shard, a stored piece). Throws InvalidArgumentError when the ranks differ or `frame` does not
  // contain `box` (an empty box is contained in any frame of its rank).
  static StridedRegion of_box(const Box& box, const Box& frame);
  // `box` inside a dense row-major array of `shape`: of_box(box, Box::of(shape)).
  static StridedRegion of_box(const Box& box, const Shape& shape);
  // A whole dense row-major array of `shape` at offset 0 (a packed staging buffer).
  static StridedRegion dense(const Shape& shape);

  size_t rank() const { return extents.size(); }
  // Product of the extents (1 for rank 0, 0 when an extent is <= 0).
  int64_t numel() const;
  bool empty() const { return numel() == 0; }
  // Flat index of the last element + 1 (offset for an empty region): a buffer holding the region
  // has at least this many elements (strides are >= 0).
  int64_t end() const;
  // Whether the elements are numel() consecutive ones from `offset`, in packed order (dimensions
  // of extent 1 do not matter; an empty region is contiguous).
  bool contiguous() const;
  // "offset 7, strides [12, 1], extents [3, 4]"
  std::string str() const;

  bool operator==(const StridedRegion&) const = default;
};

// Throws InvalidArgumentError unless `r` is well formed (as many strides as extents, offset and
// strides >= 0) and lies inside a buffer of `size` elements. `what` names the buffer in the
// message ("source", "destination", ...).
void check_region_inside(const StridedRegion& r, int64_t size, const char* what);

}  // namespace tessel
