#include "tessel/model/init.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "tessel/core/check.h"

namespace tessel::model {

namespace {

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;  // splitmix64's increment (golden ratio)

// splitmix64's output function: a bijective avalanche mix.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

// Two independent standard normals from the pair-th output of the stream `key` (Box-Muller in
// float: 24-bit uniforms, u1 in (0, 1] so the log is finite, |z| <= sqrt(2 ln 2^24) ~ 5.8).
// Element i of a tensor takes the cosine branch of pair i/2 when i is even, the sine branch
// when odd: still a pure function of i, at half the transcendental calls per element.
struct NormalPair {
  float even, odd;
};
inline NormalPair normal_pair(uint64_t key, int64_t pair) {
  const uint64_t r = mix64(key + (uint64_t(pair) + 1) * kGamma);
  const float u1 = (float(r >> 40) + 1.0f) * 0x1p-24f;
  const float u2 = float(r & 0xffffffull) * 0x1p-24f;
  const float radius = std::sqrt(-2.0f * std::log(u1));
  const float angle = 2.0f * std::numbers::pi_v<float> * u2;
  return {radius * std::cos(angle), radius * std::sin(angle)};
}

// Row length used to decide which elements are padding rows (dim 0 indexes rows).
int64_t row_elems(const ParamSpec& spec) {
  return spec.shape.rank() == 0 ? 1 : spec.numel() / std::max<int64_t>(spec.shape[0], 1);
}

// Writes elements [start, start + n) of the tensor, which lie in one row (callers walk the
// last dimension).
void fill_run(const ParamSpec& spec, uint64_t key, int64_t start, int64_t n, float* dst,
              int64_t row_len) {
  if ((spec.init_rows >= 0 && start / row_len >= spec.init_rows) || spec.init == InitKind::zeros) {
    std::fill(dst, dst + n, 0.0f);
    return;
  }
  if (spec.init == InitKind::ones) {
    std::fill(dst, dst + n, 1.0f);
    return;
  }
  const float scale = spec.std;
  int64_t i = start;
  const int64_t end = start + n;
  if (i < end && (i & 1)) {
    *dst++ = scale * normal_pair(key, i >> 1).odd;
    ++i;
  }
  for (; i + 1 < end; i += 2) {
    const NormalPair z = normal_pair(key, i >> 1);
    *dst++ = scale * z.even;
    *dst++ = scale * z.odd;
  }
  if (i < end) *dst = scale * normal_pair(key, i >> 1).even;
}

}  // namespace

uint64_t init_key(uint64_t seed, std::string_view name) {
  return mix64(mix64(seed + kGamma) ^ fnv1a(name));
}

float init_value(const ParamSpec& spec, uint64_t seed, int64_t index) {
  float v;
  fill_run(spec, init_key(seed, spec.name), index, 1, &v, row_elems(spec));
  return v;
}

void init_box(const ParamSpec& spec, uint64_t seed, const Box& box, float* out) {
  const size_t rank = spec.shape.rank();
  TESSEL_CHECK(box.rank() == rank && Box::of(spec.shape).contains(box), InvalidArgumentError,
               "init box {} is not inside tensor '{}' of shape {}", box.str(), spec.name,
               spec.shape.str());
  if (box.empty()) return;
  const uint64_t key = init_key(seed, spec.name);
  const int64_t row_len = row_elems(spec);
  if (rank == 0) {
    fill_run(spec, key, 0, 1, out, row_len);
    return;
  }
  // Walk the box as runs along the last dimension; run r's start index in the full tensor comes
  // from decomposing r over the box's outer extents.
  const std::vector<int64_t> strides = spec.shape.strides();
  const int64_t run = box.extent(rank - 1);
  const int64_t runs = box.volume() / run;
#pragma omp parallel for schedule(static) if (box.volume() > (1 << 16))
  for (int64_t r = 0; r < runs; ++r) {
    int64_t rem = r, start = box.lo(rank - 1);
    for (size_t d = rank - 1; d-- > 0;) {
      const int64_t ext = box.extent(d);
      start += (box.lo(d) + rem % ext) * strides[d];
      rem /= ext;
    }
    fill_run(spec, key, start, run, out + r * run, row_len);
  }
}

void init_full(const ParamSpec& spec, uint64_t seed, float* out) {
  init_box(spec, seed, Box::of(spec.shape), out);
}

}  // namespace tessel::model
