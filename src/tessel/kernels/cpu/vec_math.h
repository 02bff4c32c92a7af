// Branch-free float math the compiler can vectorise.
//
// The project builds without -ffast-math, so GCC never calls glibc's vector math (libmvec) and
// a loop calling std::exp stays scalar. These inline versions use only +, *, compares, selects
// and integer bit tricks, so `#pragma omp simd` loops around them vectorise fully.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace tessel::kernels::cpu {

// exp(x) within ~2 ulp for x in [-87.3, 88]; 0 below -87.3 (no denormals), exp(88) above 88.
// Cody-Waite reduction x = k ln2 + r with |r| <= ln2/2, then Cephes' degree-6 polynomial for e^r,
// and 2^k assembled in the exponent bits.
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.33654f), 88.0f);
  // Round x/ln2 to the nearest integer: adding 1.5*2^23 pushes the fraction bits out.
  const float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - k * 0.693359375f;  // ln2 split in a part exact in float and a correction
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_k = std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
  return x < -87.33654f ? 0.0f : p * two_k;
}

// 1 / (1 + exp(-x)), relative error a few ulp over the whole float range (saturates cleanly).
inline float fast_sigmoid(float x) {
  return 1.0f / (1.0f + fast_exp(-x));
}

// Sum of exp(x[j] - mx) over j < n, in double. Works in L1-sized blocks: a vectorised float pass
// writes the block's exponentials (into out[0, n) when out is not null, else a scratch block),
// then a vectorised double pass sums the block. (Folding the double sum into the exp loop stops
// GCC from vectorising it.)
inline double sum_exp(const float* x, int n, float mx, float* out) {
  constexpr int kBlock = 1024;  // floats: 4 KB
  alignas(64) float scratch[kBlock];
  double sum = 0.0;
  for (int v0 = 0; v0 < n; v0 += kBlock) {
    const int len = n - v0 < kBlock ? n - v0 : kBlock;
    const float* xs = x + v0;
    float* e = out != nullptr ? out + v0 : scratch;
#pragma omp simd
    for (int j = 0; j < len; ++j) e[j] = fast_exp(xs[j] - mx);
    double block_sum = 0.0;
#pragma omp simd reduction(+ : block_sum)
    for (int j = 0; j < len; ++j) block_sum += e[j];
    sum += block_sum;
  }
  return sum;
}

}  // namespace tessel::kernels::cpu
