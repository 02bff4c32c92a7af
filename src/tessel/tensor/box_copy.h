// Copying boxes of elements between buffers: the primitive of all re-partitioning.
//
// A shard is a box of a logical tensor, a piece of training state is a box stored as a strided
// region of a flat buffer (strided_region.h), and moving state between layouts, reading a box of
// a stored tensor or slicing a whole tensor into shards copies such regions, directly or through
// a packed staging buffer. All of it is copy_region below, which copies the runs of
// region_runs.h with memcpy; elements are opaque bytes of a given size, so float state, bf16
// checkpoint data and int32 indices share the code.
//
// Checks (InvalidArgumentError): the regions' extents must be equal, each region must lie inside
// its buffer (check_region_inside), and the source and destination must not overlap: the byte
// ranges from a region's first to its last element must be disjoint. That refuses copies within
// one buffer between regions that interleave without sharing an element (column slices of one
// array); stage those through a separate buffer (gather, then scatter).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "tessel/tensor/box.h"
#include "tessel/tensor/shape.h"
#include "tessel/tensor/strided_region.h"
#include "tessel/tensor/tensor.h"

namespace tessel {

// Copies region `from` of `src` to region `to` of `dst`, element i of `from` (in packed order) to
// element i of `to`. Both buffers hold elements of `elem_size` bytes.
void copy_region(std::span<const std::byte> src, const StridedRegion& from,
                 std::span<std::byte> dst, const StridedRegion& to, size_t elem_size);
// Packs region `from` of `src` into the first from.numel() elements of `packed` (row-major), and
// back: scatter writes the first to.numel() elements of `packed` into region `to` of `dst`.
void gather(std::span<const std::byte> src, const StridedRegion& from, std::span<std::byte> packed,
            size_t elem_size);
void scatter(std::span<const std::byte> packed, const StridedRegion& to, std::span<std::byte> dst,
             size_t elem_size);

// Typed forms (elements of sizeof(T) bytes); T is the destination's element type.
template <typename T>
void copy_region(std::span<const std::type_identity_t<T>> src, const StridedRegion& from,
                 std::span<T> dst, const StridedRegion& to) {
  copy_region(std::as_bytes(src), from, std::as_writable_bytes(dst), to, sizeof(T));
}
template <typename T>
void gather(std::span<const std::type_identity_t<T>> src, const StridedRegion& from,
            std::span<T> packed) {
  gather(std::as_bytes(src), from, std::as_writable_bytes(packed), sizeof(T));
}
template <typename T>
void scatter(std::span<const std::type_identity_t<T>> packed, const StridedRegion& to,
             std::span<T> dst) {
  scatter(std::as_bytes(packed), to, std::as_writable_bytes(dst), sizeof(T));
}

// Box forms over whole dense row-major arrays (their sizes come from the shapes).
//
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
