#include "tessel/schedule/zero_bubble.h"

#include <algorithm>

#include "tessel/core/check.h"

namespace tessel::schedule {
namespace {

void check_sizes(int stages, int micro_batches) {
  TESSEL_CHECK(stages >= 1, ConfigError, "zb-h1 schedule: stages must be at least 1, got {}",
               stages);
  TESSEL_CHECK(micro_batches >= 1, ConfigError,
               "zb-h1 schedule: micro_batches must be at least 1, got {}", micro_batches);
}

// One stage's list with the receive right before the compute that consumes it and the send
// right after the compute that produces it (the placement generators.cpp uses).
class Writer {
 public:
  Writer(int stages, int stage) : p_(stages), s_(stage) {}

  void forward(int mb) {
    if (s_ > 0) add(Op::recv_activation, mb, s_ - 1);
    add(Op::forward, mb);
    if (s_ < p_ - 1) add(Op::send_activation, mb, s_ + 1);
  }
  void backward_input(int mb) {
    if (s_ < p_ - 1) add(Op::recv_grad, mb, s_ + 1);
    add(Op::backward_input, mb);
    if (s_ > 0) add(Op::send_grad, mb, s_ - 1);
  }
  void backward_weight(int mb) { add(Op::backward_weight, mb); }

  std::vector<Instruction> finish() {
    list_.push_back({Op::optimizer_step, -1, -1, -1});
    return std::move(list_);
  }

 private:
  void add(Op op, int mb, int peer = -1) { list_.push_back({op, mb, 0, peer}); }

  int p_, s_;
  std::vector<Instruction> list_;
};

}  // namespace

Schedule zb_h1(int stages, int micro_batches) {
  check_sizes(stages, micro_batches);
  const int p = stages, m = micro_batches;
  Schedule schedule{"zb-h1", p, m, 1, {}};
  for (int s = 0; s < p; ++s) {
    Writer w(p, s);
    int f = 0, b = 0, wt = 0;  // next forward, Bi and Bw micro-batch
    for (; f < std::min(p - s - 1, m); ++f) w.forward(f);
    // Bw deferred: the first s Bis run without their Bw. The later stage s is, the later its
    // first Bi, so these pairs do not raise its activations above stage 0's p.
    for (int i = 0; i < s && f < m; ++i) {
      w.forward(f++);
      w.backward_input(b++);
    }
    while (f < m) {
      w.forward(f++);
      w.backward_input(b++);
      w.backward_weight(wt++);
    }
    // Drain: each Bw fills the wait for the next gradient, the deferred ones go last.
    while (b < m) {
      w.backward_input(b++);
      w.backward_weight(wt++);
    }
    while (wt < m) w.backward_weight(wt++);
    schedule.per_stage.push_back(w.finish());
  }
  return schedule;
}

double zb_h1_bubble_fraction(int stages, int micro_batches) {
  check_sizes(stages, micro_batches);
  const double p = stages, m = micro_batches;
  const double makespan = micro_batches >= stages ? 3 * m + p - 1 : 2 * (m + p) - 1;
  return 1.0 - 3 * m / makespan;
}

}  // namespace tessel::schedule
