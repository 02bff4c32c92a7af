// Learning-rate schedule: linear warmup from 0, then cosine decay to min_lr at the last step.
//
//   step < warmup:           lr * (step + 1) / warmup
//   warmup <= step < total:  min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * progress))
// progress runs from 0 at the end of warmup to 1 at the last step. step is 0-based.
#pragma once

#include <cstdint>

namespace tessel::runtime {

struct LrSchedule {
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double at(int64_t step) const;
};

}  // namespace tessel::runtime
