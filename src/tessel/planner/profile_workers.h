// Internal to the profiler (profiler.h): what its forked children measure. A compute worker
// times the GEMM rate, the model's stages by micro-batch size and the optimizer phase; a
// communication worker times p2p, all-reduce and tensor-parallel stages in its group. Each returns
// its raw times as JSON text, which profiler.cpp combines into the profile.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "tessel/planner/profile_harness.h"
#include "tessel/planner/profiler.h"

namespace tessel::planner::detail {

// One compute worker, `index` of `count` measuring at once in lockstep through `barrier`, with
// `threads` OpenMP threads; `sizes` are the micro-batch sizes and `store_dir` the rendezvous of
// the idle communicators the workers connect among themselves (when count > 1). Returns
// {"gemm_flops", "gemm_half_time_s", "points": [per micro-batch times and activation bytes],
// "optimizer": {...}, "peak_rss_bytes"}.
std::string compute_worker(const ProfileOptions& o, int seq, int threads,
                           const std::vector<int64_t>& sizes, SharedBarrier& barrier, int index,
                           int count, const std::filesystem::path& store_dir);

// Rank `rank` of communication group `group` of g processes (rendezvous in `store_dir`), timing
// messages of `sizes` bytes and, when o.measure_tp and the model splits g ways, tp stages for
// `micro_batches`. Rank 0 returns {"p2p" (g == 2), "all_reduce", "tp_points"}; the others "{}".
std::string comm_worker(const ProfileOptions& o, const std::filesystem::path& store_dir,
                        const std::vector<int64_t>& sizes, int g, int group, int rank, int threads,
                        int seq, const std::vector<int64_t>& micro_batches);

}  // namespace tessel::planner::detail
