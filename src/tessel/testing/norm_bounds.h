// Bounds for the normalisation kernels (kernels/layernorm.h, kernels/rmsnorm.h): per element, on
// |a float32 kernel - the float64 reference| for a kernel doing the cpu:: kernels' arithmetic in
// any order, in the error model of rounding.h and kernel_bounds.h. The derivations are in
// norm_bounds.cpp beside each bound. Used by the per-op tests (cpu:: against ref::) and by the
// op harness (any backend against the reference backend).
//
// Inputs are [N, C] row-major; the statistics mean and rstd are [N]. Backward bounds are for both
// sides given the same statistics and adding into the same pre-filled buffers (the *_init
// arguments: the buffers' contents before the call).
#pragma once

#include <span>
#include <vector>

namespace tessel::testing {

struct LayernormForwardBounds {
  std::vector<double> out, mean, rstd;
};
// `bias` empty: no bias.
LayernormForwardBounds layernorm_forward_bounds(std::span<const float> inp,
                                                std::span<const float> weight,
                                                std::span<const float> bias, int N, int C,
                                                float eps);

struct LayernormBackwardBounds {
  std::vector<double> dinp, dweight, dbias;
};
LayernormBackwardBounds layernorm_backward_bounds(
    std::span<const float> inp, std::span<const float> weight, std::span<const float> dout,
    std::span<const float> mean, std::span<const float> rstd, std::span<const float> dinp_init,
    std::span<const float> dweight_init, std::span<const float> dbias_init, int N, int C);

struct RmsnormForwardBounds {
  std::vector<double> out, rstd;
};
RmsnormForwardBounds rmsnorm_forward_bounds(std::span<const float> inp,
                                            std::span<const float> weight, int N, int C, float eps);

struct RmsnormBackwardBounds {
  std::vector<double> dinp, dweight;
};
RmsnormBackwardBounds rmsnorm_backward_bounds(std::span<const float> inp,
                                              std::span<const float> weight,
                                              std::span<const float> dout,
                                              std::span<const float> rstd,
                                              std::span<const float> dinp_init,
                                              std::span<const float> dweight_init, int N, int C);

}  // namespace tessel::testing
