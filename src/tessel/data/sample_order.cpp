#include "tessel/data/sample_order.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/data/rng.h"

namespace tessel::data {

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  TESSEL_CHECK(n >= 0 && epoch >= 0, InvalidArgumentError,
               "permutation of {} samples for epoch {}: both must be >= 0", n, epoch);
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  Xoshiro256 rng(combine_seed(seed, static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

SampleOrder::SampleOrder(int64_t num_samples, uint64_t seed) : n_(num_samples), seed_(seed) {
  TESSEL_CHECK(num_samples >= 1, InvalidArgumentError,
               "a sample order needs at least one sample, got {}", num_samples);
}

std::shared_ptr<const std::vector<int64_t>> SampleOrder::permutation(int64_t epoch) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int s = 0; s < 2; ++s)
      if (cached_epoch_[s] == epoch) return cached_[s];
  }
  // Build outside the lock; two threads may race to build the same epoch, which is harmless.
  auto perm = std::make_shared<const std::vector<int64_t>>(epoch_permutation(n_, seed_, epoch));
  std::lock_guard<std::mutex> lock(mu_);
  for (int s = 0; s < 2; ++s)
    if (cached_epoch_[s] == epoch) return cached_[s];
  cached_epoch_[next_slot_] = epoch;
  cached_[next_slot_] = perm;
  next_slot_ ^= 1;
  return perm;
}

int64_t SampleOrder::global_sample(int64_t cursor) const {
  int64_t out;
  global_samples(cursor, 1, &out);
  return out;
}

void SampleOrder::global_samples(int64_t cursor, int64_t count, int64_t* out) const {
  TESSEL_CHECK(cursor >= 0 && count >= 0, InvalidArgumentError,
               "sample cursor {} and count {} must be >= 0", cursor, count);
  int64_t k = 0;
  while (k < count) {
    const int64_t c = cursor + k;
    const auto perm = permutation(c / n_);
    const int64_t pos = c % n_;
    const int64_t take = std::min(count - k, n_ - pos);
    std::copy_n(perm->begin() + pos, take, out + k);
    k += take;
  }
}

}  // namespace tessel::data
