// Sampler: picks the next token from a row of logits -- greedy, or a seeded draw after
// temperature, top-k and top-p (nucleus) filtering, in Hugging Face's order.
//
// Sampling with temperature T > 0 draws id i with probability proportional to
// exp((logit_i - max logit) / T) over the kept set:
//   1. top-k (k > 0): the k largest logits;
//   2. top-p (p < 1): of those, sorted by probability, the smallest leading set whose mass is at
//      least p of theirs.
// Ties are broken by the lower id, everywhere (the sort order is a total order, so the kept set
// does not depend on the sort algorithm). Temperature 0 is greedy: the argmax (lowest id among
// equal logits), consuming no random numbers; top-k = 1 picks the same.
//
// Reproducibility: the random numbers come from SampleRng (xoshiro256**, seeded through
// splitmix64), written out in sampler.cpp, and are turned into a uniform double from their top 53
// bits by hand: no standard-library distribution is involved, so the same seed and the same
// logits give the same ids with every compiler and standard library. The weights use std::exp in
// double; a libm whose exp differs by an ulp could only change a draw that falls within ~1e-16 of
// a boundary. (The logits themselves depend on the CPU's float rounding: see decoder.h.)
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tessel::model {

struct SamplingOptions {
  double temperature = 0.8;  // >= 0; 0 is greedy
  int top_k = 50;            // >= 0; 0 keeps every id
  double top_p = 0.95;       // in (0, 1]; 1 keeps every id
};

// xoshiro256** (Blackman and Vigna, 2018) with its state filled by splitmix64 from `seed`, the
// authors' recommended seeding.
class SampleRng {
 public:
  explicit SampleRng(uint64_t seed);
  uint64_t next();
  // Uniform in [0, 1) on the grid of 2^-53: the top 53 bits of next().
  double uniform();

 private:
  uint64_t s_[4];
};

// The index of the largest logit, the lowest among equal ones. Throws InvalidArgumentError for an
// empty row or a NaN in it.
int32_t argmax(std::span<const float> logits);

class Sampler {
 public:
  // Throws InvalidArgumentError naming the field for a temperature that is negative or not
  // finite, a negative top_k, or a top_p outside (0, 1].
  Sampler(SamplingOptions options, uint64_t seed);

  const SamplingOptions& options() const { return options_; }

  // The next id, drawn from distribution(logits) with one uniform number (none when greedy).
  // Throws InvalidArgumentError for an empty row, a NaN or +infinity in it.
  int32_t sample(std::span<const float> logits);

  // What sample() draws from: one probability per id (summing to 1), zero outside the kept set;
  // greedy puts 1 on the argmax. Same errors as sample().
  std::vector<double> distribution(std::span<const float> logits) const;

 private:
  struct Candidate {
    int32_t id;
    double weight;  // exp((logit - max) / T), not normalised
  };
  // The kept ids with their weights, in the order draws walk them, and the weights' sum.
  double candidates(std::span<const float> logits, std::vector<Candidate>& out) const;

  SamplingOptions options_;
  SampleRng rng_;
  std::vector<Candidate> scratch_;
};

}  // namespace tessel::model
