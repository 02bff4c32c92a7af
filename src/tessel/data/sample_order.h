// The deterministic global order in which training visits samples.
//
// Epoch e is a Fisher-Yates permutation of [0, num_samples) drawn from xoshiro256** seeded with
// combine_seed(seed, e) (rng.h: every step is specified, so the order is identical on every
// platform and standard library). A cursor counts samples consumed since the start of training,
// monotonically across epochs: cursor c is position c % n of epoch c / n. Because the order is a
// pure function of (seed, num_samples, cursor), a run resumed from a saved cursor, or restarted
// with a different parallel layout, sees exactly the same samples.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace tessel::data {

// Permutation of [0, n) for (seed, epoch).
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

class SampleOrder {
 public:
  // Throws InvalidArgumentError when num_samples < 1.
  SampleOrder(int64_t num_samples, uint64_t seed);

  int64_t num_samples() const { return n_; }
  uint64_t seed() const { return seed_; }
  int64_t epoch_of(int64_t cursor) const { return cursor / n_; }

  // Sample index at `cursor` (>= 0, else InvalidArgumentError).
  int64_t global_sample(int64_t cursor) const;
  // out[k] = global_sample(cursor + k) for k < count: one cache lookup per epoch touched.
  void global_samples(int64_t cursor, int64_t count, int64_t* out) const;

  // Thread-safe. Permutations of the two most recently used epochs are cached, so readers on
  // either side of an epoch boundary do not rebuild them (building is O(n)).
  std::shared_ptr<const std::vector<int64_t>> permutation(int64_t epoch) const;

 private:
  int64_t n_;
  uint64_t seed_;
  mutable std::mutex mu_;
  mutable int64_t cached_epoch_[2] = {-1, -1};
  mutable std::shared_ptr<const std::vector<int64_t>> cached_[2];
  mutable int next_slot_ = 0;
};

}  // namespace tessel::data
