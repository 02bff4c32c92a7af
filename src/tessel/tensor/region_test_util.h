// Test helpers for regions (used by the region, run and copy tests): random regions inside
// padded buffers and the naive element-by-element copy every engine result is compared with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "tessel/tensor/strided_region.h"

namespace tessel::test_util {

// Buffer offsets of a region's elements, in packed order (the reference walk: one element at a
// time, the multi-index advanced like an odometer).
inline std::vector<int64_t> region_offsets(const StridedRegion& r) {
  std::vector<int64_t> out;
  const int64_t n = r.numel();
  std::vector<int64_t> idx(r.extents.size(), 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t off = r.offset;
    for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * r.strides[d];
    out.push_back(off);
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < r.extents[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// The naive copy: element k of `from` (packed order) to element k of `to`, `elem_size` bytes.
inline void naive_copy(const std::byte* src, const StridedRegion& from, std::byte* dst,
                       const StridedRegion& to, size_t elem_size) {
  const auto s = region_offsets(from), d = region_offsets(to);
  for (size_t k = 0; k < s.size(); ++k)
    std::memcpy(dst + size_t(d[k]) * elem_size, src + size_t(s[k]) * elem_size, elem_size);
}

// A random region of `extents` inside a buffer: the box sits at a random position of a padded
// row-major frame (each dimension 0..2 longer), the whole frame at a random offset; with
// `unit_inner` false the innermost stride may be 2 or 3. Returns the region; `buffer_numel` gets
// the smallest buffer holding the frame plus 0..3 spare elements.
inline StridedRegion random_region(const std::vector<int64_t>& extents, std::mt19937& rng,
                                   int64_t& buffer_numel, bool unit_inner = true) {
  const size_t rank = extents.size();
  StridedRegion r;
  r.extents = extents;
  r.strides.resize(rank);
  const int64_t base = int64_t(rng() % 5);
  r.offset = base;
  int64_t stride = unit_inner ? 1 : 1 + int64_t(rng() % 3);
  for (size_t d = rank; d-- > 0;) {
    const int64_t frame = extents[d] + int64_t(rng() % 3);
    r.strides[d] = stride;
    r.offset += int64_t(rng() % uint64_t(frame - extents[d] + 1)) * stride;
    stride *= frame;
  }
  buffer_numel = base + stride + int64_t(rng() % 4);
  return r;
}

}  // namespace tessel::test_util
