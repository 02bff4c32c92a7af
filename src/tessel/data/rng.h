// A small, fully specified pseudo-random generator for data ordering.
//
// Why not <random>: the engines are specified, but the distributions (uniform_int_distribution,
// shuffle) are not, so the same seed gives different sample orders on different standard libraries.
// The sample order is part of a run's reproducible state (a resumed or resharded run must see the
// same batches), so every step here is written out: splitmix64 for seeding, xoshiro256** for the
// stream, and a rejection-sampled bounded integer. Changing anything here changes every sample
// order; rng_test.cpp pins the generators against their published reference implementations.
#pragma once

#include <bit>
#include <cstdint>

namespace tessel::data {

// One step of splitmix64's output function (Steele, Lea, Flood 2014): a strong 64-bit mixer.
constexpr uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ull;

// splitmix64 (Vigna's reference splitmix64.c): used to expand one seed into xoshiro's state.
class SplitMix64 {
 public:
  explicit constexpr SplitMix64(uint64_t seed) : state_(seed) {}
  constexpr uint64_t next() {
    state_ += kGoldenGamma;
    return splitmix64_mix(state_);
  }

 private:
  uint64_t state_;
};

// xoshiro256** 1.0 (Blackman & Vigna), seeded from splitmix64 as its authors recommend.
class Xoshiro256 {
 public:
  explicit constexpr Xoshiro256(uint64_t seed) {
    SplitMix64 sm(seed);
    for (auto& word : s_) word = sm.next();
  }
  // Starts from an explicit state (for known-answer tests); the state must not be all zero.
  static constexpr Xoshiro256 from_state(uint64_t s0, uint64_t s1, uint64_t s2, uint64_t s3) {
    Xoshiro256 r(0);
    r.s_[0] = s0;
    r.s_[1] = s1;
    r.s_[2] = s2;
    r.s_[3] = s3;
    return r;
  }
  constexpr uint64_t next() {
    const uint64_t result = std::rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = std::rotl(s_[3], 45);
    return result;
  }

  // Uniform integer in [0, bound), exactly unbiased: draws the top ceil(log2(bound)) bits and
  // rejects values >= bound (fewer than two draws on average). bound must be >= 1.
  constexpr uint64_t below(uint64_t bound) {
    if (bound <= 1) return 0;
    const int bits = 64 - std::countl_zero(bound - 1);
    for (;;) {
      const uint64_t x = next() >> (64 - bits);
      if (x < bound) return x;
    }
  }

 private:
  uint64_t s_[4] = {};
};

// Combines two words into one seed (order matters): used to derive per-epoch streams.
constexpr uint64_t combine_seed(uint64_t a, uint64_t b) {
  return splitmix64_mix(a ^ splitmix64_mix(b + kGoldenGamma));
}

}  // namespace tessel::data
