#include "tessel/testing/rounding.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace tessel::testing {

double gamma(int64_t terms) {
  const double nu = double(terms) * kUnitRoundoff;
  if (nu >= 1) throw std::invalid_argument("gamma: too many terms for float32");
  return nu / (1 - nu);
}

double chain_tolerance(std::span<const int64_t> reduction_lengths, double lambda) {
  double total = 0;
  for (int64_t k : reduction_lengths) total += double(std::max<int64_t>(k, 1));
  return lambda * kUnitRoundoff * std::sqrt(total);
}

}  // namespace tessel::testing
