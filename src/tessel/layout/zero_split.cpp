#include "tessel/layout/zero_split.h"

#include <algorithm>

namespace tessel::layout {

ZeroSplit zero_split(int64_t n, int64_t dp, int64_t r) {
  ZeroSplit z;
  for (int64_t i = 0; i < dp; ++i) z.counts.push_back(size_t(n / dp + (i < n % dp)));
  z.lo = r * (n / dp) + std::min(r, n % dp);
  z.n_own = int64_t(z.counts[size_t(r)]);
  return z;
}

}  // namespace tessel::layout
