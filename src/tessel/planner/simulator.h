// Discrete-event simulator of a pipeline step: runs a schedule's per-stage instruction lists
// (schedule/instruction.h), or a greedy dispatcher that picks the next instruction at run time,
// on per-virtual-stage costs, and reports makespan, bubble, per-stage memory and the timeline.
//
// Model (the execution model of instruction.h, with durations):
//   - A stage runs one compute at a time: F, B, Bi or Bw of one (micro_batch, chunk), then the
//     optimizer step after everything else. Its duration is the virtual stage's cost times the
//     stage's slowdown times an optional jitter factor.
//   - Sends are asynchronous and take no stage time. A message sent at time t from rank a to
//     rank b arrives at t + link(a, b).latency + bytes / link(a, b).bandwidth; links carry
//     messages independently (no contention). A receive waits until its message has arrived.
//     Neighbouring virtual stages on the same rank (only with one stage) hand data over
//     locally, with no message.
//   - Activations: starting an F takes one unit (and the virtual stage's activation_bytes) on
//     its stage; the end of its B, or of its Bw for a split backward (the weight gradient still
//     reads the stored inputs), returns it. Peaks are over the whole step.
//
// Times are in whatever unit the costs use (seconds for the planner); bytes are doubles so that
// large models do not overflow. Everything is deterministic: jitter draws from a hash of (seed,
// stage, op, micro_batch, chunk), so one instruction gets the same duration whatever order or
// dispatcher runs it, and a rerun with the same seed reproduces the timeline exactly.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tessel/schedule/instruction.h"

namespace tessel::planner {

// Costs of one micro-batch through one virtual stage (one model chunk on one rank). The planner's
// cost model fills one per virtual stage from its per-layer costs.
struct StageCosts {
  double forward = 1;
  double backward = 2;          // B: input and weight gradient together
  double backward_input = 1;    // Bi
  double backward_weight = 1;   // Bw
  double activation_bytes = 0;  // stored from the F's start until its B (or Bw) ends
  // Bytes of the F's output sent to the next virtual stage; the gradient sent back to this
  // virtual stage's F has the same size.
  double output_bytes = 0;
};

// A one-way point-to-point link: a message of n bytes takes latency + n / bandwidth.
struct Link {
  double latency = 0;
  double bandwidth = std::numeric_limits<double>::infinity();  // bytes per time unit
  double transfer_time(double bytes) const { return latency + bytes / bandwidth; }
};

struct SimConfig {
  // One entry per virtual stage vs = chunk * stages + stage (size stages * chunks).
  std::vector<StageCosts> costs = {};
  // Per stage (size stages), or empty for a free optimizer step.
  std::vector<double> optimizer_step = {};
  Link link;                     // between every pair of ranks, unless `links` is given
  std::vector<Link> links = {};  // empty, or stages * stages entries: links[from * stages + to]
  // Per-stage compute multipliers (> 0; 2 = twice as slow), or empty for all 1.
  std::vector<double> slowdown = {};
  // Each compute and optimizer step is multiplied by 1 + jitter * u, u uniform in [-1, 1).
  // jitter in [0, 1); 0 disables it.
  double jitter = 0;
  // Per stage (size stages) instead of `jitter`, or empty.
  std::vector<double> stage_jitter = {};
  uint64_t seed = 0;
  // Off skips the timeline (and the greedy dispatcher's `executed` schedule): for plan searches
  // that need only the numbers.
  bool record_timeline = true;
};

// Costs for `stages * chunks` equal virtual stages.
SimConfig uniform_config(int stages, int chunks, const StageCosts& costs);

// One executed compute (or the optimizer step, with micro_batch = chunk = -1).
struct TimelineEntry {
  schedule::Op op = schedule::Op::forward;
  int micro_batch = -1;
  int chunk = -1;
  double start = 0;
  double end = 0;
  bool operator==(const TimelineEntry&) const = default;
};

struct SimResult {
  std::string name;  // the schedule's name, or "greedy"
  int stages = 0;
  int micro_batches = 0;
  int chunks = 1;
  double makespan = 0;                        // when the last stage finishes its optimizer step
  std::vector<double> busy;                   // per stage: compute plus optimizer step time
  std::vector<int> peak_in_flight;            // per stage, in (micro_batch, chunk) units
  std::vector<double> peak_activation_bytes;  // per stage
  // Per stage, in execution order (empty unless record_timeline).
  std::vector<std::vector<TimelineEntry>> timeline;
  // The greedy dispatcher's choices as a static schedule (receives before the compute that
  // consumes them, sends right after the one that produces them); it passes schedule::validate
  // and simulate() replays it to the same timeline. Empty for simulate() and without
  // record_timeline.
  schedule::Schedule executed;

  // Idle share of all stages' time: 1 - sum(busy) / (stages * makespan); 0 for an empty step.
  double bubble_fraction() const;
};

// Runs the schedule's lists in order. The schedule should pass schedule::validate (not repeated
// here). Throws ConfigError when the config does not fit the schedule (sizes, a negative cost, a
// slowdown <= 0, jitter outside [0, 1), a bandwidth <= 0) and InvalidArgumentError when the
// lists cannot run: a compute before its inputs, or every unfinished stage waiting on a receive
// whose send never runs (deadlock).
SimResult simulate(const schedule::Schedule& schedule, const SimConfig& config);

// The greedy dispatcher: no fixed lists. Each stage's choices come from a
// schedule::StageDispatcher (schedule/dispatcher.h, the rule the runtime's adaptive executor
// runs too, where the rule is spelled out): whenever a stage is idle it starts, by and large,
// the ready backward (B, or Bi when split) with the lowest micro-batch, else the ready forward
// with the lowest (micro_batch, chunk) that the stage's caps admit, else (split only) the oldest
// pending Bw -- with forwards first while a backward cap is not reached, and on the first
// virtual stage. Events at the same time are all applied before any stage picks. After its last
// compute a stage runs its optimizer step.
//
// How it compares with 1F1B's fixed order (simulator_test.cpp checks each): with equal stages
// and caps p - s it runs exactly 1F1B's timeline, and with cap p 1F1B's makespan. With a slow
// stage and cap p it can win, by running forwards in the room above 1F1B's p - s while a stage
// waits for a gradient. The first virtual stage runs a forward the cap admits before its own
// backward (which unblocks no one), so a slow first stage paces it as it paces 1F1B. A slow
// last stage gives both the same makespan. With split backward, memory caps min(m, p) and
// backward caps 1F1B's min(m, p - s) (layout::Plan's defaults for `adaptive`), equal stages run
// at ZB-H1's makespan.
struct GreedyOptions {
  int stages = 1;
  int micro_batches = 1;
  int chunks = 1;
  int memory_cap = 1;  // activations in flight per stage, >= 1 (the bound is below)
  // Per-stage caps (size stages, each >= 1) instead of memory_cap when not empty; e.g. p - s
  // gives every stage 1F1B's activation budget.
  std::vector<int> stage_memory_caps = {};
  // Per-stage backward caps (schedule::DispatchOptions::backward_cap; empty: none).
  std::vector<int> stage_backward_caps = {};
  bool split_backward = false;  // Bi then Bw instead of B
  // Where the chunks sit: interleaved, or (chunks 2) zb-v's V.
  schedule::Placement placement = schedule::Placement::interleaved;
};

// Throws ConfigError for sizes or a cap below 1 and for a config that does not fit. Any cap
// finishes: with one chunk a stage never holds more than its cap; with v chunks at most
// cap + v - 1 (the oldest micro-batch's later chunks are admitted above the cap, so that a stage
// full of newer chunk-0 forwards cannot block them).
SimResult simulate_greedy(const GreedyOptions& options, const SimConfig& config);

}  // namespace tessel::planner
