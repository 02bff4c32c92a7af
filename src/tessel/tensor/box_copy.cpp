#include "tessel/tensor/box_copy.h"

#include <cstring>

#include "tessel/core/check.h"

namespace tessel {

void copy_box(const void* src, const Shape& src_shape, const Box& src_box, void* dst,
              const Shape& dst_shape, const std::vector<int64_t>& dst_lo, size_t elem_size) {
  const size_t rank = src_shape.rank();
  TESSEL_CHECK(src_box.rank() == rank && dst_shape.rank() == rank && dst_lo.size() == rank,
               InvalidArgumentError, "copy_box ranks differ: src {} box {} dst {}", src_shape.str(),
               src_box.str(), dst_shape.str());
  TESSEL_CHECK(Box::of(src_shape).contains(src_box), InvalidArgumentError,
               "copy_box: box {} outside source {}", src_box.str(), src_shape.str());
  std::vector<int64_t> dst_hi(rank);
  for (size_t d = 0; d < rank; ++d) dst_hi[d] = dst_lo[d] + src_box.extent(d);
  Box dst_box(dst_lo, dst_hi);
  TESSEL_CHECK(Box::of(dst_shape).contains(dst_box), InvalidArgumentError,
               "copy_box: box {} outside destination {}", dst_box.str(), dst_shape.str());
  if (src_box.empty()) return;
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  if (rank == 0) {
    std::memcpy(d, s, elem_size);
    return;
  }
  auto ss = src_shape.strides(), ds = dst_shape.strides();
  // Merge trailing dimensions that are whole in both arrays into one contiguous run.
  size_t inner = rank - 1;
  int64_t run = src_box.extent(inner);
  while (inner > 0 && src_box.extent(inner) == src_shape[inner] &&
         src_box.extent(inner) == dst_shape[inner]) {
    --inner;
    run *= src_box.extent(inner);
  }
  const size_t run_bytes = size_t(run) * elem_size;
  // Iterate over the outer dimensions [0, inner) with an odometer.
  std::vector<int64_t> idx(inner, 0);
  while (true) {
    int64_t so = 0, dof = 0;
    for (size_t k = 0; k < inner; ++k) {
      so += (src_box.lo(k) + idx[k]) * ss[k];
      dof += (dst_lo[k] + idx[k]) * ds[k];
    }
    so += src_box.lo(inner) * ss[inner];
    dof += dst_lo[inner] * ds[inner];
    std::memcpy(d + dof * elem_size, s + so * elem_size, run_bytes);
    size_t k = inner;
    while (k > 0) {
      --k;
      if (++idx[k] < src_box.extent(k)) break;
      idx[k] = 0;
      if (k == 0) return;
    }
    if (inner == 0) return;
  }
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
