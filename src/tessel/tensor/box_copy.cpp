#include "tessel/tensor/box_copy.h"

#include <cstring>

#include "tessel/core/check.h"
#include "tessel/tensor/region_runs.h"

namespace tessel {

namespace {

// memcpy, with the one-element sizes of the common types inlined (a region whose innermost
// stride is not 1 copies one element per run).
inline void copy_bytes(std::byte* dst, const std::byte* src, size_t n) {
  switch (n) {
    case 2:
      std::memcpy(dst, src, 2);
      return;
    case 4:
      std::memcpy(dst, src, 4);
      return;
    case 8:
      std::memcpy(dst, src, 8);
      return;
    default:
      std::memcpy(dst, src, n);
  }
}

// Elements of `elem_size` bytes a buffer of `bytes` bytes holds.
int64_t elements(size_t bytes, size_t elem_size) {
  return int64_t(bytes / elem_size);
}

// The packed staging region of `r`'s extents (row-major from offset 0).
StridedRegion packed_like(const StridedRegion& r) {
  StridedRegion p{0, std::vector<int64_t>(r.extents.size()), r.extents};
  int64_t stride = 1;
  for (size_t d = r.extents.size(); d-- > 0;) {
    p.strides[d] = stride;
    stride *= r.extents[d] > 0 ? r.extents[d] : 0;
  }
  return p;
}

}  // namespace

void copy_region(std::span<const std::byte> src, const StridedRegion& from,
                 std::span<std::byte> dst, const StridedRegion& to, size_t elem_size) {
  TESSEL_CHECK(elem_size > 0, InvalidArgumentError, "copying elements of 0 bytes");
  TESSEL_CHECK(from.extents == to.extents, InvalidArgumentError,
               "copying between regions of different extents: source ({}) and destination ({})",
               from.str(), to.str());
  check_region_inside(from, elements(src.size(), elem_size), "source");
  check_region_inside(to, elements(dst.size(), elem_size), "destination");
  if (from.empty()) return;
  const uintptr_t s0 = uintptr_t(src.data()) + uintptr_t(from.offset) * elem_size;
  const uintptr_t s1 = uintptr_t(src.data()) + uintptr_t(from.end()) * elem_size;
  const uintptr_t d0 = uintptr_t(dst.data()) + uintptr_t(to.offset) * elem_size;
  const uintptr_t d1 = uintptr_t(dst.data()) + uintptr_t(to.end()) * elem_size;
  TESSEL_CHECK(s1 <= d0 || d1 <= s0, InvalidArgumentError,
               "source ({}) and destination ({}) overlap in memory; copy through a separate "
               "staging buffer",
               from.str(), to.str());
  const std::byte* s = src.data();
  std::byte* d = dst.data();
  for_each_run(from, to, [&](int64_t so, int64_t dof, int64_t n) {
    copy_bytes(d + size_t(dof) * elem_size, s + size_t(so) * elem_size, size_t(n) * elem_size);
  });
}

void gather(std::span<const std::byte> src, const StridedRegion& from, std::span<std::byte> packed,
            size_t elem_size) {
  copy_region(src, from, packed, packed_like(from), elem_size);
}

void scatter(std::span<const std::byte> packed, const StridedRegion& to, std::span<std::byte> dst,
             size_t elem_size) {
  copy_region(packed, packed_like(to), dst, to, elem_size);
}

void copy_box(const void* src, const Shape& src_shape, const Box& src_box, void* dst,
              const Shape& dst_shape, const std::vector<int64_t>& dst_lo, size_t elem_size) {
  const size_t rank = src_shape.rank();
  TESSEL_CHECK(src_box.rank() == rank && dst_shape.rank() == rank && dst_lo.size() == rank,
               InvalidArgumentError, "copy_box ranks differ: src {} box {} dst {}", src_shape.str(),
               src_box.str(), dst_shape.str());
  std::vector<int64_t> dst_hi(rank);
  for (size_t d = 0; d < rank; ++d) dst_hi[d] = dst_lo[d] + src_box.extent(d);
  const StridedRegion from = StridedRegion::of_box(src_box, src_shape);
  const StridedRegion to = StridedRegion::of_box(Box(dst_lo, std::move(dst_hi)), dst_shape);
  copy_region({static_cast<const std::byte*>(src), size_t(src_shape.numel()) * elem_size}, from,
              {static_cast<std::byte*>(dst), size_t(dst_shape.numel()) * elem_size}, to, elem_size);
}

void copy_box(const Tensor& src, const Box& src_box, Tensor& dst,
              const std::vector<int64_t>& dst_lo) {
  TESSEL_CHECK(src.dtype() == dst.dtype(), InvalidArgumentError, "copy_box from {} to {}",
               src.str(), dst.str());
  copy_box(src.raw(), src.shape(), src_box, dst.raw(), dst.shape(), dst_lo,
           dtype_size(src.dtype()));
}

void pack_box(const void* src, const Shape& src_shape, const Box& box, void* packed,
              size_t elem_size) {
  copy_box(src, src_shape, box, packed, box.shape(), std::vector<int64_t>(box.rank(), 0),
           elem_size);
}

void unpack_box(const void* packed, const Box& box, void* dst, const Shape& dst_shape,
                size_t elem_size) {
  copy_box(packed, box.shape(), Box::of(box.shape()), dst, dst_shape, box.lo(), elem_size);
}

}  // namespace tessel
