#include "tessel/runtime/tp_comm_group.h"

#include <algorithm>

namespace tessel::runtime {

void CommTpGroup::all_reduce_sum(float* data, size_t n) {
  comm_.all_reduce_sum(data, n);
}

void CommTpGroup::all_reduce_max(float* data, size_t n) {
  const int ranks = comm_.size();
  if (ranks == 1 || n == 0) return;
  gathered_.resize(size_t(ranks) * n);
  comm_.all_gather(data, n, gathered_.data());
  std::copy_n(gathered_.data(), n, data);
  for (int r = 1; r < ranks; ++r) {
    const float* other = gathered_.data() + size_t(r) * n;
    for (size_t i = 0; i < n; ++i) data[i] = std::max(data[i], other[i]);
  }
}

}  // namespace tessel::runtime
