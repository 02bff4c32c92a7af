// The checks of the command line's count flags (--steps, --nproc, --gpus, ...): a value out of
// range is an error naming the flag, never ignored or wrapped. CLI11 itself reads only whole
// numbers into integer options ("2.5" and "2abc" are refused there).
#pragma once

#include <CLI/CLI.hpp>

namespace tessel::cli {

// 1 .. 2^31-1: counts of steps, workers, samples.
inline const CLI::Range kCount(1.0, 2147483647.0, "COUNT");
// 1 .. 2^20 devices: more would overflow the planner's products of device counts.
inline const CLI::Range kDeviceCount(1.0, 1048576.0, "DEVICES");

}  // namespace tessel::cli
