#include "tessel/kernels/cross_entropy.h"

#include "tessel/core/check.h"

namespace tessel::kernels {

void check_targets(const char* op, const int32_t* targets, int N, int V, int ignore_index) {
  for (int n = 0; n < N; ++n) {
    TESSEL_CHECK(targets[n] == ignore_index || (targets[n] >= 0 && targets[n] < V),
                 InvalidArgumentError,
                 "{}: target {} of row {} is outside [0, {}) and is not the ignore index {}; check "
                 "the data's vocabulary size",
                 op, targets[n], n, V, ignore_index);
  }
}

}  // namespace tessel::kernels
