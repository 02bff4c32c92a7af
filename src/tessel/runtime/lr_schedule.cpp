#include "tessel/runtime/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace tessel::runtime {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return lr * double(step + 1) / double(warmup_steps);
  int64_t decay_steps = std::max<int64_t>(1, total_steps - 1 - warmup_steps);
  double progress = std::clamp(double(step - warmup_steps) / double(decay_steps), 0.0, 1.0);
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace tessel::runtime
