#include "tessel/schedule/validate.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "tessel/core/check.h"

namespace tessel::schedule {
namespace {

constexpr int kOps = int(Op::recompute) + 1;

// Sizes and neighbour relations of one schedule; (micro_batch, virtual stage) pairs index flat
// tables as vs * m + mb.
struct Shape {
  int p, m, v;
  Placement placement = Placement::interleaved;
  int vs(int stage, int chunk) const { return virtual_stage(p, stage, chunk, placement); }
  int rank(int vs) const { return stage_of(p, vs, placement); }
  int chunk(int vs) const { return chunk_of(p, vs, placement); }
  int last() const { return p * v - 1; }
  // Whether the previous / next virtual stage exists and lives on another rank.
  bool remote_prev(int vs) const { return vs > 0 && rank(vs - 1) != rank(vs); }
  bool remote_next(int vs) const { return vs < last() && rank(vs + 1) != rank(vs); }
  int index(int vs, int mb) const { return vs * m + mb; }
  size_t table_size() const { return size_t(p) * v * m; }
};

std::string at(const Schedule& s, int stage, size_t i) {
  return fmt::format("schedule '{}' stage {} instruction {} ({})", s.name, stage, i,
                     to_string(s.per_stage[stage][i]));
}

void check_fields(const Schedule& s, const Shape& sh, int stage, size_t i) {
  const Instruction& in = s.per_stage[stage][i];
  if (in.op == Op::optimizer_step) {
    TESSEL_CHECK(in.micro_batch == -1 && in.chunk == -1 && in.peer == -1, InvalidArgumentError,
                 "{}: optimizer_step takes no micro_batch, chunk or peer (all must be -1)",
                 at(s, stage, i));
    return;
  }
  TESSEL_CHECK(in.micro_batch >= 0 && in.micro_batch < sh.m, InvalidArgumentError,
               "{}: micro_batch out of range [0, {})", at(s, stage, i), sh.m);
  TESSEL_CHECK(in.chunk >= 0 && in.chunk < sh.v, InvalidArgumentError,
               "{}: chunk out of range [0, {})", at(s, stage, i), sh.v);
  int vs = sh.vs(stage, in.chunk);
  bool towards_next = in.op == Op::send_activation || in.op == Op::recv_grad;
  if (is_compute(in.op)) {
    TESSEL_CHECK(in.peer == -1, InvalidArgumentError, "{}: compute takes no peer (must be -1)",
                 at(s, stage, i));
  } else if (towards_next) {
    TESSEL_CHECK(sh.remote_next(vs), InvalidArgumentError,
                 "{}: virtual stage {} has no next virtual stage on another rank to talk to",
                 at(s, stage, i), vs);
    TESSEL_CHECK(in.peer == sh.rank(vs + 1), InvalidArgumentError,
                 "{}: peer must be {}, the rank of virtual stage {}", at(s, stage, i),
                 sh.rank(vs + 1), vs + 1);
  } else {
    TESSEL_CHECK(sh.remote_prev(vs), InvalidArgumentError,
                 "{}: virtual stage {} has no previous virtual stage on another rank to talk to",
                 at(s, stage, i), vs);
    TESSEL_CHECK(in.peer == sh.rank(vs - 1), InvalidArgumentError,
                 "{}: peer must be {}, the rank of virtual stage {}", at(s, stage, i),
                 sh.rank(vs - 1), vs - 1);
  }
}

void check_counts(const Schedule& s, const Shape& sh, int stage) {
  const std::vector<Instruction>& list = s.per_stage[stage];
  // count[op][chunk * m + mb]
  std::array<std::vector<int>, kOps> count;
  for (auto& c : count) c.assign(size_t(sh.v) * sh.m, 0);
  for (const Instruction& in : list)
    if (in.op != Op::optimizer_step) ++count[int(in.op)][in.chunk * sh.m + in.micro_batch];

  for (int chunk = 0; chunk < sh.v; ++chunk) {
    int vs = sh.vs(stage, chunk);
    for (int mb = 0; mb < sh.m; ++mb) {
      auto n = [&](Op op) { return count[int(op)][chunk * sh.m + mb]; };
      auto expect = [&](Op op, int want) {
        TESSEL_CHECK(n(op) == want, InvalidArgumentError,
                     "schedule '{}' stage {}: micro_batch {} chunk {} has {} {} instruction(s), "
                     "expected {}",
                     s.name, stage, mb, chunk, n(op), op_code(op), want);
      };
      expect(Op::forward, 1);
      TESSEL_CHECK(n(Op::recompute) <= 1 && (n(Op::recompute) == 0 || n(Op::backward) == 1),
                   InvalidArgumentError,
                   "schedule '{}' stage {}: micro_batch {} chunk {} has {} R; a recomputation "
                   "runs at most once, before a whole B",
                   s.name, stage, mb, chunk, n(Op::recompute));
      bool whole =
          n(Op::backward) == 1 && n(Op::backward_input) == 0 && n(Op::backward_weight) == 0;
      bool split =
          n(Op::backward) == 0 && n(Op::backward_input) == 1 && n(Op::backward_weight) == 1;
      TESSEL_CHECK(whole || split, InvalidArgumentError,
                   "schedule '{}' stage {}: micro_batch {} chunk {} has {} B, {} Bi and {} Bw; "
                   "expected one B, or one Bi and one Bw",
                   s.name, stage, mb, chunk, n(Op::backward), n(Op::backward_input),
                   n(Op::backward_weight));
      // Sends and receives towards a neighbour that is not remote were rejected field by field.
      if (sh.remote_prev(vs)) {
        expect(Op::recv_activation, 1);
        expect(Op::send_grad, 1);
      }
      if (sh.remote_next(vs)) {
        expect(Op::send_activation, 1);
        expect(Op::recv_grad, 1);
      }
    }
  }
  auto steps = std::count_if(list.begin(), list.end(),
                             [](const Instruction& in) { return in.op == Op::optimizer_step; });
  TESSEL_CHECK(steps == 1 && list.back().op == Op::optimizer_step, InvalidArgumentError,
               "schedule '{}' stage {}: needs exactly one optimizer_step, as its last instruction",
               s.name, stage);
}

// Runs all stages in order; see validate.h for the rules.
class DryRunner {
 public:
  DryRunner(const Schedule& s, const Shape& sh, const DryRunCosts& costs)
      : s_(s), sh_(sh), costs_(costs), pc_(size_t(sh.p), 0), clock_(size_t(sh.p), 0.0) {
    for (auto* t : {&forward_, &input_grad_, &recv_act_, &recv_grad_, &sent_act_, &sent_grad_})
      t->assign(sh.table_size(), kNotYet);
    result_.peak_in_flight.assign(size_t(sh.p), 0);
    result_.busy.assign(size_t(sh.p), 0.0);
    in_flight_.assign(size_t(sh.p), 0);
  }

  DryRun run() {
    for (;;) {
      bool progress = false, finished = true;
      for (int stage = 0; stage < sh_.p; ++stage) {
        const auto& list = s_.per_stage[stage];
        while (pc_[stage] < list.size() && step(stage)) {
          ++pc_[stage];
          progress = true;
        }
        finished = finished && pc_[stage] == list.size();
      }
      if (finished) break;
      if (!progress) report_deadlock();
    }
    result_.makespan = *std::max_element(clock_.begin(), clock_.end());
    return result_;
  }

 private:
  static constexpr double kNotYet = -1;

  // Runs the instruction at stage's pc; false when it is a receive whose send has not run yet.
  bool step(int stage) {
    const size_t i = pc_[stage];
    const Instruction& in = s_.per_stage[stage][i];
    if (in.op == Op::optimizer_step) return true;  // counts put it last, after all compute
    const int vs = sh_.vs(stage, in.chunk), mb = in.micro_batch;
    const int here = sh_.index(vs, mb);
    double& clock = clock_[stage];
    auto require = [&](bool ok, const char* what) {
      TESSEL_CHECK(ok, InvalidArgumentError, "{} runs before {} on this stage", at(s_, stage, i),
                   what);
    };
    auto compute = [&](double cost) {
      clock += cost;
      result_.busy[stage] += cost;
    };
    switch (in.op) {
      case Op::forward:
        if (sh_.remote_prev(vs))
          require(recv_act_[here] != kNotYet, "its recv_activation");
        else if (vs > 0)
          require(forward_[sh_.index(vs - 1, mb)] != kNotYet, "the F of the previous chunk");
        compute(costs_.forward);
        forward_[here] = clock;
        result_.peak_in_flight[stage] =
            std::max(result_.peak_in_flight[stage], ++in_flight_[stage]);
        return true;
      case Op::backward:
      case Op::backward_input:
        require(forward_[here] != kNotYet, "its F");
        if (sh_.remote_next(vs))
          require(recv_grad_[here] != kNotYet, "its recv_grad");
        else if (vs < sh_.last())
          require(input_grad_[sh_.index(vs + 1, mb)] != kNotYet, "the B of the next chunk");
        compute(in.op == Op::backward ? costs_.backward : costs_.backward_input);
        input_grad_[here] = clock;
        if (in.op == Op::backward) --in_flight_[stage];
        return true;
      case Op::recompute:
        require(forward_[here] != kNotYet, "its F");
        TESSEL_CHECK(input_grad_[here] == kNotYet, InvalidArgumentError,
                     "{} runs after its B on this stage; a recomputation must come before it",
                     at(s_, stage, i));
        compute(costs_.forward);
        return true;
      case Op::backward_weight:
        require(input_grad_[here] != kNotYet, "its Bi");
        compute(costs_.backward_weight);
        --in_flight_[stage];
        return true;
      case Op::send_activation:
        require(forward_[here] != kNotYet, "the F that produces it");
        sent_act_[here] = clock;
        return true;
      case Op::send_grad:
        require(input_grad_[here] != kNotYet, "the B or Bi that produces it");
        sent_grad_[here] = clock;
        return true;
      case Op::recv_activation:
      case Op::recv_grad: {
        bool act = in.op == Op::recv_activation;
        double sent = act ? sent_act_[sh_.index(vs - 1, mb)] : sent_grad_[sh_.index(vs + 1, mb)];
        if (sent == kNotYet) return false;
        clock = std::max(clock, sent);
        (act ? recv_act_ : recv_grad_)[here] = clock;
        return true;
      }
      case Op::optimizer_step:
        break;
    }
    return true;
  }

  [[noreturn]] void report_deadlock() const {
    std::string waits;
    for (int stage = 0; stage < sh_.p; ++stage) {
      const auto& list = s_.per_stage[stage];
      if (pc_[stage] == list.size()) continue;
      const Instruction& in = list[pc_[stage]];
      bool act = in.op == Op::recv_activation;
      int from = sh_.vs(stage, in.chunk) + (act ? -1 : 1);
      Instruction send{act ? Op::send_activation : Op::send_grad, in.micro_batch, sh_.chunk(from),
                       stage};
      waits += fmt::format("{}stage {} waits at instruction {} ({}) for {} on stage {}",
                           waits.empty() ? "" : "; ", stage, pc_[stage], to_string(in),
                           to_string(send), in.peer);
    }
    TESSEL_THROW(InvalidArgumentError, "schedule '{}' deadlocks: {}", s_.name, waits);
  }

  const Schedule& s_;
  const Shape& sh_;
  const DryRunCosts& costs_;
  std::vector<size_t> pc_;
  std::vector<double> clock_;
  std::vector<int> in_flight_;
  // Per (vs, mb): when it happened, or kNotYet.
  std::vector<double> forward_, input_grad_, recv_act_, recv_grad_, sent_act_, sent_grad_;
  DryRun result_;
};

}  // namespace

double DryRun::bubble_fraction() const {
  double total = 0;
  for (double b : busy) total += b;
  if (makespan <= 0) return 0;
  return 1.0 - total / (double(busy.size()) * makespan);
}

DryRun validate(const Schedule& s, const DryRunCosts& costs) {
  TESSEL_CHECK(s.stages >= 1 && s.micro_batches >= 1 && s.chunks >= 1, InvalidArgumentError,
               "schedule '{}': stages ({}), micro_batches ({}) and chunks ({}) must be >= 1",
               s.name, s.stages, s.micro_batches, s.chunks);
  TESSEL_CHECK(s.per_stage.size() == size_t(s.stages), InvalidArgumentError,
               "schedule '{}': has {} instruction lists for {} stages", s.name, s.per_stage.size(),
               s.stages);
  TESSEL_CHECK(s.placement != Placement::v_shape || s.chunks == 2, InvalidArgumentError,
               "schedule '{}': a V-shaped placement has 2 chunks per stage, not {}", s.name,
               s.chunks);
  const Shape sh{s.stages, s.micro_batches, s.chunks, s.placement};
  for (int stage = 0; stage < sh.p; ++stage)
    for (size_t i = 0; i < s.per_stage[stage].size(); ++i) check_fields(s, sh, stage, i);
  for (int stage = 0; stage < sh.p; ++stage) check_counts(s, sh, stage);
  return DryRunner(s, sh, costs).run();
}

}  // namespace tessel::schedule
