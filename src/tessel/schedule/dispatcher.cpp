#include "tessel/schedule/dispatcher.h"

#include <fmt/format.h>

#include "tessel/core/check.h"

namespace tessel::schedule {

StageDispatcher::StageDispatcher(const DispatchOptions& options) : o_(options) {
  TESSEL_CHECK(o_.chunks >= 1 && o_.micro_batches >= 1, ConfigError,
               "StageDispatcher: chunks ({}) and micro_batches ({}) must be >= 1", o_.chunks,
               o_.micro_batches);
  TESSEL_CHECK(o_.memory_cap >= 1, ConfigError,
               "StageDispatcher: memory_cap must be at least 1 micro-batch of activations, got {}",
               o_.memory_cap);
  TESSEL_CHECK(o_.backward_cap >= 0, ConfigError,
               "StageDispatcher: backward_cap must be 0 (none) or at least 1, got {}",
               o_.backward_cap);
  TESSEL_CHECK(o_.first_chunk >= -1 && o_.first_chunk < o_.chunks && o_.last_chunk >= -1 &&
                   o_.last_chunk < o_.chunks,
               ConfigError,
               "StageDispatcher: first_chunk ({}) and last_chunk ({}) must be a local chunk in "
               "[0, {}) or -1 for none",
               o_.first_chunk, o_.last_chunk, o_.chunks);
  const size_t n = size_t(o_.micro_batches) * size_t(o_.chunks);
  forward_seen_.assign(n, 0);
  backward_seen_.assign(n, 0);
  forward_done_.assign(n, 0);
  next_forward_.assign(size_t(o_.chunks), 0);
  next_backward_.assign(size_t(o_.chunks), 0);
  held_.assign(size_t(o_.micro_batches), 0);
  if (o_.first_chunk >= 0) {
    for (int mb = 0; mb < o_.micro_batches; ++mb) forward_seen_[index(mb, o_.first_chunk)] = 1;
    forwards_waiting_ = o_.micro_batches;
  }
}

void StageDispatcher::check_indexes(const char* what, int micro_batch, int chunk) const {
  TESSEL_CHECK(
      micro_batch >= 0 && micro_batch < o_.micro_batches && chunk >= 0 && chunk < o_.chunks,
      InvalidArgumentError,
      "StageDispatcher::{}: micro_batch {} or chunk {} out of range ({} micro-batches, {} "
      "chunks)",
      what, micro_batch, chunk, o_.micro_batches, o_.chunks);
}

void StageDispatcher::forward_ready(int micro_batch, int chunk) {
  check_indexes("forward_ready", micro_batch, chunk);
  TESSEL_CHECK(chunk != o_.first_chunk, InvalidArgumentError,
               "StageDispatcher::forward_ready: chunk {} is virtual stage 0, whose forwards read "
               "the batch and are ready from the start; do not report them",
               chunk);
  char& seen = forward_seen_[index(micro_batch, chunk)];
  TESSEL_CHECK(!seen, InvalidArgumentError,
               "StageDispatcher::forward_ready: the input of forward {}.{} was reported twice",
               micro_batch, chunk);
  seen = 1;
  ++forwards_waiting_;
}

void StageDispatcher::backward_ready(int micro_batch, int chunk) {
  check_indexes("backward_ready", micro_batch, chunk);
  TESSEL_CHECK(chunk != o_.last_chunk, InvalidArgumentError,
               "StageDispatcher::backward_ready: chunk {} is the last virtual stage, whose "
               "backward becomes ready when its forward finishes; do not report it",
               chunk);
  const size_t i = index(micro_batch, chunk);
  TESSEL_CHECK(forward_done_[i], InvalidArgumentError,
               "StageDispatcher::backward_ready: the gradient of {}.{} arrived before its forward "
               "finished here",
               micro_batch, chunk);
  TESSEL_CHECK(!backward_seen_[i], InvalidArgumentError,
               "StageDispatcher::backward_ready: the gradient of {}.{} was reported twice",
               micro_batch, chunk);
  backward_seen_[i] = 1;
}

int StageDispatcher::oldest_held() const {
  // Holdings only start at a micro-batch above every held one (chunk 0's forwards run in order)
  // or at one already held, so the bound only moves up; next() lowers it if that ever fails.
  while (held_[size_t(oldest_)] == 0) ++oldest_;
  return oldest_;
}

bool StageDispatcher::admits(int micro_batch) const {
  if (in_flight_ > 0 && micro_batch <= oldest_held()) return true;
  return in_flight_ < o_.memory_cap && (o_.backward_cap == 0 || awaiting_ < o_.backward_cap);
}

std::optional<Instruction> StageDispatcher::next() {
  TESSEL_CHECK(!running_, InvalidArgumentError,
               "StageDispatcher::next: {} is still running; call finished() on it first",
               to_string(current_));
  if (started_ == computes_total()) return std::nullopt;
  const int m = o_.micro_batches;
  // The oldest ready backward of `c`, or m.
  auto ready_backward = [&](int c) {
    const int k = next_backward_[size_t(c)];
    return k < m && backward_seen_[index(k, c)] ? k : m;
  };
  // The oldest ready backward past the first virtual stage; for equal micro-batches the later
  // chunk (scanned first).
  int back_mb = m, back_chunk = -1;
  for (int c = o_.chunks - 1; c >= 0; --c) {
    if (c == o_.first_chunk) continue;
    if (const int k = ready_backward(c); k < back_mb) back_mb = k, back_chunk = c;
  }
  // The lowest ready (micro_batch, chunk) forward. The caps' test depends only on the
  // micro-batch and admits older ones more easily, so if it refuses this one it refuses all.
  int fwd_mb = m, fwd_chunk = -1;
  for (int c = 0; c < o_.chunks; ++c) {
    const int k = next_forward_[size_t(c)];
    if (k < m && k < fwd_mb && forward_seen_[index(k, c)]) fwd_mb = k, fwd_chunk = c;
  }
  const bool forward_admitted = fwd_chunk >= 0 && admits(fwd_mb);
  Instruction in;
  auto backward = [&](int k, int c) {
    in = {o_.split_backward ? Op::backward_input : Op::backward, k, c, -1};
    ++next_backward_[size_t(c)];
  };
  if (forward_admitted && (o_.backward_cap > 0 || back_chunk < 0)) {
    // 1 (with a backward cap) or 3 (no backward ready): the forward.
    in = {Op::forward, fwd_mb, fwd_chunk, -1};
    ++next_forward_[size_t(fwd_chunk)];
    --forwards_waiting_;
    if (in_flight_ == 0 || fwd_mb < oldest_) oldest_ = fwd_mb;
    ++held_[size_t(fwd_mb)];
    ++in_flight_;
    ++awaiting_;
  } else if (back_chunk >= 0) {
    backward(back_mb, back_chunk);  // 2.
  } else if (!weight_.empty()) {
    // 4. Weight gradients fill the time nothing else may use.
    in = weight_.front();
    weight_.pop();
  } else if (const int k = o_.first_chunk >= 0 ? ready_backward(o_.first_chunk) : m; k < m) {
    backward(k, o_.first_chunk);  // 5.
  } else {
    return std::nullopt;  // 6. waits for data (or for memory: the oldest will free some)
  }
  ++started_;
  running_ = true;
  current_ = in;
  return in;
}

void StageDispatcher::finished(const Instruction& compute) {
  TESSEL_CHECK(running_ && compute == current_, InvalidArgumentError,
               "StageDispatcher::finished: {} is not the running compute ({})", to_string(compute),
               running_ ? to_string(current_) : std::string("none"));
  running_ = false;
  const size_t i = index(compute.micro_batch, compute.chunk);
  auto release = [&] {
    --held_[size_t(compute.micro_batch)];
    --in_flight_;
  };
  switch (compute.op) {
    case Op::forward:
      forward_done_[i] = 1;
      if (compute.chunk == o_.last_chunk) backward_seen_[i] = 1;  // the loss is here
      break;
    case Op::backward_input:
      --awaiting_;
      weight_.push({Op::backward_weight, compute.micro_batch, compute.chunk, -1});
      break;
    case Op::backward:
      --awaiting_;
      release();
      break;
    case Op::backward_weight:
      release();
      break;
    default:
      break;  // next() only hands out computes, and current_ is one of them
  }
}

bool StageDispatcher::done() const {
  return started_ == computes_total() && !running_;
}

int StageDispatcher::computes_total() const {
  return o_.micro_batches * o_.chunks * (o_.split_backward ? 3 : 2);
}

std::string StageDispatcher::describe() const {
  return fmt::format("{} of {} computes run, {} activations held of cap {}, {} forwards ready",
                     started_, computes_total(), in_flight_, o_.memory_cap, forwards_waiting_);
}

}  // namespace tessel::schedule
