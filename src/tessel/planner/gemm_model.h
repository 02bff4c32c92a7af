// A GEMM's time on a GPU by its shape (issue 20, point 6): what cuBLAS-class kernels reach is a
// function of (m, n, k), not of the FLOPs alone -- small hidden sizes and skinny shapes run far
// below peak. The model is NVIDIA's own account of GEMM performance ("Matrix Multiplication
// Background User's Guide", docs.nvidia.com/deeplearning/performance): the output is computed in
// tiles spread over the streaming multiprocessors in waves, so
//   compute  = waves x SMs x (2 tile_m tile_n k) / (peak x max_efficiency x tile's share)
//              (tile quantization: partial tiles cost whole ones; wave quantization: a partial
//              last wave costs a whole one), waves = ceil(tiles x batch / SMs);
//   memory   = (m k + k n + m n) x batch x element bytes / memory bandwidth;
//   time     = sqrt(compute^2 + memory^2) + overhead,
// the kernel taking the tile among 256x128, 128x128, 128x64 and 64x64 that is fastest (smaller
// tiles fill the machine on small shapes but reuse less of what they load: they reach 0.95,
// 0.85 and 0.7 of the largest tile's share -- the model's assumption, checked only through the
// data below). The root of squares is a partial overlap of the two: neither their maximum (full
// overlap) nor their sum (none) follows the skinny shapes and the small ones together.
//
// The parameters come from kernel-level measurements only (never from end-to-end training
// throughput, which stays a held-out check of the planner):
//   max_efficiency  the "maximum achievable matmul FLOPS" found by a brute-force shape search,
//                   over the dense peak: A100 SXM 271.2 / 312 TFLOP/s bf16, H100 SXM 794.5 / 989
//                   (stas00/ml-engineering, compute/accelerator/README.md, commit 744d01e1).
//   SMs             108 (A100), 132 (H100 SXM): the hardware's.
//   overhead_s      launch, prologue and epilogue per call: 4 us (A100) and 6 us (H100), set by
//                   the smallest shapes of the tables below.
// Validated against (gemm_model_test.cpp: every point within 25%):
//   H100: XLA's GEMM table for sm_90, bf16, m, n, k from 256 to 4096 (tensorflow/tensorflow,
//         third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h, commit 372d578b);
//   A100: cuBLASLt GEMMs, fp16, from 1024^3 to 16384^3 and skinny shapes (Azure/AI-benchmarking-
//         guide, Azure_Results/ND_A100_v4_results.md, commit 8fd0c6e1).
#pragma once

#include <string>

namespace tessel::planner {

struct GemmShape {
  double m = 0, n = 0, k = 0;  // C[m, n] = A[m, k] B[k, n]
  double batch = 1;            // independent GEMMs of this shape in one call
  double flops() const { return 2 * m * n * k * batch; }
};

struct GemmModel {
  int sms = 0;  // 0: no shape model (the device's EfficiencyCurve applies)
  double max_efficiency = 0;
  double overhead_s = 0;
  bool defined() const { return sms > 0; }
  // Seconds for one call on a device of `peak_flops` (the precision's) and `memory_bandwidth`
  // (bytes/s), elements of `element_bytes`. Throws InvalidArgumentError for an undefined model
  // or non-positive rates, and for a shape with a dimension below 1.
  double time(const GemmShape& shape, double peak_flops, double memory_bandwidth,
              int element_bytes) const;
};

// The models of the A100 and H100 (above); an undefined model for any other name.
GemmModel gemm_model_for(const std::string& device_name);

}  // namespace tessel::planner
