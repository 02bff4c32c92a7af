// Bounds for the element-wise activation kernels (kernels/activations.h: gelu, swiglu): per
// element, on |a float32 kernel - the float64 reference| for a kernel doing the cpu:: kernels'
// arithmetic (fast_exp, kernel_bounds.h), in the error model of rounding.h. The derivations are
// in activation_bounds.cpp beside each bound. Used by the per-op tests (cpu:: against ref::) and
// by the op harness (any backend against the reference backend). Backward bounds are for results
// into zeroed buffers.
#pragma once

#include <cstdint>
#include <vector>

namespace tessel::testing {

inline constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi), as both kernels use it
inline constexpr double kGeluCube = 0.044715;

// Inputs: N(0, 3) values, and from n = 1000 on a dense grid over [-12, 12] in the first half,
// which covers both saturated tails.
std::vector<float> activation_inputs(int64_t n, uint64_t seed);

// gelu: out = gelu(x), and dinp = gelu'(x) dout.
double gelu_out_bound(float x);
double gelu_dinp_bound(float x, float dout);

// swiglu: out = silu(gate) up, and its two gradients for upstream dout. Throws std::domain_error
// for |gate| >= 87 (fast_exp(-gate) would clamp, outside the derivation).
struct SwigluBounds {
  double out, dgate, dup;
};
SwigluBounds swiglu_bounds(float gate, float up, float dout);

}  // namespace tessel::testing
