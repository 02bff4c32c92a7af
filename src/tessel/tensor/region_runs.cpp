#include "tessel/tensor/region_runs.h"

#include "tessel/core/check.h"

namespace tessel::detail {

RunWalk plan_runs(const StridedRegion& src, const StridedRegion& dst) {
  const size_t rank = src.extents.size();
  TESSEL_CHECK(src.extents == dst.extents, InvalidArgumentError,
               "copying between regions of different extents: source ({}) and destination ({})",
               src.str(), dst.str());
  TESSEL_CHECK(src.strides.size() == rank && dst.strides.size() == rank, InvalidArgumentError,
               "a region's strides do not match its extents: source ({}) and destination ({})",
               src.str(), dst.str());
  RunWalk w;
  w.src = src.offset;
  w.dst = dst.offset;
  if (src.numel() == 0) return w;
  // Dimensions of extent 1 never move; a dimension whose stride (on both sides) is the whole
  // span of the next one continues it, and the two become one.
  for (size_t d = 0; d < rank; ++d) {
    const RunWalk::Dim dim{src.extents[d], src.strides[d], dst.strides[d]};
    if (dim.extent == 1) continue;
    if (!w.outer.empty()) {
      RunWalk::Dim& prev = w.outer.back();
      if (prev.src_stride == dim.extent * dim.src_stride &&
          prev.dst_stride == dim.extent * dim.dst_stride) {
        prev = {prev.extent * dim.extent, dim.src_stride, dim.dst_stride};
        continue;
      }
    }
    w.outer.push_back(dim);
  }
  // The innermost dimension is the run when it is consecutive on both sides.
  w.len = 1;
  if (!w.outer.empty() && w.outer.back().src_stride == 1 && w.outer.back().dst_stride == 1) {
    w.len = w.outer.back().extent;
    w.outer.pop_back();
  }
  return w;
}

}  // namespace tessel::detail

namespace tessel {

std::vector<ByteRun> byte_runs(const StridedRegion& src, const StridedRegion& dst,
                               size_t elem_size) {
  std::vector<ByteRun> runs;
  const uint64_t es = elem_size;
  for_each_run(src, dst, [&](int64_t so, int64_t dof, int64_t n) {
    TESSEL_CHECK(so >= 0 && dof >= 0, InvalidArgumentError,
                 "a run starts before its buffer: source ({}) and destination ({})", src.str(),
                 dst.str());
    runs.push_back({uint64_t(so) * es, uint64_t(dof) * es, uint64_t(n) * es});
  });
  return runs;
}

}  // namespace tessel
