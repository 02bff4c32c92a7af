// Analytic pipeline bubble: the share of a step's time that an average stage sits idle, with
// equal stages, a fixed forward and backward time per micro-batch and free communication.
//
//   GPipe and 1F1B (chunks = 1):       (p - 1) / (m + p - 1)
//   interleaved 1F1B (v = chunks):     (p - 1) / (v * m + p - 1)
//
// The fill and drain take p - 1 slots of one chunk's forward + backward; interleaving makes a
// chunk 1/v of a stage, so the same slots cost v times less against v * m busy slots.
#pragma once

#include "tessel/core/check.h"

namespace tessel::schedule {

// Throws ConfigError when a size is below 1.
inline double bubble_fraction(int stages, int micro_batches, int chunks = 1) {
  TESSEL_CHECK(stages >= 1 && micro_batches >= 1 && chunks >= 1, ConfigError,
               "bubble_fraction: stages ({}), micro_batches ({}) and chunks ({}) must be >= 1",
               stages, micro_batches, chunks);
  return double(stages - 1) / double(chunks * micro_batches + stages - 1);
}

}  // namespace tessel::schedule
