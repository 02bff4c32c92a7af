// Byte runs of a box: how to move a box of a logical tensor between two dense row-major arrays
// that each hold some (other) box of it, as a list of contiguous copies.
//
// Readers use the runs to pread exactly the bytes a request needs from a stored piece: each run
// is contiguous in the source array *and* in the destination array, and runs are coalesced
// whenever both sides continue without a gap, so a whole-row or whole-piece read is one run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tessel/tensor/box.h"

namespace tessel::store {

struct ByteRun {
  uint64_t src = 0;  // byte offset in the source array
  uint64_t dst = 0;  // byte offset in the destination array
  uint64_t len = 0;  // bytes
  bool operator==(const ByteRun&) const = default;
};

// Runs copying `region` (in the logical tensor's coordinates) from an array holding the box
// `src_frame` to an array holding the box `dst_frame`, both dense row-major with elements of
// `elem_size` bytes. `region` must lie inside both frames (InvalidArgumentError otherwise). The
// runs come in increasing order of both `src` and `dst`; an empty region gives no runs.
std::vector<ByteRun> box_runs(const Box& region, const Box& src_frame, const Box& dst_frame,
                              size_t elem_size);

}  // namespace tessel::store
