#include "tessel/schedule/zero_bubble.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <utility>
#include <vector>

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

Schedule zb_v(int stages, int micro_batches) {
  TESSEL_CHECK(stages >= 1, ConfigError, "zb-v schedule: stages must be at least 1, got {}",
               stages);
  TESSEL_CHECK(micro_batches >= 1, ConfigError,
               "zb-v schedule: micro_batches must be at least 1, got {}", micro_batches);
  const int p = stages, m = micro_batches, n_vs = 2 * p;
  constexpr Placement kV = Placement::v_shape;
  constexpr int kNever = std::numeric_limits<int>::max();
  // When each (vs, mb)'s F and Bi finished (their results usable from then on).
  std::vector<int> f_done(size_t(n_vs * m), kNever), bi_done(f_done.size(), kNever);
  auto at = [m](int vs, int mb) { return size_t(vs * m + mb); };
  std::vector<int> next_f(size_t(n_vs), 0), next_bi(size_t(n_vs), 0);
  struct Stage {
    int free_at = 0;
    int in_flight = 0;  // chunk activations held: F taken, Bw not yet run
    int started = 0;    // micro-batches whose chunk-0 F ran and chunk-1 F did not
    std::deque<std::pair<int, int>> pending_w;  // (vs, mb) of Bis awaiting their Bw
    std::vector<Instruction> list;
  };
  std::vector<Stage> st(static_cast<size_t>(p));
  const int cap = 2 * p;
  auto emit = [&](Stage& s, Op op, int vs, int mb, int peer = -1) {
    s.list.push_back({op, mb, chunk_of(p, vs, kV), peer});
  };
  auto rank = [&](int vs) { return stage_of(p, vs, kV); };
  int remaining = 3 * n_vs * m;
  for (int t = 0; remaining > 0; ++t) {
    TESSEL_CHECK(t < 16 * (3 * n_vs * m + n_vs), Error,
                 "internal: the zb-v scheduler made no progress (p={}, m={})", p, m);
    for (int s = 0; s < p; ++s) {
      Stage& S = st[size_t(s)];
      if (S.free_at > t) continue;
      // Chunk 1 first: it wins ties of the micro-batch.
      const int vs_of[2] = {virtual_stage(p, s, 1, kV), virtual_stage(p, s, 0, kV)};
      // A ready Bi, lowest micro-batch first (ties: the later virtual stage, chunk 1).
      int best_vs = -1, best_mb = kNever;
      for (int vs : vs_of) {
        const int mb = next_bi[size_t(vs)];
        if (mb >= m || f_done[at(vs, mb)] > t) continue;
        if (vs < n_vs - 1 && bi_done[at(vs + 1, mb)] > t) continue;
        if (mb < best_mb) best_vs = vs, best_mb = mb;
      }
      if (best_vs >= 0) {
        const int vs = best_vs, mb = best_mb;
        if (vs < n_vs - 1 && rank(vs + 1) != s) emit(S, Op::recv_grad, vs, mb, rank(vs + 1));
        emit(S, Op::backward_input, vs, mb);
        if (vs > 0 && rank(vs - 1) != s) emit(S, Op::send_grad, vs, mb, rank(vs - 1));
        bi_done[at(vs, mb)] = t + 1;
        ++next_bi[size_t(vs)];
        S.pending_w.emplace_back(vs, mb);
        S.free_at = t + 1, --remaining;
        continue;
      }
      // A ready F within the budget, lowest micro-batch first (ties: chunk 1).
      best_vs = -1, best_mb = kNever;
      for (int vs : vs_of) {
        const int mb = next_f[size_t(vs)];
        if (mb >= m || (vs > 0 && f_done[at(vs - 1, mb)] > t)) continue;
        if (S.in_flight + 1 > cap) continue;
        // A chunk-0 forward starts a micro-batch whose chunk-1 forward will need room too, as
        // will those of the micro-batches already started here: admitted only when that room
        // exists, counting what the pending Bws (ready, dependent on nothing) will free.
        if (vs < p && S.in_flight + 2 + S.started > cap + int(S.pending_w.size())) continue;
        if (mb < best_mb) best_vs = vs, best_mb = mb;
      }
      if (best_vs >= 0) {
        const int vs = best_vs, mb = best_mb;
        if (vs > 0 && rank(vs - 1) != s) emit(S, Op::recv_activation, vs, mb, rank(vs - 1));
        emit(S, Op::forward, vs, mb);
        if (vs < n_vs - 1 && rank(vs + 1) != s) emit(S, Op::send_activation, vs, mb, rank(vs + 1));
        f_done[at(vs, mb)] = t + 1;
        ++next_f[size_t(vs)];
        ++S.in_flight;
        S.started += vs < p ? 1 : -1;
        S.free_at = t + 1, --remaining;
        continue;
      }
      if (!S.pending_w.empty()) {
        const auto [vs, mb] = S.pending_w.front();
        S.pending_w.pop_front();
        emit(S, Op::backward_weight, vs, mb);
        --S.in_flight;
        S.free_at = t + 1, --remaining;
      }
    }
  }
  Schedule schedule{"zb-v", p, m, 2, {}, kV};
  for (auto& S : st) {
    S.list.push_back({Op::optimizer_step, -1, -1, -1});
    schedule.per_stage.push_back(std::move(S.list));
  }
  return schedule;
}

double zb_v_bubble_fraction(int stages, int micro_batches) {
  TESSEL_CHECK(stages >= 1 && micro_batches >= 1, ConfigError,
               "zb-v schedule: stages ({}) and micro_batches ({}) must be at least 1", stages,
               micro_batches);
  const double p = stages, m = micro_batches;
  return (p - 1) / (6 * m + p - 1);
}

double zb_h1_bubble_fraction(int stages, int micro_batches) {
  check_sizes(stages, micro_batches);
  const double p = stages, m = micro_batches;
  const double makespan = micro_batches >= stages ? 3 * m + p - 1 : 2 * (m + p) - 1;
  return 1.0 - 3 * m / makespan;
}

}  // namespace tessel::schedule
