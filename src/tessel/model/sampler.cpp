#include "tessel/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tessel/core/check.h"

namespace tessel::model {

namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

// Rejects what no distribution can be made of; -infinity (a masked id) is a logit like any other.
void check_logits(std::span<const float> logits) {
  TESSEL_CHECK(!logits.empty(), InvalidArgumentError, "cannot sample from an empty row of logits");
  for (size_t i = 0; i < logits.size(); ++i) {
    TESSEL_CHECK(!std::isnan(logits[i]) && logits[i] != HUGE_VALF, InvalidArgumentError,
                 "logit {} of {} is {}: the model's output is not finite (damaged weights?)", i,
                 logits.size(), logits[i]);
  }
}

}  // namespace

SampleRng::SampleRng(uint64_t seed) {
  for (uint64_t& s : s_) s = splitmix64(seed);
}

uint64_t SampleRng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double SampleRng::uniform() {
  return double(next() >> 11) * 0x1p-53;
}

int32_t argmax(std::span<const float> logits) {
  TESSEL_CHECK(!logits.empty(), InvalidArgumentError, "argmax of an empty row of logits");
  size_t best = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    TESSEL_CHECK(!std::isnan(logits[i]), InvalidArgumentError,
                 "logit {} of {} is NaN: the model's output is not finite (damaged weights?)", i,
                 logits.size());
    if (logits[i] > logits[best]) best = i;
  }
  return int32_t(best);
}

Sampler::Sampler(SamplingOptions options, uint64_t seed) : options_(options), rng_(seed) {
  TESSEL_CHECK(std::isfinite(options_.temperature) && options_.temperature >= 0,
               InvalidArgumentError,
               "temperature is {}; it must be 0 (greedy) or a positive number such as 0.8",
               options_.temperature);
  TESSEL_CHECK(options_.top_k >= 0, InvalidArgumentError,
               "top_k is {}; it must be 0 (off) or a positive number of ids such as 50",
               options_.top_k);
  TESSEL_CHECK(options_.top_p > 0 && options_.top_p <= 1, InvalidArgumentError,
               "top_p is {}; it must be in (0, 1] (1 is off), such as 0.95", options_.top_p);
}

double Sampler::candidates(std::span<const float> logits, std::vector<Candidate>& out) const {
  check_logits(logits);
  const int32_t V = int32_t(logits.size());
  // Larger logit first, then lower id: a strict total order, so every sort agrees.
  auto before = [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const bool top_k = options_.top_k > 0 && options_.top_k < V;
  const bool top_p = options_.top_p < 1;
  if (top_k) {
    std::nth_element(ids.begin(), ids.begin() + (options_.top_k - 1), ids.end(), before);
    ids.resize(size_t(options_.top_k));
  }
  if (top_p) std::sort(ids.begin(), ids.end(), before);
  double mx = -HUGE_VAL;
  for (int32_t id : ids) mx = std::max(mx, double(logits[size_t(id)]));
  out.clear();
  double total = 0;
  for (int32_t id : ids) {
    // Every logit -infinity: all equally (un)likely.
    const double z = mx == -HUGE_VAL ? 0.0 : (double(logits[size_t(id)]) - mx);
    const double w = std::exp(z / options_.temperature);
    out.push_back({id, w});
    total += w;
  }
  if (top_p) {
    // The smallest leading set (sorted by weight, the same order as by logit) holding p of it.
    const double target = options_.top_p * total;
    double mass = 0;
    size_t keep = 0;
    while (keep < out.size() && (keep == 0 || mass < target)) mass += out[keep++].weight;
    out.resize(keep);
    total = mass;
  }
  return total;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (options_.temperature == 0) {
    check_logits(logits);
    return argmax(logits);
  }
  const double total = candidates(logits, scratch_);
  const double u = rng_.uniform() * total;
  double mass = 0;
  for (const Candidate& c : scratch_) {
    mass += c.weight;
    if (u < mass) return c.id;
  }
  // u rounds up to the total only when it is the last id's by a rounding of the sum.
  return scratch_.back().id;
}

std::vector<double> Sampler::distribution(std::span<const float> logits) const {
  std::vector<double> p(logits.size(), 0.0);
  if (options_.temperature == 0) {
    check_logits(logits);
    p[size_t(argmax(logits))] = 1.0;
    return p;
  }
  std::vector<Candidate> kept;
  const double total = candidates(logits, kept);
  for (const Candidate& c : kept) p[size_t(c.id)] = c.weight / total;
  return p;
}

}  // namespace tessel::model
