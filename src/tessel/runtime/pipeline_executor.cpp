#include "tessel/runtime/pipeline_executor.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>

#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/schedule/dispatcher.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/named.h"

namespace tessel::runtime {

namespace {

enum class Kind : uint32_t { activation = 0, grad = 1 };

// Pipeline messages are matched by (micro-batch, virtual stage of the sender, kind).
uint32_t message_tag(int micro_batch, int sender_vs, int num_vs, Kind kind) {
  return ((uint32_t(micro_batch) * uint32_t(num_vs) + uint32_t(sender_vs)) << 1) | uint32_t(kind);
}

// The adaptive schedule's messages: the sender's running count to that peer, in a tag range the
// lists' tags (bounded by 2 M p v) never reach.
uint32_t sequence_tag(uint32_t k) {
  return 0x40000000u | k;
}

double parse_number(std::string_view field, std::string_view value, std::string_view spec) {
  double x = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), x);
  TESSEL_CHECK(ec == std::errc() && end == value.data() + value.size(), ConfigError,
               "TESSEL_PIPELINE_DELAY '{}': {} '{}' is not a number", spec, field, value);
  return x;
}

}  // namespace

DelayInjection DelayInjection::parse(std::string_view spec) {
  DelayInjection d;
  size_t at = 0;
  while (at < spec.size()) {
    size_t comma = spec.find(',', at);
    if (comma == std::string_view::npos) comma = spec.size();
    const std::string_view item = spec.substr(at, comma - at);
    at = comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    TESSEL_CHECK(eq != std::string_view::npos, ConfigError,
                 "TESSEL_PIPELINE_DELAY '{}': '{}' is not key=value (keys: stage, slowdown, "
                 "jitter, seed, dilate)",
                 spec, item);
    const std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    const double x = parse_number(key, value, spec);
    if (key == "stage") {
      TESSEL_CHECK(x == double(int(x)) && x >= -1, ConfigError,
                   "TESSEL_PIPELINE_DELAY '{}': stage must be a pipeline rank or -1", spec);
      d.stage = int(x);
    } else if (key == "slowdown") {
      d.slowdown = x;
    } else if (key == "jitter") {
      TESSEL_CHECK(x >= 0 && x < 1, ConfigError,
                   "TESSEL_PIPELINE_DELAY '{}': jitter {} must be in [0, 1)", spec, x);
      d.jitter = x;
    } else if (key == "dilate") {
      TESSEL_CHECK(std::isfinite(x) && x >= 1, ConfigError,
                   "TESSEL_PIPELINE_DELAY '{}': dilate {} must be >= 1 (a delay can only add "
                   "time)",
                   spec, x);
      d.dilate = x;
    } else if (key == "seed") {
      TESSEL_CHECK(x >= 0 && x == double(uint64_t(x)), ConfigError,
                   "TESSEL_PIPELINE_DELAY '{}': seed must be a non-negative integer", spec);
      d.seed = uint64_t(x);
    } else {
      TESSEL_THROW(ConfigError,
                   "TESSEL_PIPELINE_DELAY '{}': unknown key '{}' (keys: stage, slowdown, jitter, "
                   "seed, dilate)",
                   spec, key);
    }
  }
  TESSEL_CHECK(std::isfinite(d.slowdown) && d.dilate * d.slowdown * (1 - d.jitter) >= 1,
               ConfigError,
               "TESSEL_PIPELINE_DELAY '{}': dilate x slowdown x (1 - jitter) = {} must be >= 1 (a "
               "delay can only add time); raise slowdown to at least 1 / (dilate (1 - jitter))",
               spec, d.dilate * d.slowdown * (1 - d.jitter));
  return d;
}

schedule::Schedule pipeline_schedule(const layout::Plan& plan) {
  schedule::Schedule s = schedule::make_schedule(layout::schedule_name(plan.schedule), plan.pp,
                                                 int(plan.micro_batches), plan.virtual_stages);
  if (plan.jit_recompute) s = schedule::with_jit_recompute(s);
  return s;
}

std::vector<schedule::Instruction> pipeline_program(const layout::Plan& plan, int pp) {
  return pipeline_schedule(plan).per_stage[size_t(pp)];
}

std::vector<int> send_release_points(const schedule::Schedule& s, int pp) {
  using schedule::Op;
  auto vs_of = [&](int stage, int chunk) {
    return schedule::virtual_stage(s.stages, stage, chunk, s.placement);
  };
  // The receive in `list` (of rank `at`) of the message `send` (of rank `from`) carries.
  auto receive_of = [&](const std::vector<schedule::Instruction>& list, int at, int from,
                        const schedule::Instruction& send) {
    const bool act = send.op == Op::send_activation;
    const int to_vs = vs_of(from, send.chunk) + (act ? 1 : -1);
    for (size_t j = 0; j < list.size(); ++j) {
      const auto& r = list[j];
      if (r.op == (act ? Op::recv_activation : Op::recv_grad) && r.peer == from &&
          r.micro_batch == send.micro_batch && vs_of(at, r.chunk) == to_vs)
        return int(j);
    }
    return -1;
  };
  const auto& mine = s.per_stage[size_t(pp)];
  std::vector<int> release(mine.size(), -2);
  for (size_t i = 0; i < mine.size(); ++i) {
    if (!schedule::is_send(mine[i].op)) continue;
    release[i] = -1;
    const int peer = mine[i].peer;
    const auto& theirs = s.per_stage[size_t(peer)];
    const int j = receive_of(theirs, peer, pp, mine[i]);
    if (j < 0) continue;
    for (size_t k = size_t(j) + 1; k < theirs.size(); ++k) {
      if (!schedule::is_send(theirs[k].op) || theirs[k].peer != pp) continue;
      release[i] = receive_of(mine, pp, peer, theirs[k]);
      break;
    }
  }
  return release;
}

int send_buffers(const schedule::Schedule& s, int pp) {
  const auto release = send_release_points(s, pp);
  std::vector<int> frees(release.size(), 0);
  int live = 0, peak = 0;
  for (size_t i = 0; i < release.size(); ++i) {
    live -= frees[i];
    if (release[i] >= -1) {
      peak = std::max(peak, ++live);
      if (release[i] >= 0) ++frees[size_t(release[i])];
    }
  }
  return peak;
}

std::vector<int> activation_peaks(const std::vector<schedule::Instruction>& program, int chunks) {
  std::vector<int> peak(size_t(chunks), 1), live(peak.size(), 0);
  for (const auto& ins : program) {
    if (ins.op == schedule::Op::forward) {
      int& n = live[size_t(ins.chunk)];
      peak[size_t(ins.chunk)] = std::max(peak[size_t(ins.chunk)], ++n);
    } else if (ins.op == schedule::Op::backward || ins.op == schedule::Op::backward_weight) {
      --live[size_t(ins.chunk)];  // a Bw still reads the stored activations; it frees them
    }
  }
  return peak;
}

std::vector<int> activation_slots(const layout::Plan& plan, int pp) {
  // Just-in-time recomputation keeps one micro-batch's activations per chunk.
  if (plan.jit_recompute) return std::vector<int>(size_t(plan.virtual_stages), 1);
  if (plan.schedule != layout::ScheduleKind::adaptive)
    return activation_peaks(pipeline_program(plan, pp), plan.virtual_stages);
  const int64_t held = int64_t(plan.dispatch_cap(pp)) + plan.virtual_stages - 1;
  return std::vector<int>(size_t(plan.virtual_stages),
                          int(std::min<int64_t>(plan.micro_batches, held)));
}

int receive_buffers(const layout::Plan& plan, int pp) {
  const int stages = plan.num_stages(), v = plan.virtual_stages;
  auto rank_of = [&](int vs) { return plan.pp_rank_of_stage(vs); };
  if (plan.schedule == layout::ScheduleKind::adaptive)
    return plan.holds_adjacent_stages(pp) ? 2 * (plan.dispatch_cap(pp) + v - 1) : 0;
  const auto program = pipeline_program(plan, pp);
  std::vector<size_t> recvs;
  for (size_t i = 0; i < program.size(); ++i)
    if (schedule::is_recv(program[i].op)) recvs.push_back(i);
  const size_t lookahead = size_t(schedule::kReceiveLookahead * v);
  int live = 0, peak = 0;
  auto take = [&] { peak = std::max(peak, ++live); };
  size_t posted = 0, waited = 0;
  auto post_through = [&](size_t count) {
    for (; posted < std::min(count, recvs.size()); ++posted) take();
  };
  post_through(lookahead);
  for (const auto& ins : program) {
    const int vs = plan.stage_of(pp, ins.chunk);
    const bool first = vs == 0, last = vs == stages - 1;
    switch (ins.op) {
      case schedule::Op::forward:
        if (!first && !plan.jit_recompute) --live;
        if (!last && rank_of(vs + 1) == pp) take();
        break;
      case schedule::Op::backward:
      case schedule::Op::backward_input:
        if (!last) --live;
        if (!first && plan.jit_recompute) --live;
        if (!first && rank_of(vs - 1) == pp) take();
        break;
      case schedule::Op::recv_activation:
      case schedule::Op::recv_grad:
        post_through(++waited + lookahead);
        break;
      default:
        break;
    }
  }
  return peak;
}

PipelineExecutor::PipelineExecutor(const layout::Plan& plan, int pp, int64_t seq_len,
                                   int64_t hidden)
    : program_(plan.schedule == layout::ScheduleKind::adaptive
                   ? std::vector<schedule::Instruction>{}
                   : pipeline_program(plan, pp)),
      slots_(runtime::activation_slots(plan, pp)),
      num_vs_(plan.num_stages()),
      jit_(plan.jit_recompute),
      B_(plan.micro_batch),
      T_(seq_len),
      C_(hidden),
      M_(plan.micro_batches),
      pp_(pp) {
  for (int vs = 0; vs < num_vs_; ++vs) {
    rank_of_vs_.push_back(plan.pp_rank_of_stage(vs));
    chunk_of_vs_.push_back(plan.chunk_of_stage(vs));
  }
  const size_t at_count = size_t(plan.virtual_stages * M_);
  act_buf_.assign(at_count, -1);
  grad_buf_.assign(at_count, -1);
  act_src_.assign(at_count, nullptr);
  grad_src_.assign(at_count, nullptr);
  if (!program_.empty()) {
    const auto sched = pipeline_schedule(plan);
    send_release_ = send_release_points(sched, pp);
    released_at_.assign(program_.size(), {});
    send_pool_.allocate(size_t(send_buffers(sched, pp)), size_t(B_ * T_ * C_));
  }
  receive_lookahead_ = size_t(schedule::kReceiveLookahead * plan.virtual_stages);
  // Allocated once: no step allocates a boundary buffer.
  receive_pool_.allocate(size_t(runtime::receive_buffers(plan, pp)), size_t(B_ * T_ * C_));
  for (size_t i = 0; i < program_.size(); ++i)
    if (schedule::is_recv(program_[i].op)) recv_order_.push_back(i);
  adaptive_ = plan.schedule == layout::ScheduleKind::adaptive;
  if (!adaptive_) return;
  // The dispatcher's send pool starts empty and grows while that many messages are in flight.
  send_pool_.floats = size_t(B_ * T_ * C_) + kTrailerFloats;
  cap_ = plan.dispatch_cap(pp);
  backward_cap_ = plan.dispatch_backward_cap(pp);
  // One arrival per distinct neighbouring rank, expecting M messages per chunk edge it feeds.
  const size_t boundary = size_t(B_ * T_ * C_);
  auto expect = [&](int peer) {
    if (peer == pp_) return;  // a neighbouring virtual stage on this rank: passed by copy
    auto it = std::find_if(arrivals_.begin(), arrivals_.end(),
                           [&](const Arrival& a) { return a.peer == peer; });
    if (it == arrivals_.end()) {
      arrivals_.emplace_back();
      it = std::prev(arrivals_.end());
      it->peer = peer;
    }
    it->expected += int(M_);
  };
  for (int c = 0; c < plan.virtual_stages; ++c) {
    const int vs = plan.stage_of(pp, c);
    if (vs > 0) expect(rank_of_vs_[size_t(vs - 1)]);
    if (vs + 1 < num_vs_) expect(rank_of_vs_[size_t(vs + 1)]);
  }
  for (auto& a : arrivals_) {
    a.buffers.assign(size_t(a.expected), std::vector<float>(boundary + kTrailerFloats));
    a.requests.reserve(size_t(a.expected));
  }
}

PipelineExecutor::~PipelineExecutor() {
  join_arrivals();
}

void PipelineExecutor::BufferPool::allocate(size_t count, size_t floats_each) {
  floats = floats_each;
  buffers.assign(count, std::vector<float>(floats_each));
  reset();
}

void PipelineExecutor::BufferPool::reset() {
  free.clear();
  for (size_t b = buffers.size(); b-- > 0;) free.push_back(int(b));
}

int PipelineExecutor::BufferPool::take() {
  if (free.empty()) return -1;
  const int b = free.back();
  free.pop_back();
  return b;
}

int PipelineExecutor::BufferPool::take_or_grow() {
  if (free.empty()) {
    free.push_back(int(buffers.size()));
    buffers.emplace_back(floats);
  }
  return take();
}

float* PipelineExecutor::take_buffer(std::vector<int>& held, std::vector<const float*>& src,
                                     size_t at) {
  TESSEL_CHECK(held[at] < 0, Error,
               "internal: boundary buffer {} taken twice in a step (micro-batch {}, chunk {})", at,
               at % size_t(M_), at / size_t(M_));
  held[at] = receive_pool_.take();
  TESSEL_CHECK(held[at] >= 0, Error,
               "internal: pipeline rank {} needs more than the {} boundary buffers "
               "receive_buffers() counted (micro-batch {}, chunk {})",
               pp_, receive_pool_.buffers.size(), at % size_t(M_), at / size_t(M_));
  float* data = receive_pool_.data(held[at]);
  src[at] = data;
  return data;
}

void PipelineExecutor::give_back(std::vector<int>& held, size_t at) {
  if (held[at] < 0) return;  // an arrival buffer (adaptive), or the embedding stage's tokens
  receive_pool_.give(held[at]);
  held[at] = -1;
}

void PipelineExecutor::reset_buffers() {
  std::fill(act_buf_.begin(), act_buf_.end(), -1);
  std::fill(grad_buf_.begin(), grad_buf_.end(), -1);
  std::fill(act_src_.begin(), act_src_.end(), nullptr);
  std::fill(grad_src_.begin(), grad_src_.end(), nullptr);
  receive_pool_.reset();
  send_pool_.reset();
}

void PipelineExecutor::set_delay(const DelayInjection& delay) {
  delay_ = delay;
  delay_rng_.seed(delay.seed + uint64_t(pp_));
}

void PipelineExecutor::join_arrivals() noexcept {
  for (auto& a : arrivals_)
    if (a.thread.joinable()) a.thread.join();
}

void PipelineExecutor::abort() noexcept {
  join_arrivals();
  for (auto& a : arrivals_) a.requests.clear();
  recvs_.clear();
  sends_.clear();
  choice_sends_.clear();
}

float* PipelineExecutor::list_send_buffer(size_t at, const float* data) {
  const int b = send_pool_.take();
  TESSEL_CHECK(b >= 0, Error,
               "internal: pipeline rank {} has no free send buffer of the {} send_buffers() "
               "counted at instruction {}",
               pp_, send_pool_.buffers.size(), at);
  if (send_release_[at] >= 0) released_at_[size_t(send_release_[at])].push_back(b);
  float* buf = send_pool_.data(b);
  std::copy(data, data + B_ * T_ * C_, buf);
  return buf;
}

// Gives micro-batch mb a free activation slot of the chunk (under just-in-time recomputation
// its one slot, dropping the activations of the micro-batch that held it: that one's backward
// recomputes them) and runs the chunk's forward there on its input: the batch's tokens, or the
// received (or copied) activation. Returns the loss sum on the head stage (0 elsewhere).
double PipelineExecutor::forward_into_slot(Chunk& ch, int c, int mb, const int32_t* inputs,
                                           const int32_t* targets, float grad_scale) {
  if (jit_) evict(ch);
  TESSEL_CHECK(ch.slot_of[size_t(mb)] < 0 && !ch.free_slots.empty(), Error,
               "internal: no free activation slot for micro-batch {} on virtual stage {} (the "
               "slots are sized from the schedule's peak in-flight micro-batches)",
               mb, ch.vs);
  const int slot = ch.free_slots.back();
  ch.free_slots.pop_back();
  ch.slot_of[size_t(mb)] = slot;
  auto& m = *ch.model;
  if (!ch.range.has_embedding) {
    const size_t at = size_t(c * M_ + mb);
    const float* in = act_src_[at];
    TESSEL_CHECK(in != nullptr, Error,
                 "internal: forward of micro-batch {} on virtual stage {} before its input", mb,
                 ch.vs);
    std::copy(in, in + B_ * T_ * C_, m.input_hidden(slot).data<float>());
    if (!jit_) give_back(act_buf_, at);  // a recompute reads it again: kept until the backward
  }
  const int32_t* first = ch.range.has_embedding ? inputs + mb * B_ * T_ : nullptr;
  if (ch.range.has_head)
    return m.forward_stage(first, targets + mb * B_ * T_, grad_scale, slot).loss_sum;
  m.forward_stage(first, nullptr, std::nullopt, slot);
  return 0;
}

// Runs the chunk's forward on micro-batch mb in a free activation slot; returns the loss sum on
// the head stage (0 elsewhere).
double PipelineExecutor::forward(Stage& stage, int c, int mb, const int32_t* inputs,
                                 const int32_t* targets, float grad_scale) {
  Chunk& ch = stage.chunks()[size_t(c)];
  const double loss = forward_into_slot(ch, c, mb, inputs, targets, grad_scale);
  // The next virtual stage on this rank (the turn of a V) reads the output here, not from a
  // message.
  if (local_next(ch.vs)) {
    const float* out = ch.model->output_hidden(ch.slot_of[size_t(mb)]).data<float>();
    std::copy(out, out + B_ * T_ * C_,
              take_buffer(act_buf_, act_src_, size_t(chunk_of_vs(ch.vs + 1) * M_ + mb)));
  }
  return loss;
}

// Just-in-time recomputation: the chunk's one slot is given to the next forward or recompute,
// dropping the activations of the micro-batch that held it (its backward recomputes them).
void PipelineExecutor::evict(Chunk& ch) {
  for (size_t mb = 0; mb < ch.slot_of.size(); ++mb) {
    if (ch.slot_of[mb] < 0) continue;
    ch.free_slots.push_back(ch.slot_of[mb]);
    ch.slot_of[mb] = -1;
  }
}

// Re-runs micro-batch mb's forward on chunk c, unless its activations are still in the slot. The
// same kernels on the same input give the same activations, so the backward is bit-identical to
// one that kept them; on the head stage the loss is computed again and dropped (the output for a
// local next stage was copied by the first forward already).
void PipelineExecutor::recompute(Stage& stage, int c, int mb, const int32_t* inputs,
                                 const int32_t* targets, float grad_scale) {
  Chunk& ch = stage.chunks()[size_t(c)];
  if (ch.slot_of[size_t(mb)] >= 0) return;
  forward_into_slot(ch, c, mb, inputs, targets, grad_scale);
}

// The input gradient a backward (or Bi) left, for the previous virtual stage when it is on this
// rank: input_grad() is scratch the next backward overwrites.
void PipelineExecutor::keep_input_grad(Chunk& ch, int mb) {
  if (!local_prev(ch.vs)) return;
  const float* g = ch.model->input_grad().data<float>();
  std::copy(g, g + B_ * T_ * C_,
            take_buffer(grad_buf_, grad_src_, size_t(chunk_of_vs(ch.vs - 1) * M_ + mb)));
}

// The slot holding micro-batch mb's activations on chunk c, its output gradient filled in from
// what arrived (not on the head stage, which starts from its loss): what B and Bi both start from.
int PipelineExecutor::begin_backward(Chunk& ch, int c, int mb) {
  const int slot = ch.slot_of[size_t(mb)];
  TESSEL_CHECK(slot >= 0, Error,
               "internal: backward of micro-batch {} on virtual stage {} without its forward", mb,
               ch.vs);
  const size_t at = size_t(c * M_ + mb);
  if (!ch.range.has_head) {
    const float* g = grad_src_[at];
    TESSEL_CHECK(g != nullptr, Error,
                 "internal: backward of micro-batch {} on virtual stage {} before its gradient", mb,
                 ch.vs);
    std::copy(g, g + B_ * T_ * C_, ch.model->output_grad(slot).data<float>());
    give_back(grad_buf_, at);
  }
  if (jit_) give_back(act_buf_, at);  // no recompute of this micro-batch follows
  return slot;
}

// The gradient-ready report for the pass that finishes chunk c's last weight gradients of the
// step (B or Bw), empty for the others.
model::Transformer::GradsReady PipelineExecutor::grads_ready(
    Chunk& ch, int c, const LastBackwardHook& last_backward) {
  if (++ch.backwards_done == M_ && last_backward) return last_backward(c);
  return {};
}

// Frees micro-batch mb's activation slot once its last backward pass (B or Bw) ran.
void PipelineExecutor::release_slot(Chunk& ch, int mb) {
  ch.free_slots.push_back(ch.slot_of[size_t(mb)]);
  ch.slot_of[size_t(mb)] = -1;
}

void PipelineExecutor::backward_input(Stage& stage, int c, int mb) {
  Chunk& ch = stage.chunks()[size_t(c)];
  ch.model->backward_input_stage(begin_backward(ch, c, mb));
  keep_input_grad(ch, mb);
}

void PipelineExecutor::backward_weight(Stage& stage, int c, int mb,
                                       const LastBackwardHook& last_backward) {
  Chunk& ch = stage.chunks()[size_t(c)];
  const int slot = ch.slot_of[size_t(mb)];
  TESSEL_CHECK(slot >= 0, Error,
               "internal: weight gradient of micro-batch {} on virtual stage {} without its "
               "forward",
               mb, ch.vs);
  ch.model->backward_weight_stage(slot, grads_ready(ch, c, last_backward));
  release_slot(ch, mb);
}

void PipelineExecutor::backward(Stage& stage, int c, int mb,
                                const LastBackwardHook& last_backward) {
  Chunk& ch = stage.chunks()[size_t(c)];
  const int slot = begin_backward(ch, c, mb);
  ch.model->backward_stage(slot, grads_ready(ch, c, last_backward));
  keep_input_grad(ch, mb);
  release_slot(ch, mb);
}

double PipelineExecutor::compute(Stage& stage, const schedule::Instruction& ins,
                                 const int32_t* inputs, const int32_t* targets, float grad_scale,
                                 const LastBackwardHook& last_backward) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto wall0 = tracing() ? StepTracer::Clock::now() : StepTracer::Clock::time_point{};
  const double cpu0 = delay_.dilate != 1 ? thread_cpu_seconds() : 0;
  const int mb = ins.micro_batch, c = ins.chunk;
  double loss = 0;
  switch (ins.op) {
    case schedule::Op::forward:
      loss = forward(stage, c, mb, inputs, targets, grad_scale);
      break;
    case schedule::Op::backward:
      backward(stage, c, mb, last_backward);
      break;
    case schedule::Op::backward_input:
      backward_input(stage, c, mb);
      break;
    case schedule::Op::backward_weight:
      backward_weight(stage, c, mb, last_backward);
      break;
    case schedule::Op::recompute:
      recompute(stage, c, mb, inputs, targets, grad_scale);
      break;
    default:
      TESSEL_THROW(Error, "internal: {} is not a compute", schedule::to_string(ins));
  }
  if (delay_.active()) {
    const double took = seconds_since(t0);
    // Dilated, the compute's own CPU time is what gets stretched: time the thread spent
    // preempted by another rank sharing its core is not compute a core of its own would do.
    const double base = delay_.dilate != 1 ? thread_cpu_seconds() - cpu0 : took;
    double factor = delay_.dilate;
    if (delay_.stage < 0 || delay_.stage == pp_) {
      const double u = std::uniform_real_distribution<double>(0, 1)(delay_rng_);
      factor *= delay_.slowdown * (1 + delay_.jitter * (2 * u - 1));
    }
    const double extra = base * factor - took;
    if (extra > 0) std::this_thread::sleep_for(std::chrono::duration<double>(extra));
  }
  if (tracing())
    tracer_->slice(schedule::to_string(ins), std::string(schedule::op_code(ins.op)), wall0,
                   StepTracer::Clock::now(), delay_.active() ? "with the injected delay" : "");
  return loss;
}

void PipelineExecutor::waited(PipelineStepResult& r, const WaitStart& w, const char* what,
                              const schedule::Instruction* ins) {
  r.idle_s += seconds_since(w.t0);
  if (tracing())
    tracer_->slice(
        ins != nullptr ? "wait " + schedule::to_string(*ins) : std::string("wait ") + what, "wait",
        w.wall0, StepTracer::Clock::now());
}

PipelineStepResult PipelineExecutor::run(Stage& stage, comm::Communicator& pp,
                                         const int32_t* inputs, const int32_t* targets,
                                         float grad_scale, const LastBackwardHook& last_backward,
                                         comm::Communicator* tp) {
  for (auto& ch : stage.chunks()) ch.backwards_done = 0;
  sends_.clear();
  PipelineStepResult r = adaptive_
                             ? run_adaptive(stage, pp, inputs, targets, grad_scale, last_backward,
                                            tp != nullptr && tp->size() > 1 ? tp : nullptr)
                             : run_list(stage, pp, inputs, targets, grad_scale, last_backward);
  return r;
}

PipelineStepResult PipelineExecutor::run_list(Stage& stage, comm::Communicator& pp,
                                              const int32_t* inputs, const int32_t* targets,
                                              float grad_scale,
                                              const LastBackwardHook& last_backward) {
  PipelineStepResult r;
  auto& chunks = stage.chunks();
  // The pipeline's idle time: waiting for a receive or for the last sends (the bubble, plus any
  // imbalance between stages), against the time the instruction list took.
  const auto pipeline_start = std::chrono::steady_clock::now();
  const size_t boundary = size_t(B_ * T_ * C_);
  // Receives are posted receive_lookahead_ ahead of the instruction that waits for them: Gloo's
  // transport moves a message once the receiver has posted it, so posting at the wait would put
  // a handshake and the whole transfer on the critical path of every micro-batch; posting them
  // all up front would hold a buffer per message (a number that grows with the micro-batches).
  // A sender never blocks on a receive not yet posted (its sends are waited for at the end of
  // the step), and this rank waits for receive k only after posting it: no deadlock.
  reset_buffers();
  recvs_.clear();
  recvs_.resize(program_.size());
  size_t posted = 0;
  auto post_through = [&](size_t count) {
    for (; posted < std::min(count, recv_order_.size()); ++posted) {
      const size_t i = recv_order_[posted];
      const auto& ins = program_[i];
      const int mb = ins.micro_batch, c = ins.chunk;
      const size_t at = size_t(c * M_ + mb);
      if (ins.op == schedule::Op::recv_activation)
        recvs_[i] = pp.recv(take_buffer(act_buf_, act_src_, at), boundary * sizeof(float), ins.peer,
                            message_tag(mb, chunks[size_t(c)].vs - 1, num_vs_, Kind::activation));
      else
        recvs_[i] =
            pp.recv(take_buffer(grad_buf_, grad_src_, at), boundary * sizeof(float), ins.peer,
                    message_tag(mb, chunks[size_t(c)].vs + 1, num_vs_, Kind::grad));
    }
  };
  post_through(receive_lookahead_);
  size_t waited_for = 0;
  // Send buffers: each taken at its send and given back when the wait for the peer's next
  // message to this rank returns (send_release_points), or at the step's end.
  for (auto& r : released_at_) r.clear();
  size_t at = 0;  // the instruction being run
  auto send = [&](const float* data, int peer, uint32_t tag) {
    sends_.push_back(pp.send(list_send_buffer(at, data), boundary * sizeof(float), peer, tag));
  };
  for (size_t i = 0; i < program_.size(); ++i) {
    at = i;
    const auto& ins = program_[i];
    const int mb = ins.micro_batch, c = ins.chunk;
    auto& ch = chunks[size_t(c)];
    switch (ins.op) {
      case schedule::Op::forward:
      case schedule::Op::backward:
      case schedule::Op::backward_input:
      case schedule::Op::backward_weight:
      case schedule::Op::recompute:
        r.loss_sum += compute(stage, ins, inputs, targets, grad_scale, last_backward);
        r.executed.push_back(ins);
        break;
      case schedule::Op::send_activation: {
        const int slot = ch.slot_of[size_t(mb)];
        TESSEL_CHECK(slot >= 0, Error, "internal: send of micro-batch {} before its forward", mb);
        send(ch.model->output_hidden(slot).data<float>(), ins.peer,
             message_tag(mb, ch.vs, num_vs_, Kind::activation));
        break;
      }
      case schedule::Op::recv_activation:
      case schedule::Op::recv_grad: {
        post_through(++waited_for + receive_lookahead_);
        const WaitStart w = start_wait();
        recvs_[i]->wait();
        waited(r, w, "", &ins);
        // The peer sent this after receiving these sends: their buffers are free.
        for (int b : released_at_[i]) send_pool_.give(b);
        released_at_[i].clear();
        break;
      }
      case schedule::Op::send_grad:
        send(ch.model->input_grad().data<float>(), ins.peer,
             message_tag(mb, ch.vs, num_vs_, Kind::grad));
        break;
      case schedule::Op::optimizer_step:
        break;  // the caller's, after the sends completed
      default:
        TESSEL_THROW(UnsupportedError, "pipeline instruction {} is not supported by the worker",
                     schedule::to_string(ins));
    }
  }
  const WaitStart w = start_wait();
  for (auto& s : sends_) s.wait();
  waited(r, w, "sends");
  r.pipeline_s = seconds_since(pipeline_start);
  return r;
}

void PipelineExecutor::receive_from(comm::Communicator& pp, Arrival& a) {
  const size_t bytes = (size_t(B_ * T_ * C_) + kTrailerFloats) * sizeof(float);
  const int index = int(&a - arrivals_.data());
  try {
    for (int k = 0; k < a.expected; ++k)
      a.requests.push_back(pp.recv(a.buffers[size_t(k)].data(), bytes, a.peer, sequence_tag(k)));
    // The peer sends in the order its dispatcher picks, which is the order of the tags.
    for (int k = 0; k < a.expected; ++k) {
      a.requests[size_t(k)].wait();
      {
        std::lock_guard<std::mutex> lock(mu_);
        landed_.push_back({index, k});
      }
      cv_.notify_one();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!arrival_error_) arrival_error_ = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    --arrivals_running_;
  }
  cv_.notify_one();
}

PipelineStepResult PipelineExecutor::run_adaptive(Stage& stage, comm::Communicator& pp,
                                                  const int32_t* inputs, const int32_t* targets,
                                                  float grad_scale,
                                                  const LastBackwardHook& last_backward,
                                                  comm::Communicator* tp) {
  PipelineStepResult r;
  auto& chunks = stage.chunks();
  const auto pipeline_start = std::chrono::steady_clock::now();
  const size_t boundary = size_t(B_ * T_ * C_);
  const int v = int(chunks.size());
  schedule::DispatchOptions o;
  o.chunks = v;
  o.micro_batches = int(M_);
  o.memory_cap = cap_;
  o.backward_cap = backward_cap_;
  o.split_backward = true;
  for (int c = 0; c < v; ++c) {
    if (chunks[size_t(c)].vs == 0) o.first_chunk = c;
    if (chunks[size_t(c)].vs == num_vs_ - 1) o.last_chunk = c;
  }
  schedule::StageDispatcher dispatcher(o);
  const bool follower = tp != nullptr && tp->rank() != 0;
  const int total = dispatcher.computes_total();
  reset_buffers();
  act_landed_.assign(act_buf_.size(), 0);
  grad_landed_.assign(act_buf_.size(), 0);
  choice_sends_.clear();
  if (tp != nullptr && !follower) choices_.resize(size_t(total));
  {
    std::lock_guard<std::mutex> lock(mu_);
    landed_.clear();
    arrival_error_ = nullptr;
    arrivals_running_ = 0;
  }
  for (auto& a : arrivals_) {
    a.sent = 0;
    a.delivered = 0;
    a.acknowledged = 0;
    a.send_buffers.clear();
    a.requests.clear();
  }
  for (auto& a : arrivals_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++arrivals_running_;
    }
    a.thread = std::thread([this, &pp, &a] { receive_from(pp, a); });
  }

  // Sends (kind, micro-batch, the receiving chunk) to the rank of virtual stage `to_vs`.
  auto send = [&](const float* data, int to_vs, Kind kind, int mb) {
    const int peer = rank_of_vs_[size_t(to_vs)];
    auto it = std::find_if(arrivals_.begin(), arrivals_.end(),
                           [&](const Arrival& a) { return a.peer == peer; });
    TESSEL_CHECK(it != arrivals_.end(), Error, "internal: no link to pipeline rank {}", peer);
    // A pooled buffer: free once the peer says it has our message (the trailer's last field of
    // anything it sends us later), else at the step's end. The pool grows only while that many
    // are in flight, which the dispatcher's caps bound.
    const int b = send_pool_.take_or_grow();
    it->send_buffers.push_back(b);
    float* buf = send_pool_.data(b);
    std::copy(data, data + boundary, buf);
    // The last field: how many of the peer's messages this rank has taken in.
    const uint32_t trailer[kTrailerFloats] = {uint32_t(kind), uint32_t(mb),
                                              uint32_t(chunk_of_vs(to_vs)), it->delivered};
    std::memcpy(buf + boundary, trailer, sizeof(trailer));
    sends_.push_back(
        pp.send(buf, (boundary + kTrailerFloats) * sizeof(float), peer, sequence_tag(it->sent++)));
  };
  // A message that landed: its data is where the chunk's compute will read it.
  auto deliver = [&](const Landed& l) {
    Arrival& a = arrivals_[size_t(l.arrival)];
    const float* buf = a.buffers[size_t(l.index)].data();
    uint32_t trailer[kTrailerFloats];
    std::memcpy(trailer, buf + boundary, sizeof(trailer));
    const uint32_t kind = trailer[0], mb = trailer[1], c = trailer[2], taken = trailer[3];
    TESSEL_CHECK(kind <= 1 && mb < uint32_t(M_) && c < uint32_t(v) &&
                     taken <= uint32_t(a.send_buffers.size()),
                 CorruptDataError,
                 "pipeline rank {}: message {} from pipeline rank {} names (kind {}, micro-batch "
                 "{}, chunk {}, {} of our messages taken in), outside this step's {} "
                 "micro-batches and {} chunks, or more than the {} sent",
                 pp_, l.index, a.peer, kind, mb, c, taken, M_, v, a.send_buffers.size());
    ++a.delivered;
    // The peer has our first `taken` messages: their buffers are free.
    for (; a.acknowledged < taken; ++a.acknowledged)
      send_pool_.give(a.send_buffers[a.acknowledged]);
    const size_t at = size_t(c) * size_t(M_) + mb;
    if (kind == uint32_t(Kind::activation)) {
      act_src_[at] = buf;
      act_landed_[at] = 1;
      if (!follower) dispatcher.forward_ready(int(mb), int(c));
    } else {
      grad_src_[at] = buf;
      grad_landed_[at] = 1;
      if (!follower) dispatcher.backward_ready(int(mb), int(c));
    }
  };
  // Takes in what landed; returns whether every arrival thread has finished.
  std::vector<Landed> batch;
  batch.reserve(arrivals_.size() * size_t(v) * size_t(M_) * 2);
  auto take_landed = [&] {
    bool finished = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (arrival_error_) std::rethrow_exception(arrival_error_);
      batch.swap(landed_);
      finished = arrivals_running_ == 0;
    }
    for (const Landed& l : batch) deliver(l);
    batch.clear();
    return finished;
  };
  auto wait_landing = [&] {
    const WaitStart w = start_wait();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !landed_.empty() || arrival_error_ || arrivals_running_ == 0; });
    }
    waited(r, w, "arrival");
  };
  // Runs one compute and passes its output on.
  auto run_compute = [&](const schedule::Instruction& ins) {
    const int mb = ins.micro_batch, c = ins.chunk;
    Chunk& ch = chunks[size_t(c)];
    r.loss_sum += compute(stage, ins, inputs, targets, grad_scale, last_backward);
    r.executed.push_back(ins);
    if (!follower) dispatcher.finished(ins);
    const int vs = ch.vs;
    if (ins.op == schedule::Op::forward && vs + 1 < num_vs_) {
      if (local_next(vs)) {
        if (!follower) dispatcher.forward_ready(mb, chunk_of_vs(vs + 1));  // forward() copied it
      } else {
        send(ch.model->output_hidden(ch.slot_of[size_t(mb)]).data<float>(), vs + 1,
             Kind::activation, mb);
      }
    } else if ((ins.op == schedule::Op::backward_input || ins.op == schedule::Op::backward) &&
               vs > 0) {
      if (local_prev(vs)) {
        if (!follower) dispatcher.backward_ready(mb, chunk_of_vs(vs - 1));  // kept by backward
      } else {
        send(ch.model->input_grad().data<float>(), vs - 1, Kind::grad, mb);
      }
    }
  };

  try {
    if (!follower) {
      while (!dispatcher.done()) {
        const bool finished = take_landed();
        const auto ins = dispatcher.next();
        if (!ins) {
          // By the dispatcher's rule the oldest micro-batch can always move somewhere, so a rank
          // with nothing to run and nothing more to receive is a bug, not a slow peer.
          TESSEL_CHECK(!finished, Error,
                       "internal: the adaptive dispatcher on pipeline rank {} stalled with every "
                       "message of the step received: {}",
                       pp_, dispatcher.describe());
          wait_landing();
          continue;
        }
        if (tp != nullptr) {
          // The other tp ranks run this compute next as well.
          auto& msg = choices_[size_t(r.executed.size())];
          msg = {int32_t(ins->op), ins->micro_batch, ins->chunk, 0};
          for (int t = 1; t < tp->size(); ++t)
            choice_sends_.push_back(
                tp->send(msg.data(), sizeof(msg), t, sequence_tag(uint32_t(r.executed.size()))));
        }
        run_compute(*ins);
      }
    } else {
      for (int k = 0; k < total; ++k) {
        std::array<int32_t, 4> msg{};
        {
          const WaitStart w = start_wait();
          tp->recv(msg.data(), sizeof(msg), 0, sequence_tag(uint32_t(k))).wait();
          waited(r, w, "tp leader's choice");
        }
        const auto op = schedule::Op(msg[0]);
        const int mb = msg[1], c = msg[2];
        TESSEL_CHECK((op == schedule::Op::forward || op == schedule::Op::backward_input ||
                      op == schedule::Op::backward_weight) &&
                         mb >= 0 && mb < M_ && c >= 0 && c < v,
                     CorruptDataError,
                     "pipeline rank {}: tp rank 0 sent choice {} = (op {}, micro-batch {}, "
                     "chunk {}), not a compute of this step",
                     pp_, k, msg[0], mb, c);
        // Its input: a message from a neighbouring rank, unless it stays on this rank.
        const int vs = chunks[size_t(c)].vs;
        const size_t at = size_t(c) * size_t(M_) + size_t(mb);
        const bool needs_act = op == schedule::Op::forward && vs > 0 && !local_prev(vs);
        const bool needs_grad =
            op == schedule::Op::backward_input && vs + 1 < num_vs_ && !local_next(vs);
        for (;;) {
          const bool finished = take_landed();
          if ((!needs_act || act_landed_[at]) && (!needs_grad || grad_landed_[at])) break;
          TESSEL_CHECK(!finished, Error,
                       "internal: pipeline rank {} follows tp rank 0 to {} of micro-batch {} "
                       "chunk {}, whose input never came",
                       pp_, schedule::to_string(schedule::Instruction{op, mb, c, -1}), mb, c);
          wait_landing();
        }
        run_compute(schedule::Instruction{op, mb, c, -1});
      }
    }
  } catch (...) {
    // The arrival threads may wait on peers that will never send now: break the pipeline's
    // communicator (as any failed step does) so that they, and those peers, stop at once.
    pp.abort("the pipeline step failed on this rank");
    join_arrivals();
    throw;
  }
  join_arrivals();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (arrival_error_) std::rethrow_exception(arrival_error_);
  }
  const WaitStart w = start_wait();
  for (auto& s : sends_) s.wait();
  for (auto& s : choice_sends_) s.wait();
  waited(r, w, "sends");
  r.pipeline_s = seconds_since(pipeline_start);
  return r;
}

}  // namespace tessel::runtime
