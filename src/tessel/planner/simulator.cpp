#include "tessel/planner/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <queue>
#include <stdexcept>

#include "tessel/core/check.h"
#include "tessel/schedule/dispatcher.h"

namespace tessel::planner {
namespace {

using schedule::Instruction;
using schedule::Op;

constexpr double kNotYet = -1;

// splitmix64's output function (Steele, Lea, Flood 2014): hashes the jitter key. A hash rather
// than a stream so that an instruction's draw does not depend on the order instructions run in.
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void check_config(const char* what, int p, int v, const SimConfig& c) {
  const size_t vs_count = size_t(p) * size_t(v);
  TESSEL_CHECK(c.costs.size() == vs_count, ConfigError,
               "{}: costs has {} entries, needs one per virtual stage ({} stages x {} chunks = {})",
               what, c.costs.size(), p, v, vs_count);
  for (size_t vs = 0; vs < vs_count; ++vs) {
    const StageCosts& s = c.costs[vs];
    bool ok = true;
    for (double x : {s.forward, s.backward, s.backward_input, s.backward_weight, s.activation_bytes,
                     s.output_bytes})
      ok = ok && std::isfinite(x) && x >= 0;
    TESSEL_CHECK(ok, ConfigError,
                 "{}: costs of virtual stage {} must be finite and >= 0 (forward {}, backward {}, "
                 "backward_input {}, backward_weight {}, activation_bytes {}, output_bytes {})",
                 what, vs, s.forward, s.backward, s.backward_input, s.backward_weight,
                 s.activation_bytes, s.output_bytes);
  }
  TESSEL_CHECK(c.optimizer_step.empty() || c.optimizer_step.size() == size_t(p), ConfigError,
               "{}: optimizer_step has {} entries, needs none or one per stage ({})", what,
               c.optimizer_step.size(), p);
  for (double x : c.optimizer_step)
    TESSEL_CHECK(std::isfinite(x) && x >= 0, ConfigError,
                 "{}: optimizer_step times must be finite and >= 0, got {}", what, x);
  TESSEL_CHECK(c.slowdown.empty() || c.slowdown.size() == size_t(p), ConfigError,
               "{}: slowdown has {} entries, needs none or one per stage ({})", what,
               c.slowdown.size(), p);
  for (double x : c.slowdown)
    TESSEL_CHECK(std::isfinite(x) && x > 0, ConfigError,
                 "{}: slowdown factors must be finite and > 0, got {}", what, x);
  TESSEL_CHECK(c.jitter >= 0 && c.jitter < 1, ConfigError, "{}: jitter must be in [0, 1), got {}",
               what, c.jitter);
  TESSEL_CHECK(c.stage_jitter.empty() || c.stage_jitter.size() == size_t(p), ConfigError,
               "{}: stage_jitter has {} entries, needs none or one per stage ({})", what,
               c.stage_jitter.size(), p);
  for (double x : c.stage_jitter)
    TESSEL_CHECK(x >= 0 && x < 1, ConfigError, "{}: jitter must be in [0, 1), got {}", what, x);
  TESSEL_CHECK(c.links.empty() || c.links.size() == size_t(p) * size_t(p), ConfigError,
               "{}: links has {} entries, needs none or stages * stages ({})", what, c.links.size(),
               size_t(p) * size_t(p));
  auto check_link = [&](const Link& l) {
    TESSEL_CHECK(std::isfinite(l.latency) && l.latency >= 0 && l.bandwidth > 0, ConfigError,
                 "{}: a link needs latency >= 0 and bandwidth > 0, got latency {} bandwidth {}",
                 what, l.latency, l.bandwidth);
  };
  check_link(c.link);
  for (const Link& l : c.links) check_link(l);
}

// Sizes, durations and the result being filled, shared by both runners.
class Model {
 public:
  Model(const char* what, std::string name, int p, int m, int v, const SimConfig& config,
        schedule::Placement placement = schedule::Placement::interleaved)
      : p_(p), m_(m), v_(v), placement_(placement), c_(config) {
    check_config(what, p, v, config);
    r_.name = std::move(name);
    r_.stages = p;
    r_.micro_batches = m;
    r_.chunks = v;
    r_.busy.assign(size_t(p), 0.0);
    r_.peak_in_flight.assign(size_t(p), 0);
    r_.peak_activation_bytes.assign(size_t(p), 0.0);
    if (c_.record_timeline) r_.timeline.resize(size_t(p));
    in_flight_.assign(size_t(p), 0);
    bytes_.assign(size_t(p), 0.0);
  }

  int p() const { return p_; }
  int m() const { return m_; }
  int v() const { return v_; }
  int last() const { return p_ * v_ - 1; }
  int vs(int stage, int chunk) const {
    return schedule::virtual_stage(p_, stage, chunk, placement_);
  }
  int rank(int vs) const { return schedule::stage_of(p_, vs, placement_); }
  int chunk(int vs) const { return schedule::chunk_of(p_, vs, placement_); }
  // Whether the previous / next virtual stage lives on another rank (interleaved: every one does
  // when p > 1; V-shaped: all but the turn at rank p - 1).
  bool remote_prev(int vs) const { return vs > 0 && rank(vs - 1) != rank(vs); }
  bool remote_next(int vs) const { return vs < last() && rank(vs + 1) != rank(vs); }
  // Flat index of (virtual stage, micro_batch).
  size_t index(int vs, int mb) const { return size_t(vs) * size_t(m_) + size_t(mb); }
  size_t table_size() const { return size_t(p_) * size_t(v_) * size_t(m_); }
  bool recording() const { return c_.record_timeline; }
  void reserve_timeline(int stage, size_t entries) {
    if (c_.record_timeline) r_.timeline[size_t(stage)].reserve(entries);
  }

  double duration(int stage, Op op, int mb, int chunk) const {
    double base;
    if (op == Op::optimizer_step) {
      base = c_.optimizer_step.empty() ? 0.0 : c_.optimizer_step[size_t(stage)];
    } else {
      const StageCosts& s = c_.costs[size_t(vs(stage, chunk))];
      base = op == Op::forward || op == Op::recompute ? s.forward
             : op == Op::backward                     ? s.backward
             : op == Op::backward_input               ? s.backward_input
                                                      : s.backward_weight;
    }
    if (!c_.slowdown.empty()) base *= c_.slowdown[size_t(stage)];
    const double jitter = c_.stage_jitter.empty() ? c_.jitter : c_.stage_jitter[size_t(stage)];
    if (jitter > 0) {
      uint64_t h = mix(c_.seed);
      for (int k : {stage, int(op), mb, chunk}) h = mix(h ^ uint64_t(uint32_t(k)));
      double u = double(h >> 11) * 0x1.0p-53;  // [0, 1)
      base *= 1.0 + jitter * (2.0 * u - 1.0);
    }
    return base;
  }

  // Arrival time of a message sent at `sent` carrying the data between virtual stage `lower`
  // and `lower + 1` (an activation forward or a gradient back; both have lower's output size).
  double arrival(int from, int to, int lower, double sent) const {
    const Link& l = c_.links.empty() ? c_.link : c_.links[size_t(from) * size_t(p_) + size_t(to)];
    return sent + l.transfer_time(c_.costs[size_t(lower)].output_bytes);
  }

  void compute(int stage, Op op, int mb, int chunk, double start, double end) {
    r_.busy[size_t(stage)] += end - start;
    if (c_.record_timeline) r_.timeline[size_t(stage)].push_back({op, mb, chunk, start, end});
    r_.makespan = std::max(r_.makespan, end);
  }
  void hold(int stage, int chunk) {
    size_t s = size_t(stage);
    r_.peak_in_flight[s] = std::max(r_.peak_in_flight[s], ++in_flight_[s]);
    bytes_[s] += c_.costs[size_t(vs(stage, chunk))].activation_bytes;
    r_.peak_activation_bytes[s] = std::max(r_.peak_activation_bytes[s], bytes_[s]);
  }
  void release(int stage, int chunk) {
    --in_flight_[size_t(stage)];
    bytes_[size_t(stage)] -= c_.costs[size_t(vs(stage, chunk))].activation_bytes;
  }
  int in_flight(int stage) const { return in_flight_[size_t(stage)]; }

  SimResult& result() { return r_; }

 private:
  int p_, m_, v_;
  schedule::Placement placement_;
  const SimConfig& c_;
  SimResult r_;
  std::vector<int> in_flight_;
  std::vector<double> bytes_;
};

// ---- Static lists --------------------------------------------------------------------------

// Runs each stage's list as far as it can; a stage blocked on a receive is resumed by the send
// that fills it. Order of processing does not change any time: each instruction starts at the
// later of its stage's clock and its message's arrival.
class ListRun {
 public:
  ListRun(const schedule::Schedule& s, const SimConfig& config)
      : s_(checked(s)),
        model_("simulate", s.name, s.stages, s.micro_batches, s.chunks, config, s.placement),
        pc_(size_t(s.stages), 0),
        clock_(size_t(s.stages), 0.0),
        blocked_(size_t(s.stages), -1) {
    for (int stage = 0; stage < s.stages; ++stage)  // a hint: sends and receives are the rest
      model_.reserve_timeline(stage, s.per_stage[size_t(stage)].size() / 2 + 1);
    const size_t n = model_.table_size();
    forward_done_.assign(n, 0);
    input_grad_done_.assign(n, 0);
    received_.assign(2 * n, 0);
    arrival_.assign(2 * n, kNotYet);
    // Lists with recomputations (schedule::with_jit_recompute) keep one micro-batch's
    // activations per chunk: a forward or recomputation evicts the one resident.
    for (const auto& list : s.per_stage)
      for (const auto& in : list) jit_ = jit_ || in.op == Op::recompute;
    if (jit_) resident_.assign(size_t(s.stages) * size_t(s.chunks), -1);
  }

  SimResult run() {
    std::vector<int> work;
    for (int stage = s_.stages - 1; stage >= 0; --stage) work.push_back(stage);
    while (!work.empty()) {
      int stage = work.back();
      work.pop_back();
      const auto& list = s_.per_stage[size_t(stage)];
      while (pc_[size_t(stage)] < list.size() && step(stage, work)) ++pc_[size_t(stage)];
    }
    report_deadlock();
    return std::move(model_.result());
  }

 private:
  static const schedule::Schedule& checked(const schedule::Schedule& s) {
    TESSEL_CHECK(s.stages >= 1 && s.micro_batches >= 1 && s.chunks >= 1 &&
                     s.per_stage.size() == size_t(s.stages),
                 InvalidArgumentError,
                 "simulate: schedule '{}' has stages {}, micro_batches {}, chunks {} and {} "
                 "instruction lists; run schedule::validate on it",
                 s.name, s.stages, s.micro_batches, s.chunks, s.per_stage.size());
    return s;
  }

  // Message slots: activations arriving at (vs, mb) in [0, n), gradients in [n, 2n).
  size_t act_slot(int vs, int mb) const { return model_.index(vs, mb); }
  size_t grad_slot(int vs, int mb) const { return model_.table_size() + model_.index(vs, mb); }

  void require(bool ok, int stage, const char* what) const {
    size_t i = pc_[size_t(stage)];
    TESSEL_CHECK(ok, InvalidArgumentError,
                 "simulate: schedule '{}' stage {} instruction {} ({}) runs before {}; run "
                 "schedule::validate for the full check",
                 s_.name, stage, i, schedule::to_string(s_.per_stage[size_t(stage)][i]), what);
  }

  void send(size_t slot, int to, double when, std::vector<int>& work) {
    arrival_[slot] = when;
    if (blocked_[size_t(to)] == int64_t(slot)) {
      blocked_[size_t(to)] = -1;
      work.push_back(to);
    }
  }

  // Runs the instruction at stage's pc; false when it is a receive whose send has not run yet.
  bool step(int stage, std::vector<int>& work) {
    const Instruction& in = s_.per_stage[size_t(stage)][pc_[size_t(stage)]];
    double& clock = clock_[size_t(stage)];
    auto run_compute = [&](int chunk) {
      double start = clock;
      clock += model_.duration(stage, in.op, in.micro_batch, chunk);
      model_.compute(stage, in.op, in.micro_batch, chunk, start, clock);
    };
    if (in.op == Op::optimizer_step) {
      run_compute(-1);
      return true;
    }
    const int mb = in.micro_batch, chunk = in.chunk;
    TESSEL_CHECK(mb >= 0 && mb < model_.m() && chunk >= 0 && chunk < model_.v(),
                 InvalidArgumentError,
                 "simulate: schedule '{}' stage {} instruction {} ({}) has micro_batch or chunk "
                 "out of range; run schedule::validate for the full check",
                 s_.name, stage, pc_[size_t(stage)], schedule::to_string(in));
    const int vs = model_.vs(stage, chunk);
    const size_t here = model_.index(vs, mb);
    switch (in.op) {
      case Op::forward:
        if (model_.remote_prev(vs))
          require(received_[act_slot(vs, mb)], stage, "its recv_activation");
        else if (vs > 0)
          require(forward_done_[model_.index(vs - 1, mb)], stage, "the F of the previous chunk");
        take_slot(stage, chunk, mb);
        run_compute(chunk);
        forward_done_[here] = 1;
        return true;
      case Op::backward:
      case Op::backward_input:
        require(forward_done_[here], stage, "its F");
        if (model_.remote_next(vs))
          require(received_[grad_slot(vs, mb)], stage, "its recv_grad");
        else if (vs < model_.last())
          require(input_grad_done_[model_.index(vs + 1, mb)], stage, "the B of the next chunk");
        run_compute(chunk);
        input_grad_done_[here] = 1;
        if (in.op == Op::backward) free_slot(stage, chunk, mb);
        return true;
      case Op::backward_weight:
        require(input_grad_done_[here], stage, "its Bi");
        run_compute(chunk);
        model_.release(stage, chunk);
        return true;
      case Op::recompute:
        require(forward_done_[here] && !input_grad_done_[here], stage, "its F, and before its B,");
        take_slot(stage, chunk, mb);
        run_compute(chunk);
        return true;
      case Op::send_activation: {
        require(forward_done_[here] && model_.remote_next(vs), stage,
                "the F that produces it (or has no remote next stage)");
        int to = model_.rank(vs + 1);
        send(act_slot(vs + 1, mb), to, model_.arrival(stage, to, vs, clock), work);
        return true;
      }
      case Op::send_grad: {
        require(input_grad_done_[here] && model_.remote_prev(vs), stage,
                "the B or Bi that produces it (or has no remote previous stage)");
        int to = model_.rank(vs - 1);
        send(grad_slot(vs - 1, mb), to, model_.arrival(stage, to, vs - 1, clock), work);
        return true;
      }
      case Op::recv_activation:
      case Op::recv_grad: {
        size_t slot = in.op == Op::recv_activation ? act_slot(vs, mb) : grad_slot(vs, mb);
        if (arrival_[slot] == kNotYet) {
          blocked_[size_t(stage)] = int64_t(slot);
          return false;
        }
        clock = std::max(clock, arrival_[slot]);
        received_[slot] = 1;
        return true;
      }
      case Op::optimizer_step:
        break;
    }
    return true;
  }

  // A forward (or recomputation) takes micro-batch mb's activations; under jit lists it evicts
  // the chunk's resident micro-batch first.
  void take_slot(int stage, int chunk, int mb) {
    if (jit_) {
      int& r = resident_[size_t(stage) * size_t(s_.chunks) + size_t(chunk)];
      if (r >= 0) model_.release(stage, chunk);
      r = mb;
    }
    model_.hold(stage, chunk);
  }
  void free_slot(int stage, int chunk, int mb) {
    if (jit_) {
      int& r = resident_[size_t(stage) * size_t(s_.chunks) + size_t(chunk)];
      if (r != mb) return;  // evicted already
      r = -1;
    }
    model_.release(stage, chunk);
  }

  void report_deadlock() const {
    std::string waits;
    for (int stage = 0; stage < s_.stages; ++stage) {
      const auto& list = s_.per_stage[size_t(stage)];
      if (pc_[size_t(stage)] == list.size()) continue;
      waits += fmt::format("{}stage {} at instruction {} ({})", waits.empty() ? "" : "; ", stage,
                           pc_[size_t(stage)], schedule::to_string(list[pc_[size_t(stage)]]));
    }
    TESSEL_CHECK(waits.empty(), InvalidArgumentError,
                 "simulate: schedule '{}' deadlocks, every unfinished stage waits on a receive "
                 "whose send never runs: {}",
                 s_.name, waits);
  }

  const schedule::Schedule& s_;
  Model model_;
  std::vector<size_t> pc_;
  std::vector<double> clock_;
  std::vector<int64_t> blocked_;  // the message slot a stage waits on, or -1
  std::vector<char> forward_done_, input_grad_done_, received_;  // per (vs, mb) / slot
  std::vector<double> arrival_;                                  // per slot, or kNotYet
  bool jit_ = false;
  std::vector<int> resident_;  // jit: per (stage, chunk), the micro-batch holding the slot
};

// ---- Greedy dispatcher ---------------------------------------------------------------------

// The event loop around one schedule::StageDispatcher per stage: the dispatchers choose, this
// class times the choices, carries the data between virtual stages and accounts the memory.
class GreedyRun {
 public:
  GreedyRun(const GreedyOptions& o, const SimConfig& config)
      : o_(o),
        model_("simulate_greedy", "greedy", o.stages, o.micro_batches, o.chunks, config,
               o.placement) {
    const size_t p = size_t(o.stages);
    stages_.reserve(p);
    for (int s = 0; s < o.stages; ++s) {
      schedule::DispatchOptions d{
          .chunks = o.chunks,
          .micro_batches = o.micro_batches,
          .memory_cap = cap(s),
          .backward_cap = o.stage_backward_caps.empty() ? 0 : o.stage_backward_caps[size_t(s)],
          .split_backward = o.split_backward};
      if (model_.rank(0) == s) d.first_chunk = model_.chunk(0);
      if (model_.rank(model_.last()) == s) d.last_chunk = model_.chunk(model_.last());
      stages_.push_back({schedule::StageDispatcher(d)});
    }
    if (model_.recording()) order_.resize(p);
    for (int s = 0; s < o.stages; ++s) model_.reserve_timeline(s, size_t(total()) + 1);
  }

  SimResult run() {
    std::vector<int> dirty;
    for (int s = 0; s < o_.stages; ++s) dirty.push_back(s);
    double now = 0;
    for (;;) {
      for (int s : dirty) dispatch(s, now);
      dirty.clear();
      if (events_.empty()) break;
      // Apply every event at the next time before anyone picks, so that a stage sees all the
      // work that becomes ready at the moment it frees up.
      now = events_.top().time;
      while (!events_.empty() && events_.top().time == now) {
        Event e = events_.top();
        events_.pop();
        apply(e, now);
        dirty.push_back(e.stage);
      }
      std::sort(dirty.begin(), dirty.end());
      dirty.erase(std::unique(dirty.begin(), dirty.end()), dirty.end());
    }
    check_finished();
    SimResult& r = model_.result();
    if (model_.recording()) r.executed = executed();
    return std::move(r);
  }

 private:
  enum Kind { kDone, kForwardReady, kBackwardReady };
  struct Event {
    double time;
    uint64_t seq;  // ties run in the order they were posted
    int stage;
    Kind kind;
    int mb, chunk;  // of the data that arrived (kDone: the stage's running compute)
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.time != b.time ? a.time > b.time : a.seq > b.seq;
    }
  };
  struct StageState {
    schedule::StageDispatcher dispatcher;
    bool busy = false;
    Instruction running{};
    bool stepped = false;
  };

  int cap(int stage) const {
    return o_.stage_memory_caps.empty() ? o_.memory_cap : o_.stage_memory_caps[size_t(stage)];
  }
  int total() const { return stages_.empty() ? 0 : stages_[0].dispatcher.computes_total(); }

  void post(double time, int stage, Kind kind, int mb = -1, int chunk = -1) {
    events_.push({time, seq_++, stage, kind, mb, chunk});
  }

  void dispatch(int stage, double now) {
    StageState& st = stages_[size_t(stage)];
    if (st.busy || st.stepped) return;
    Instruction t;
    if (st.dispatcher.done()) {
      st.stepped = true;
      t = {Op::optimizer_step, -1, -1, -1};
    } else if (auto next = st.dispatcher.next()) {
      t = *next;
      if (t.op == Op::forward) model_.hold(stage, t.chunk);
      if (model_.recording()) order_[size_t(stage)].push_back(t);
    } else {
      return;  // waits for data
    }
    double end = now + model_.duration(stage, t.op, t.micro_batch, t.chunk);
    model_.compute(stage, t.op, t.micro_batch, t.chunk, now, end);
    st.busy = true;
    st.running = t;
    post(end, stage, kDone);
  }

  void apply(const Event& e, double now) {
    StageState& st = stages_[size_t(e.stage)];
    if (e.kind == kForwardReady) {
      st.dispatcher.forward_ready(e.mb, e.chunk);
      return;
    }
    if (e.kind == kBackwardReady) {
      st.dispatcher.backward_ready(e.mb, e.chunk);
      return;
    }
    st.busy = false;
    const Instruction t = st.running;
    if (t.op == Op::optimizer_step) return;
    st.dispatcher.finished(t);
    const int vs = model_.vs(e.stage, t.chunk);
    if (t.op == Op::forward) {
      if (vs < model_.last()) {  // the last one's backward is ready in its own dispatcher
        int to = model_.rank(vs + 1);
        double at = model_.remote_next(vs) ? model_.arrival(e.stage, to, vs, now) : now;
        post(at, to, kForwardReady, t.micro_batch, model_.chunk(vs + 1));
      }
    } else if (t.op == Op::backward || t.op == Op::backward_input) {
      if (vs > 0) {
        int to = model_.rank(vs - 1);
        double at = model_.remote_prev(vs) ? model_.arrival(e.stage, to, vs - 1, now) : now;
        post(at, to, kBackwardReady, t.micro_batch, model_.chunk(vs - 1));
      }
      if (t.op == Op::backward) model_.release(e.stage, t.chunk);
    } else {
      model_.release(e.stage, t.chunk);
    }
  }

  // The dispatcher's rule always progresses (schedule/dispatcher.h), so a stage left waiting is
  // a bug here or there, not a cap too small.
  void check_finished() const {
    std::string stalled;
    for (int s = 0; s < o_.stages; ++s) {
      const StageState& st = stages_[size_t(s)];
      if (st.stepped) continue;
      stalled +=
          fmt::format("{}stage {} ({})", stalled.empty() ? "" : "; ", s, st.dispatcher.describe());
    }
    if (!stalled.empty())
      throw std::logic_error(fmt::format(
          "simulate_greedy: the dispatcher stalled with every stage waiting ({} stages x {} "
          "chunks x {} micro-batches): {}; its rule cannot stall, so this is a bug",
          o_.stages, o_.chunks, o_.micro_batches, stalled));
  }

  // The order each stage ran, with receives and sends around the computes (generators' rule).
  schedule::Schedule executed() const {
    const int p = o_.stages;
    schedule::Schedule s{"greedy", p, o_.micro_batches, o_.chunks, {}};
    for (int stage = 0; stage < p; ++stage) {
      auto& list = s.per_stage.emplace_back();
      const int prev = (stage + p - 1) % p, next = (stage + 1) % p;
      for (const Instruction& c : order_[size_t(stage)]) {
        const int vs = model_.vs(stage, c.chunk);
        auto add = [&](Op op, int peer) { list.push_back({op, c.micro_batch, c.chunk, peer}); };
        if (c.op == Op::forward) {
          if (model_.remote_prev(vs)) add(Op::recv_activation, prev);
          add(Op::forward, -1);
          if (model_.remote_next(vs)) add(Op::send_activation, next);
        } else if (c.op == Op::backward_weight) {
          add(c.op, -1);
        } else {
          if (model_.remote_next(vs)) add(Op::recv_grad, next);
          add(c.op, -1);
          if (model_.remote_prev(vs)) add(Op::send_grad, prev);
        }
      }
      list.push_back({Op::optimizer_step, -1, -1, -1});
    }
    return s;
  }

  GreedyOptions o_;
  Model model_;
  std::vector<StageState> stages_;
  std::priority_queue<Event, std::vector<Event>, Later> events_;
  uint64_t seq_ = 0;
  std::vector<std::vector<Instruction>> order_;
};

}  // namespace

SimConfig uniform_config(int stages, int chunks, const StageCosts& costs) {
  TESSEL_CHECK(stages >= 1 && chunks >= 1, ConfigError,
               "uniform_config: stages ({}) and chunks ({}) must be >= 1", stages, chunks);
  SimConfig c;
  c.costs.assign(size_t(stages) * size_t(chunks), costs);
  return c;
}

double SimResult::bubble_fraction() const {
  if (makespan <= 0 || busy.empty()) return 0;
  double total = 0;
  for (double b : busy) total += b;
  return 1.0 - total / (double(busy.size()) * makespan);
}

SimResult simulate(const schedule::Schedule& schedule, const SimConfig& config) {
  return ListRun(schedule, config).run();
}

SimResult simulate_greedy(const GreedyOptions& o, const SimConfig& config) {
  TESSEL_CHECK(o.stages >= 1 && o.micro_batches >= 1 && o.chunks >= 1, ConfigError,
               "simulate_greedy: stages ({}), micro_batches ({}) and chunks ({}) must be >= 1",
               o.stages, o.micro_batches, o.chunks);
  TESSEL_CHECK(o.memory_cap >= 1, ConfigError,
               "simulate_greedy: memory_cap must be at least 1 activation, got {}", o.memory_cap);
  TESSEL_CHECK(o.stage_memory_caps.empty() || o.stage_memory_caps.size() == size_t(o.stages),
               ConfigError,
               "simulate_greedy: stage_memory_caps has {} entries, needs none or one per stage "
               "({})",
               o.stage_memory_caps.size(), o.stages);
  TESSEL_CHECK(o.stage_backward_caps.empty() || o.stage_backward_caps.size() == size_t(o.stages),
               ConfigError,
               "simulate_greedy: stage_backward_caps has {} entries, needs none or one per stage "
               "({})",
               o.stage_backward_caps.size(), o.stages);
  for (int c : o.stage_backward_caps)
    TESSEL_CHECK(c >= 0, ConfigError,
                 "simulate_greedy: stage_backward_caps must be 0 (none) or at least 1, got {}", c);
  for (int c : o.stage_memory_caps)
    TESSEL_CHECK(c >= 1, ConfigError,
                 "simulate_greedy: stage_memory_caps must be at least 1 activation, got {}", c);
  return GreedyRun(o, config).run();
}

}  // namespace tessel::planner
