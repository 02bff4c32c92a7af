// Runs one optimizer step's pipeline instructions for one rank (schedule/instruction.h): the
// forwards and backwards of its chunks over the micro-batches, and the stage-boundary
// activations [B, T, C] and their gradients over the pp communicator, tagged with (micro-batch,
// sending virtual stage, kind).
//
// The instruction list is the plan's schedule for the rank's pipeline coordinate; each chunk has
// as many activation slots as its peak number of micro-batches in flight in that list (pp at
// most for 1F1B, M for GPipe), so no forward is ever recomputed. Every receive of the step is
// posted when the step starts, so transfers overlap compute.
//
// Under the adaptive schedule there is no list: the rank asks a schedule::StageDispatcher for
// its next compute, fed by what has arrived. Messages then cannot be matched by a tag known in
// advance (a peer sends in the order its own dispatcher picks), so every message from a peer
// carries the sender's running count as its tag and names its (kind, micro-batch, chunk) in a
// 16-byte trailer; one arrival thread per peer posts the step's receives from that peer into
// pooled buffers and waits for them in that order, handing each to the dispatcher as it lands.
// Buffers for sends and receives are allocated once, not per message.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/layout/plan.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/stage.h"
#include "tessel/runtime/step_trace.h"
#include "tessel/schedule/instruction.h"

namespace tessel::runtime {

// The schedule of `plan` over plan.micro_batches (every rank's list), and rank `pp`'s list.
schedule::Schedule pipeline_schedule(const layout::Plan& plan);
std::vector<schedule::Instruction> pipeline_program(const layout::Plan& plan, int pp);

// When a send's buffer may be reused, without waiting for the send: the peer has received the
// message once it sends this rank anything after its receive in its own list, so when this
// rank's wait for that later message returns, the buffer is free. For each instruction of rank
// `pp`'s list: for a send, the index (in the same list) of the receive after whose wait its
// buffer is free, or -1 when the peer sends nothing after it (free at the step's end); -2 for
// other instructions.
std::vector<int> send_release_points(const schedule::Schedule& s, int pp);

// The most send buffers rank `pp` of an instruction-list schedule holds at once, freeing each at
// its send_release_points (the executor allocates that many, whatever the micro-batches).
int send_buffers(const schedule::Schedule& s, int pp);

// Per chunk of `program` (chunks of them), the most micro-batches in flight at once (forward
// run, backward not yet): the activation slots it needs. 1F1B needs at most pp, GPipe M.
std::vector<int> activation_peaks(const std::vector<schedule::Instruction>& program, int chunks);

// The activation slots each chunk of pipeline rank `pp` needs under `plan`: the peaks of its
// list, or under the adaptive schedule what its dispatcher may hold, min(M, cap + v - 1).
std::vector<int> activation_slots(const layout::Plan& plan, int pp);

// The boundary buffers pipeline rank `pp`'s executor pools for what it receives and passes
// between its own virtual stages (PipelineExecutor::receive_buffers): for an instruction list,
// the peak of a walk through it with the executor's rules (receives posted
// schedule::kReceiveLookahead per chunk ahead; an activation given back after its forward, or
// its backward under just-in-time recomputation; a gradient after its backward). It does not
// grow with the number of micro-batches. For the adaptive schedule, the local copies' bound:
// two per micro-batch the rank may hold (2 (dispatch_cap + v - 1)) when it holds two adjacent
// virtual stages, else 0 (its receives land in the arrival buffers).
int receive_buffers(const layout::Plan& plan, int pp);

// Delays injected after computes, to run the schedules under jitter in tests and benchmarks
// (the environment's TESSEL_PIPELINE_DELAY, "stage=S,slowdown=F,jitter=J,seed=N,dilate=D", any
// subset): on pipeline rank S (every rank when absent or -1) a compute that took d seconds is
// stretched to d * F * (1 + J (2u - 1)), u uniform in [0, 1) drawn per compute from a generator
// seeded with N + the pipeline rank, by sleeping the difference: the simulator's slowdown and
// jitter (planner/simulator.h), so its prediction of a run is like for like. Sleeping can only
// add time, so D F (1 - J) must be >= 1: undilated e.g. F = 1.5 alone, or F = 2, J = 0.5
// (2x +- 50%); dilated (D >= 2) also F = 1, J = 0.5 (+- 50% around the stage's own speed).
// D (>= 1) stretches every compute on every rank D times on top (d * D * ...): a pipeline of
// more ranks than the machine has cores then computes a D-th of the time and sleeps the rest,
// so its ranks no longer take turns on the cores, and its order and waits are those of a
// machine with a core per rank whose computes are D times slower (messages are not dilated).
// Dilated, d is the computing thread's CPU time, not its wall time, so a compute that did share
// a core for a moment is not stretched by the time it waited (one compute thread per rank, as
// the pipeline bench runs, is assumed: other threads' CPU time is not counted).
struct DelayInjection {
  int stage = -1;
  double slowdown = 1;
  double jitter = 0;
  uint64_t seed = 1;
  double dilate = 1;
  bool active() const { return slowdown != 1 || jitter != 0 || dilate != 1; }
  // Throws ConfigError naming the bad field.
  static DelayInjection parse(std::string_view spec);
};

struct PipelineStepResult {
  double loss_sum = 0;    // of the head stage's micro-batches (0 on other stages)
  double idle_s = 0;      // waiting for receives and for the last sends
  double pipeline_s = 0;  // the whole instruction list
  // The computes this rank ran, in order (the adaptive dispatcher's choices; the list's
  // otherwise).
  std::vector<schedule::Instruction> executed;
};

class PipelineExecutor {
 public:
  // For chunk c's last backward of the step: what reports the gradients finished so far (the
  // overlapped dp all-reduce), or an empty function.
  using LastBackwardHook = std::function<model::Transformer::GradsReady(int chunk)>;

  // Pipeline rank `pp` of `plan` (defaults applied), with sequences of `seq_len` tokens and a
  // hidden size of `hidden`.
  PipelineExecutor(const layout::Plan& plan, int pp, int64_t seq_len, int64_t hidden);
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // The activation slots each chunk needs (activation_peaks of the program).
  const std::vector<int>& activation_slots() const { return slots_; }
  // Boundary buffers the receive pool holds (see receive_pool_): receive_buffers(plan, pp), at
  // most receive_buffer_bound(plan, pp) of memory_model.h.
  size_t receive_buffers() const { return receive_pool_.buffers.size(); }

  // Runs the step's instructions on `stage`: micro-batch mb's tokens and targets start at
  // inputs/targets + mb * B * T; the loss gradient of every micro-batch is scaled by `grad_scale`.
  // `tp` is the rank's tensor-parallel group (or null): under the adaptive schedule its ranks
  // must run their computes in one order, since each compute's tp collectives pair up across
  // them, so tp rank 0 decides and sends every choice to the others, which follow it.
  PipelineStepResult run(Stage& stage, comm::Communicator& pp, const int32_t* inputs,
                         const int32_t* targets, float grad_scale,
                         const LastBackwardHook& last_backward, comm::Communicator* tp = nullptr);

  // Drops the step's pending transfers (a peer failed: the communicators are broken already).
  void abort() noexcept;

  void set_delay(const DelayInjection& delay);
  // Records every compute and wait of the steps the tracer is active for (output.trace); null:
  // none. The tracer outlives the executor's steps.
  void set_tracer(StepTracer* tracer) { tracer_ = tracer; }
  bool adaptive() const { return adaptive_; }

 private:
  double forward(Stage& stage, int c, int mb, const int32_t* inputs, const int32_t* targets,
                 float grad_scale);
  void backward(Stage& stage, int c, int mb, const LastBackwardHook& last_backward);
  void backward_input(Stage& stage, int c, int mb);
  void backward_weight(Stage& stage, int c, int mb, const LastBackwardHook& last_backward);
  void keep_input_grad(Chunk& ch, int mb);
  int begin_backward(Chunk& ch, int c, int mb);
  model::Transformer::GradsReady grads_ready(Chunk& ch, int c,
                                             const LastBackwardHook& last_backward);
  void release_slot(Chunk& ch, int mb);
  void evict(Chunk& ch);
  double forward_into_slot(Chunk& ch, int c, int mb, const int32_t* inputs, const int32_t* targets,
                           float grad_scale);
  void recompute(Stage& stage, int c, int mb, const int32_t* inputs, const int32_t* targets,
                 float grad_scale);
  // One compute of the list or the dispatcher (forward, B, Bi, Bw), then the injected delay.
  double compute(Stage& stage, const schedule::Instruction& ins, const int32_t* inputs,
                 const int32_t* targets, float grad_scale, const LastBackwardHook& last_backward);
  PipelineStepResult run_list(Stage& stage, comm::Communicator& pp, const int32_t* inputs,
                              const int32_t* targets, float grad_scale,
                              const LastBackwardHook& last_backward);
  PipelineStepResult run_adaptive(Stage& stage, comm::Communicator& pp, const int32_t* inputs,
                                  const int32_t* targets, float grad_scale,
                                  const LastBackwardHook& last_backward, comm::Communicator* tp);
  // The adaptive path: the arrival thread of one peer, and the loop draining what arrived.
  struct Arrival;
  void receive_from(comm::Communicator& pp, Arrival& a);
  // Neighbouring virtual stages on this rank (the turn of zb-v's V) pass data by copy.
  bool local_next(int vs) const { return vs + 1 < num_vs_ && rank_of_vs_[size_t(vs + 1)] == pp_; }
  bool local_prev(int vs) const { return vs > 0 && rank_of_vs_[size_t(vs - 1)] == pp_; }
  int chunk_of_vs(int vs) const { return chunk_of_vs_[size_t(vs)]; }

  // Equal float buffers handed out by index and given back; reset() frees them all (a step
  // starts). The receive pool and the send pool are one each.
  struct BufferPool {
    size_t floats = 0;
    std::vector<std::vector<float>> buffers;
    std::vector<int> free;
    void allocate(size_t count, size_t floats_each);
    void reset();
    // A free buffer's index, -1 when none is free.
    int take();
    // A free buffer's index, adding one when none is free.
    int take_or_grow();
    void give(int b) { free.push_back(b); }
    float* data(int b) { return buffers[size_t(b)].data(); }
  };

  std::vector<schedule::Instruction> program_;
  // The list path's send buffers: pooled, each given back at its send_release_points entry.
  std::vector<int> send_release_;              // per instruction
  std::vector<std::vector<int>> released_at_;  // per instruction: send buffers freed there
  float* list_send_buffer(size_t at, const float* data);
  std::vector<int> slots_;
  int num_vs_ = 1;
  bool jit_ = false;  // just-in-time recomputation: one slot per chunk, R before B
  int64_t B_ = 1, T_ = 1, C_ = 1, M_ = 1;  // micro-batch, seq_len, hidden, micro-batches
  int pp_ = 0;                             // this rank's pipeline coordinate
  std::vector<int> rank_of_vs_, chunk_of_vs_;
  // Boundary buffers (B * T * C floats) for the activations and gradients received from
  // another rank or passed between this rank's virtual stages (the turn of a V), pooled: a buffer
  // is taken when its receive is posted (or its copy made) and given back once the compute that
  // reads it has copied it out -- the forward for an activation (the backward under
  // just-in-time recomputation, whose recompute reads it again), the backward (or Bi) for a
  // gradient. The list path posts its receives receive_lookahead_ ahead of the instruction that
  // waits for them, so the pool holds a number of buffers that does not grow with the number
  // of micro-batches (receive_buffers(plan, pp), allocated up front; the memory model counts
  // them).
  BufferPool receive_pool_;
  std::vector<int> act_buf_, grad_buf_;  // [chunk * M + mb]: index in receive_pool_, or -1
  // Takes a pool buffer for (chunk, micro-batch) `at` and points src[at] at it.
  float* take_buffer(std::vector<int>& held, std::vector<const float*>& src, size_t at);
  void give_back(std::vector<int>& held, size_t at);
  void reset_buffers();  // every receive and send buffer free (a step starts)
  size_t receive_lookahead_ = 1;
  std::vector<size_t> recv_order_;  // the program's receive instructions, in order
  // Where micro-batch mb's input (output gradient) for chunk c is: a pool buffer, or under the
  // adaptive schedule the arrival buffer it landed in.
  std::vector<const float*> act_src_, grad_src_;
  // The step's transfers. Members, not locals: when a step fails they must outlive the unwinding
  // until the communicators are broken, or destroying them would wait for peers that are
  // themselves stuck.
  BufferPool send_pool_;  // reused step after step
  std::vector<comm::Request> sends_;
  std::vector<std::optional<comm::Request>> recvs_;

  // Adaptive schedule.
  bool adaptive_ = false;
  int cap_ = 1;
  int backward_cap_ = 0;  // layout::Plan::dispatch_backward_cap
  // kind, micro-batch, receiving chunk, how many of the receiver's messages the sender took in
  static constexpr size_t kTrailerFloats = 4;
  struct Arrival {
    int peer = -1;
    int expected = 0;                         // messages from the peer per step
    std::vector<std::vector<float>> buffers;  // one per message, boundary + trailer
    uint32_t sent = 0;                        // messages this rank sent the peer this step
    uint32_t delivered = 0;                   // of the peer's messages, taken in this step
    uint32_t acknowledged = 0;                // of ours, known received (buffers given back)
    std::vector<int> send_buffers;            // the send pool buffer of each message sent
    std::vector<comm::Request> requests;      // this step's receives (members: see sends_)
    std::thread thread;
  };
  std::vector<Arrival> arrivals_;  // one per distinct neighbouring peer
  struct Landed {
    int arrival, index;
  };
  std::mutex mu_;  // guards landed_, arrival_error_, arrivals_running_
  std::condition_variable cv_;
  std::vector<Landed> landed_;
  std::vector<char> act_landed_, grad_landed_;  // [chunk * M + mb], this step
  // The tp leader's choices, sent to the other tp ranks: (op, micro-batch, chunk, 0) each.
  std::vector<std::array<int32_t, 4>> choices_;
  std::vector<comm::Request> choice_sends_;
  std::exception_ptr arrival_error_;
  int arrivals_running_ = 0;
  void join_arrivals() noexcept;

  DelayInjection delay_;
  std::mt19937_64 delay_rng_;
  StepTracer* tracer_ = nullptr;
  bool tracing() const { return tracer_ != nullptr && tracer_->active(); }
  // The start of a wait: steady clock for idle_s, wall clock for the trace.
  struct WaitStart {
    std::chrono::steady_clock::time_point t0;
    StepTracer::Clock::time_point wall0;  // read only when tracing
  };
  WaitStart start_wait() const {
    return {std::chrono::steady_clock::now(),
            tracing() ? StepTracer::Clock::now() : StepTracer::Clock::time_point{}};
  }
  // Adds the wait since `w` to idle_s and, when tracing, records it as "wait <what>" (or "wait
  // <instruction>" when `ins` is given).
  void waited(PipelineStepResult& r, const WaitStart& w, const char* what,
              const schedule::Instruction* ins = nullptr);
};

}  // namespace tessel::runtime
