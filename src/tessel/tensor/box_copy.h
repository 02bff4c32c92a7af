// Copying boxes of elements between dense row-major arrays.
//
// These are the primitive of all re-partitioning: a shard is a box of a logical tensor, and moving
// state between layouts copies boxes, directly or through a packed contiguous buffer.
#pragma once

#include <cstddef>
#include <vector>

#include "tessel/tensor/box.h"
#include "tessel/tensor/tensor.h"

namespace tessel {

// Copies the elements of `src_box` (in src's index space) of an array of shape `src_shape` into
// the array of shape `dst_shape`, at the box of equal extent starting at `dst_lo`. Both arrays
// hold elements of `elem_size` bytes. Throws InvalidArgumentError when a box leaves its array.
void copy_box(const void* src, const Shape& src_shape, const Box& src_box, void* dst,
              const Shape& dst_shape, const std::vector<int64_t>& dst_lo, size_t elem_size);

// Tensor form: dtypes must match.
void copy_box(const Tensor& src, const Box& src_box, Tensor& dst,
              const std::vector<int64_t>& dst_lo);

// Packs the box into a contiguous row-major buffer of box.volume() elements, and back.
void pack_box(const void* src, const Shape& src_shape, const Box& box, void* packed,
              size_t elem_size);
void unpack_box(const void* packed, const Box& box, void* dst, const Shape& dst_shape,
                size_t elem_size);

}  // namespace tessel
