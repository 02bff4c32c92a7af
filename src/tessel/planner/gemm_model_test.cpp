#include "tessel/planner/gemm_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tessel/core/error.h"

namespace tessel::planner {
namespace {

struct Measured {
  double m, n, k, tflops;
};

// The model's claimed accuracy on the published kernel measurements: every point within 25% of
// its measured rate. The overhead was set by the three smallest shapes of each table; the
// efficiency comes from another source (the brute-force maximum, gemm_model.h); every other point
// is held out. The arithmetic is a few dozen double operations per point: no rounding moves a
// ratio by anything near the bound, on any CPU.
void expect_within(const GemmModel& model, double peak, double bandwidth,
                   const std::vector<Measured>& table) {
  for (const Measured& p : table) {
    const GemmShape s{p.m, p.n, p.k};
    const double predicted = s.flops() / model.time(s, peak, bandwidth, 2) / 1e12;
    EXPECT_LT(std::abs(std::log(predicted / p.tflops)), std::log(1.25))
        << p.m << " x " << p.n << " x " << p.k << ": predicted " << predicted << " TFLOP/s, "
        << "measured " << p.tflops;
  }
}

// XLA's sm_90 table, bf16, batch 1 (tensorflow/tensorflow,
// third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h at 372d578b).
TEST(GemmModel, H100FollowsXlasMeasuredTable) {
  expect_within(gemm_model_for("H100-SXM5-80GB"), 989e12, 3.35e12,
                {{4096, 4096, 4096, 783.3}, {4096, 4096, 2048, 738.7}, {4096, 2048, 4096, 764.1},
                 {4096, 1024, 4096, 738.5}, {2048, 4096, 2048, 717.5}, {4096, 4096, 1024, 681.1},
                 {4096, 512, 4096, 650.0},  {2048, 2048, 2048, 632.0}, {4096, 4096, 512, 543.1},
                 {1024, 2048, 2048, 524.3}, {4096, 1024, 1024, 488.1}, {4096, 4096, 256, 392.2},
                 {1024, 2048, 1024, 373.3}, {1024, 1024, 2048, 350.0}, {2048, 512, 2048, 347.7},
                 {1024, 1024, 1024, 246.7}, {4096, 512, 512, 238.8},   {1024, 512, 1024, 141.9},
                 {512, 512, 2048, 114.7},   {256, 2048, 256, 41.8},    {1024, 256, 256, 22.0},
                 {256, 512, 256, 11.5}});
}

// cuBLASLt on an A100-SXM4-80GB, fp16 (the bf16 rate; Azure/AI-benchmarking-guide,
// Azure_Results/ND_A100_v4_results.md at 8fd0c6e1): cubes, and skinny shapes far below peak.
TEST(GemmModel, A100FollowsCublasLtMeasurements) {
  expect_within(gemm_model_for("A100-SXM4-80GB"), 312e12, 2.039e12,
                {{1024, 1024, 1024, 119.4},
                 {2048, 2048, 2048, 221.8},
                 {4096, 4096, 4096, 228.0},
                 {8192, 8192, 8192, 253.7},
                 {16384, 16384, 16384, 256.5},
                 {1024, 2145, 1024, 132.8},
                 {6144, 12288, 12288, 250.8},
                 {802816, 192, 768, 157.8}});
}

// What the model is made of, each in isolation: a partial last wave costs about a whole one; a
// shape with little arithmetic per byte runs at its bytes; the overhead is per call.
TEST(GemmModel, WavesBytesAndOverhead) {
  const GemmModel g{100, 0.5, 1e-6};
  const double peak = 1e15, bandwidth = 1e12;
  // 100 tiles of 256 x 128 fill one wave; one row more needs a second wave of that tile, or
  // smaller tiles at a lower share: either way far more than the 1% more work (the best, 128 x 64
  // tiles in 5 waves at 0.85, costs 1.47 times as much).
  // (Memory 100 times faster here, so that the bytes, 0.4 us, hardly count.)
  const double one = g.time({256 * 10, 128 * 10, 4096}, peak, 100 * bandwidth, 2) - 1e-6;
  const double two = g.time({256 * 10 + 1, 128 * 10, 4096}, peak, 100 * bandwidth, 2) - 1e-6;
  EXPECT_GT(two, 1.4 * one);
  // 25600 x 128 x 8: 1.05 us of compute in one wave against 6.97 us of bytes (each element of A,
  // B and C once): the root of squares is within 2.5% of the bytes' time.
  const double bytes = (25600.0 * 8 + 8 * 128 + 25600.0 * 128) * 2 / bandwidth;
  const double t = g.time({25600, 128, 8}, peak, bandwidth, 2) - 1e-6;
  EXPECT_GE(t, bytes);
  EXPECT_LT(t, 1.025 * bytes);
  EXPECT_FALSE(gemm_model_for("worker").defined());
  EXPECT_THROW(GemmModel{}.time({1, 1, 1}, peak, bandwidth, 2), InvalidArgumentError);
  EXPECT_THROW(g.time({0, 1, 1}, peak, bandwidth, 2), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::planner
