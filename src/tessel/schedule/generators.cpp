#include "tessel/schedule/generators.h"

#include <algorithm>

#include "tessel/core/check.h"

namespace tessel::schedule {
namespace {

void check_sizes(const char* name, int stages, int micro_batches, int chunks) {
  TESSEL_CHECK(stages >= 1, ConfigError, "{} schedule: stages must be at least 1, got {}", name,
               stages);
  TESSEL_CHECK(micro_batches >= 1, ConfigError,
               "{} schedule: micro_batches must be at least 1, got {}", name, micro_batches);
  TESSEL_CHECK(chunks >= 1, ConfigError, "{} schedule: chunks must be at least 1, got {}", name,
               chunks);
}

// Appends one stage's compute together with the receive before it and the send after it, so
// every generator places communication the same way.
class StageWriter {
 public:
  StageWriter(const Schedule& schedule, int stage)
      : p_(schedule.stages), s_(stage), last_vs_(schedule.stages * schedule.chunks - 1) {}

  void forward(int mb, int chunk) {
    int vs = virtual_stage(p_, s_, chunk);
    if (vs > 0 && p_ > 1) add(Op::recv_activation, mb, chunk, prev());
    add(Op::forward, mb, chunk);
    if (vs < last_vs_ && p_ > 1) add(Op::send_activation, mb, chunk, next());
  }

  void backward(int mb, int chunk) {
    int vs = virtual_stage(p_, s_, chunk);
    if (vs < last_vs_ && p_ > 1) add(Op::recv_grad, mb, chunk, next());
    add(Op::backward, mb, chunk);
    if (vs > 0 && p_ > 1) add(Op::send_grad, mb, chunk, prev());
  }

  std::vector<Instruction> finish() {
    add(Op::optimizer_step, -1, -1);
    return std::move(list_);
  }

 private:
  int prev() const { return (s_ + p_ - 1) % p_; }
  int next() const { return (s_ + 1) % p_; }
  void add(Op op, int mb, int chunk, int peer = -1) { list_.push_back({op, mb, chunk, peer}); }

  int p_, s_, last_vs_;
  std::vector<Instruction> list_;
};

Schedule empty(const char* name, int stages, int micro_batches, int chunks) {
  return Schedule{name, stages, micro_batches, chunks, {}};
}

}  // namespace

Schedule gpipe(int stages, int micro_batches) {
  check_sizes("gpipe", stages, micro_batches, 1);
  Schedule schedule = empty("gpipe", stages, micro_batches, 1);
  for (int s = 0; s < stages; ++s) {
    StageWriter w(schedule, s);
    for (int mb = 0; mb < micro_batches; ++mb) w.forward(mb, 0);
    for (int mb = 0; mb < micro_batches; ++mb) w.backward(mb, 0);
    schedule.per_stage.push_back(w.finish());
  }
  return schedule;
}

Schedule one_f_one_b(int stages, int micro_batches) {
  check_sizes("1f1b", stages, micro_batches, 1);
  Schedule schedule = empty("1f1b", stages, micro_batches, 1);
  for (int s = 0; s < stages; ++s) {
    StageWriter w(schedule, s);
    // Later stages get their first gradient sooner, so they need fewer forwards in flight.
    int warmup = std::min(stages - s - 1, micro_batches);
    for (int mb = 0; mb < warmup; ++mb) w.forward(mb, 0);
    for (int i = 0; i < micro_batches - warmup; ++i) {
      w.forward(warmup + i, 0);
      w.backward(i, 0);
    }
    for (int mb = micro_batches - warmup; mb < micro_batches; ++mb) w.backward(mb, 0);
    schedule.per_stage.push_back(w.finish());
  }
  return schedule;
}

Schedule interleaved_one_f_one_b(int stages, int micro_batches, int chunks) {
  check_sizes("interleaved-1f1b", stages, micro_batches, chunks);
  TESSEL_CHECK(chunks == 1 || micro_batches % stages == 0, ConfigError,
               "interleaved-1f1b schedule: micro_batches ({}) must be a multiple of stages ({}) "
               "when chunks > 1; round micro_batches up to {} or use chunks = 1",
               micro_batches, stages, (micro_batches + stages - 1) / stages * stages);
  Schedule schedule = empty("interleaved-1f1b", stages, micro_batches, chunks);
  const int p = stages, v = chunks, total = micro_batches * chunks;

  // The k-th forward (or backward) of a stage, k in [0, v * m): groups of p micro-batches, each
  // group visiting the chunks in order (forward) or in reverse (backward).
  auto micro_batch_of = [&](int k) { return k / (p * v) * p + k % p; };
  auto forward_chunk = [&](int k) { return k % (p * v) / p; };
  auto backward_chunk = [&](int k) { return v - 1 - forward_chunk(k); };

  for (int s = 0; s < stages; ++s) {
    // Megatron-LM's counts (v0.7, the version with the m % p rule). The second forward per
    // later stage is slack Megatron does not explain, presumably for link latency: in validate's
    // dry run (free communication) p - s - 1 + (v - 1) * p reaches the same bubble.
    int warmup;
    if (chunks == 1)
      warmup = std::min(p - s - 1, micro_batches);
    else if (micro_batches == p)
      warmup = total;
    else
      warmup = std::min(2 * (p - s - 1) + (v - 1) * p, total);

    StageWriter w(schedule, s);
    for (int k = 0; k < warmup; ++k) w.forward(micro_batch_of(k), forward_chunk(k));
    for (int i = 0; i < total - warmup; ++i) {
      w.forward(micro_batch_of(warmup + i), forward_chunk(warmup + i));
      w.backward(micro_batch_of(i), backward_chunk(i));
    }
    for (int k = total - warmup; k < total; ++k) w.backward(micro_batch_of(k), backward_chunk(k));
    schedule.per_stage.push_back(w.finish());
  }
  return schedule;
}

Schedule with_jit_recompute(const Schedule& s) {
  Schedule out = s;
  out.name = s.name + "+jit";
  for (auto& list : out.per_stage) {
    // Per chunk, the micro-batch whose activations are resident (-1: none).
    std::vector<int> resident(size_t(s.chunks), -1);
    std::vector<Instruction> with;
    with.reserve(list.size() + size_t(s.micro_batches * s.chunks));
    for (size_t i = 0; i < list.size(); ++i) {
      const Instruction& in = list[i];
      TESSEL_CHECK(in.op != Op::backward_input && in.op != Op::backward_weight, ConfigError,
                   "schedule '{}' splits its backward passes; just-in-time recomputation needs "
                   "whole ones (gpipe, 1f1b, interleaved-1f1b)",
                   s.name);
      if (in.op == Op::forward) resident[size_t(in.chunk)] = in.micro_batch;
      // The R goes before the B's receive, or before the B when it has none.
      const bool starts_backward =
          in.op == Op::recv_grad ||
          (in.op == Op::backward &&
           (with.empty() || with.back().op != Op::recv_grad ||
            with.back().micro_batch != in.micro_batch || with.back().chunk != in.chunk));
      if (starts_backward && resident[size_t(in.chunk)] != in.micro_batch) {
        with.push_back({Op::recompute, in.micro_batch, in.chunk, -1});
        resident[size_t(in.chunk)] = in.micro_batch;
      }
      with.push_back(in);
    }
    list = std::move(with);
  }
  return out;
}

}  // namespace tessel::schedule
