// Runs: moving a region of one buffer to an equally shaped region of another as contiguous copies.
//
// This is the one algorithm behind every box copy (box_copy.h), the re-partition executor's
// cross-memory reads and the store's sub-tensor reads. Both regions are walked together in packed
// order; a run is a stretch of elements that are consecutive in the source AND in the destination.
// Runs are maximal: dimensions of extent 1 are dropped, neighbouring dimensions that are
// contiguous in both regions are merged (so a whole-array box, or rows spanning whole trailing
// dimensions on both sides, is one run), and a run continuing the previous one on both sides
// joins it. When the innermost stride is not 1 on both sides every run is one element.
//
// Runs come in packed order, which for boxes of row-major arrays (StridedRegion::of_box) is
// ascending in both buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tessel/tensor/strided_region.h"

namespace tessel {

namespace detail {

// The walk for_each_run takes: runs of `len` elements (0: no runs), the first at (src, dst),
// the others reached by an odometer over `outer` (outermost first).
struct RunWalk {
  struct Dim {
    int64_t extent = 0, src_stride = 0, dst_stride = 0;
  };
  int64_t src = 0, dst = 0, len = 0;
  std::vector<Dim> outer;
};

// Throws InvalidArgumentError when the extents differ or a region's strides do not match its
// extents (no bounds checks: the copy functions check the buffers).
RunWalk plan_runs(const StridedRegion& src, const StridedRegion& dst);

}  // namespace detail

// Calls f(src_offset, dst_offset, len) (in elements) for each maximal run copying `src` to `dst`,
// in packed order. The regions must have equal extents (InvalidArgumentError otherwise). An empty
// region gives no run, a rank-0 region one run of one element.
template <typename F>
void for_each_run(const StridedRegion& src, const StridedRegion& dst, F&& f) {
  const detail::RunWalk w = detail::plan_runs(src, dst);
  if (w.len == 0) return;
  const size_t D = w.outer.size();
  if (D == 0) {
    f(w.src, w.dst, w.len);
    return;
  }
  std::vector<int64_t> idx(D, 0);
  int64_t so = w.src, dof = w.dst;      // the next run from the odometer
  int64_t rs = so, rd = dof, rlen = 0;  // the run being extended
  for (;;) {
    if (rs + rlen == so && rd + rlen == dof) {
      rlen += w.len;
    } else {
      f(rs, rd, rlen);
      rs = so;
      rd = dof;
      rlen = w.len;
    }
    size_t d = D;
    for (;;) {
      if (d == 0) {
        f(rs, rd, rlen);
        return;
      }
      const detail::RunWalk::Dim& dim = w.outer[--d];
      so += dim.src_stride;
      dof += dim.dst_stride;
      if (++idx[d] < dim.extent) break;
      idx[d] = 0;
      so -= dim.extent * dim.src_stride;
      dof -= dim.extent * dim.dst_stride;
    }
  }
}

// A run in bytes.
struct ByteRun {
  uint64_t src = 0;  // byte offset in the source buffer
  uint64_t dst = 0;  // byte offset in the destination buffer
  uint64_t len = 0;  // bytes
  bool operator==(const ByteRun&) const = default;
};

// The runs of for_each_run, in bytes for elements of `elem_size` bytes (e.g. to pread exactly the
// bytes a box of a stored tensor needs). Throws InvalidArgumentError like for_each_run, and when
// a run would start before its buffer.
std::vector<ByteRun> byte_runs(const StridedRegion& src, const StridedRegion& dst,
                               size_t elem_size);

}  // namespace tessel
