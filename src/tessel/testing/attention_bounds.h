// Bounds for the attention block's kernels (kernels/attention.h, kernels/rope.h): per element, on
// |a float32 kernel - the float64 reference| for a kernel doing the cpu:: kernels' arithmetic in
// any order, in the error model of rounding.h and kernel_bounds.h. The derivations are in
// attention_bounds.cpp beside each bound. Used by the per-op tests (cpu:: against ref::) and by
// the op harness (any backend against the reference backend).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tessel::testing {

// ---- attention ----------------------------------------------------------------------------------

struct AttentionShape {
  int B, T, Hq, Hkv, D;
  bool fused;  // q, k, v (and their gradients) interleaved per token in one buffer
};

// Where q, k, v live inside one buffer. Fused: [B*T, (Hq + 2 Hkv) * D] rows with q, k, v side by
// side, as a QKV projection writes them (a stride of at least 1, for the contract's calls with no
// heads). Separate: three back-to-back blocks, each padded by one float per token, so that a
// kernel assuming a contiguous layout reads the wrong values (and one that writes the padding
// fails its zero bound).
struct QkvLayout {
  int64_t q_off, k_off, v_off, q_stride, kv_stride, size;
  explicit QkvLayout(const AttentionShape& c);
};

struct AttentionForwardBounds {
  std::vector<double> out, probs;  // out [B, T, Hq, D], probs [B, Hq, T, T]
};
// From the inputs (qkv laid out by QkvLayout). Throws std::domain_error when an exp argument is
// below -80 (outside the derivation's range).
AttentionForwardBounds attention_forward_bounds(const AttentionShape& c,
                                                std::span<const float> qkv);

// Both sides given the same probabilities and adding into the same pre-filled buffer `init`, laid
// out like qkv: the bound per element of that buffer (0 on padding: it must stay untouched).
std::vector<double> attention_backward_bounds(const AttentionShape& c, std::span<const float> qkv,
                                              std::span<const float> probs,
                                              std::span<const float> dout,
                                              std::span<const float> init);

// ---- rope ---------------------------------------------------------------------------------------

// cos and sin of the angle t theta^(-2i/D), in double, and how far a kernel's double cos and sin
// can be from them (err).
struct RopeAngle {
  double c, s, err;
  RopeAngle(int t, int i, int D, double theta);
};

// One side's error on a rotated component x1' = x1 c - x2 s (or x2' = x2 c + x1 s, x1 and x2
// swapped) computed in float from a float table of cos and sin, against the exact rotation.
double rope_rotation_error(double x1, double x2, const RopeAngle& a);
// The bound on |float kernel - float64 reference| for that component.
double rope_component_bound(double x1, double x2, const RopeAngle& a);

// rope_component_bound for every element of x [B*T tokens of `stride` floats, H heads of D each]
// (forward and backward alike); 0 for the gaps between tokens, which stay untouched.
std::vector<double> rope_bounds(std::span<const float> x, int B, int T, int H, int D,
                                int64_t stride, double theta);

}  // namespace tessel::testing
