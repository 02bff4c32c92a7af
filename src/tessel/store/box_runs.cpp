#include "tessel/store/box_runs.h"

#include "tessel/core/check.h"

namespace tessel::store {

std::vector<ByteRun> box_runs(const Box& region, const Box& src_frame, const Box& dst_frame,
                              size_t elem_size) {
  const size_t rank = region.rank();
  TESSEL_CHECK(src_frame.rank() == rank && dst_frame.rank() == rank, InvalidArgumentError,
               "box_runs: ranks of region {}, source {} and destination {} differ", region.str(),
               src_frame.str(), dst_frame.str());
  std::vector<ByteRun> runs;
  if (region.empty()) return runs;
  TESSEL_CHECK(src_frame.contains(region) && dst_frame.contains(region), InvalidArgumentError,
               "box_runs: region {} is not inside source {} and destination {}", region.str(),
               src_frame.str(), dst_frame.str());
  if (rank == 0) {
    runs.push_back({0, 0, elem_size});
    return runs;
  }
  const auto ss = src_frame.shape().strides(), ds = dst_frame.shape().strides();
  // Trailing dimensions the region spans completely in both frames merge into one run.
  size_t inner = rank - 1;
  uint64_t run = uint64_t(region.extent(inner));
  while (inner > 0 && region.extent(inner) == src_frame.extent(inner) &&
         region.extent(inner) == dst_frame.extent(inner)) {
    --inner;
    run *= uint64_t(region.extent(inner));
  }
  const uint64_t run_bytes = run * elem_size;
  std::vector<int64_t> idx(inner, 0);  // odometer over the outer dimensions [0, inner)
  while (true) {
    int64_t so = 0, dof = 0;
    for (size_t k = 0; k <= inner; ++k) {
      const int64_t i = region.lo(k) + (k < inner ? idx[k] : 0);
      so += (i - src_frame.lo(k)) * ss[k];
      dof += (i - dst_frame.lo(k)) * ds[k];
    }
    const uint64_t s = uint64_t(so) * elem_size, d = uint64_t(dof) * elem_size;
    if (!runs.empty() && runs.back().src + runs.back().len == s &&
        runs.back().dst + runs.back().len == d) {
      runs.back().len += run_bytes;
    } else {
      runs.push_back({s, d, run_bytes});
    }
    size_t k = inner;
    while (k > 0) {
      --k;
      if (++idx[k] < region.extent(k)) break;
      idx[k] = 0;
      if (k == 0) return runs;
    }
    if (inner == 0) return runs;
  }
}

}  // namespace tessel::store
