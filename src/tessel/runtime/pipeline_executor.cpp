#include "tessel/runtime/pipeline_executor.h"

#include <algorithm>
#include <chrono>

#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/schedule/named.h"

namespace tessel::runtime {

namespace {

enum class Kind : uint32_t { activation = 0, grad = 1 };

// Pipeline messages are matched by (micro-batch, virtual stage of the sender, kind).
uint32_t message_tag(int micro_batch, int sender_vs, int num_vs, Kind kind) {
  return ((uint32_t(micro_batch) * uint32_t(num_vs) + uint32_t(sender_vs)) << 1) | uint32_t(kind);
}

}  // namespace

std::vector<schedule::Instruction> pipeline_program(const layout::Plan& plan, int pp) {
  const schedule::Schedule s = schedule::make_schedule(
      layout::schedule_name(plan.schedule), plan.pp, int(plan.micro_batches), plan.virtual_stages);
  return s.per_stage[size_t(pp)];
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

PipelineExecutor::PipelineExecutor(const layout::Plan& plan, int pp, int64_t seq_len,
                                   int64_t hidden)
    : program_(pipeline_program(plan, pp)),
      slots_(activation_peaks(program_, plan.virtual_stages)),
      num_vs_(plan.num_stages()),
      B_(plan.micro_batch),
      T_(seq_len),
      C_(hidden),
      M_(plan.micro_batches),
      pp_(pp) {
  for (int vs = 0; vs < num_vs_; ++vs) {
    rank_of_vs_.push_back(plan.pp_rank_of_stage(vs));
    chunk_of_vs_.push_back(plan.chunk_of_stage(vs));
  }
  act_in_.assign(size_t(plan.virtual_stages * M_), std::vector<float>(size_t(B_ * T_ * C_)));
  grad_in_.assign(act_in_.size(), std::vector<float>(size_t(B_ * T_ * C_)));
}

void PipelineExecutor::abort() noexcept {
  recvs_.clear();
  sends_.clear();
  send_buffers_.clear();
}

// Runs the chunk's forward on micro-batch mb in a free activation slot (its received input copied
// there); returns the loss sum on the head stage (0 elsewhere).
double PipelineExecutor::forward(Stage& stage, int c, int mb, const int32_t* inputs,
                                 const int32_t* targets, float grad_scale) {
  Chunk& ch = stage.chunks()[size_t(c)];
  auto& m = *ch.model;
  TESSEL_CHECK(ch.slot_of[size_t(mb)] < 0 && !ch.free_slots.empty(), Error,
               "internal: no free activation slot for micro-batch {} on virtual stage {} (the "
               "slots are sized from the schedule's peak in-flight micro-batches)",
               mb, ch.vs);
  const int slot = ch.free_slots.back();
  ch.free_slots.pop_back();
  ch.slot_of[size_t(mb)] = slot;
  if (!ch.range.has_embedding) {
    const auto& in = act_in_[size_t(c * M_ + mb)];
    std::copy(in.begin(), in.end(), m.input_hidden(slot).data<float>());
  }
  const int32_t* tok = inputs + mb * B_ * T_;
  const int32_t* tgt = targets + mb * B_ * T_;
  const int32_t* first = ch.range.has_embedding ? tok : nullptr;
  if (ch.range.has_head) return m.forward_stage(first, tgt, grad_scale, slot).loss_sum;
  m.forward_stage(first, nullptr, std::nullopt, slot);
  // The next virtual stage on this rank (the turn of a V) reads the output here, not from a
  // message.
  if (local_next(ch.vs)) {
    const float* out = m.output_hidden(slot).data<float>();
    auto& in = act_in_[size_t(chunk_of_vs(ch.vs + 1) * M_ + mb)];
    std::copy(out, out + in.size(), in.begin());
  }
  return 0;
}

// The input gradient a backward (or Bi) left, for the previous virtual stage when it is on this
// rank: input_grad() is scratch the next backward overwrites.
void PipelineExecutor::keep_input_grad(Chunk& ch, int mb) {
  if (!local_prev(ch.vs)) return;
  const float* g = ch.model->input_grad().data<float>();
  auto& out = grad_in_[size_t(chunk_of_vs(ch.vs - 1) * M_ + mb)];
  std::copy(g, g + out.size(), out.begin());
}

// The slot holding micro-batch mb's activations on chunk c, its output gradient filled in from
// what arrived (not on the head stage, which starts from its loss): what B and Bi both start from.
int PipelineExecutor::begin_backward(Chunk& ch, int c, int mb) {
  const int slot = ch.slot_of[size_t(mb)];
  TESSEL_CHECK(slot >= 0, Error,
               "internal: backward of micro-batch {} on virtual stage {} without its forward", mb,
               ch.vs);
  if (!ch.range.has_head) {
    const auto& g = grad_in_[size_t(c * M_ + mb)];
    std::copy(g.begin(), g.end(), ch.model->output_grad(slot).data<float>());
  }
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

PipelineStepResult PipelineExecutor::run(Stage& stage, comm::Communicator& pp,
                                         const int32_t* inputs, const int32_t* targets,
                                         float grad_scale, const LastBackwardHook& last_backward) {
  PipelineStepResult r;
  auto& chunks = stage.chunks();
  send_buffers_.clear();
  sends_.clear();
  for (auto& ch : chunks) ch.backwards_done = 0;
  // The pipeline's idle time: waiting for a receive or for the last sends (the bubble, plus any
  // imbalance between stages), against the time the instruction list took.
  const auto pipeline_start = std::chrono::steady_clock::now();
  const size_t boundary = size_t(B_ * T_ * C_);
  // Every receive of the step is posted up front (each (chunk, micro-batch) has its own buffer)
  // and only waited for at its instruction: Gloo's transport moves a message once the receiver
  // has posted it, so posting late would put a handshake and the whole transfer on the critical
  // path of every micro-batch instead of overlapping them with compute.
  recvs_.clear();
  recvs_.resize(program_.size());
  for (size_t i = 0; i < program_.size(); ++i) {
    const auto& ins = program_[i];
    const int mb = ins.micro_batch, c = ins.chunk;
    if (ins.op == schedule::Op::recv_activation)
      recvs_[i] = pp.recv(act_in_[size_t(c * M_ + mb)].data(), boundary * sizeof(float), ins.peer,
                          message_tag(mb, chunks[size_t(c)].vs - 1, num_vs_, Kind::activation));
    else if (ins.op == schedule::Op::recv_grad)
      recvs_[i] = pp.recv(grad_in_[size_t(c * M_ + mb)].data(), boundary * sizeof(float), ins.peer,
                          message_tag(mb, chunks[size_t(c)].vs + 1, num_vs_, Kind::grad));
  }
  auto send = [&](const float* data, int peer, uint32_t tag) {
    send_buffers_.emplace_back(data, data + boundary);
    sends_.push_back(pp.send(send_buffers_.back().data(), boundary * sizeof(float), peer, tag));
  };
  for (size_t i = 0; i < program_.size(); ++i) {
    const auto& ins = program_[i];
    const int mb = ins.micro_batch, c = ins.chunk;
    auto& ch = chunks[size_t(c)];
    switch (ins.op) {
      case schedule::Op::forward:
        r.loss_sum += forward(stage, c, mb, inputs, targets, grad_scale);
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
      case schedule::Op::send_activation: {
        const int slot = ch.slot_of[size_t(mb)];
        TESSEL_CHECK(slot >= 0, Error, "internal: send of micro-batch {} before its forward", mb);
        send(ch.model->output_hidden(slot).data<float>(), ins.peer,
             message_tag(mb, ch.vs, num_vs_, Kind::activation));
        break;
      }
      case schedule::Op::recv_activation:
      case schedule::Op::recv_grad: {
        const auto t0 = std::chrono::steady_clock::now();
        recvs_[i]->wait();
        r.idle_s += seconds_since(t0);
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
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& s : sends_) s.wait();
  r.idle_s += seconds_since(t0);
  r.pipeline_s = seconds_since(pipeline_start);
  send_buffers_.clear();
  return r;
}

}  // namespace tessel::runtime
