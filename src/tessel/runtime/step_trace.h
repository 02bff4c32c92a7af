// output.trace: the real timeline of a few training steps, every rank on one file that Perfetto
// (ui.perfetto.dev) or chrome://tracing opens -- the measured counterpart of
// `tessel simulate --trace`, in the same Chrome trace-event format (planner/trace.h).
//
// Each rank records, for output.trace_steps steps starting at the second step this launch runs
// (the first one allocates and warms caches, so it is not typical), one slice per phase of the
// step ("step", "load", "pipeline", "grad reduce", "optimizer", "loss reduce") and, inside the
// pipeline, one per compute, named like the schedule text ("F3.0", "Bi2.1", "Bw2.1", "R3.0", with
// any injected delay), and one per wait ("wait recvA3.0<1", "wait sends", "wait arrival"). The
// slices of one rank nest on one track. When the window ends, the ranks all-gather their slices
// over the world and rank 0 writes the file: one track per rank, named with its (dp, tp, pp)
// coordinate. Times are wall-clock (system_clock) microseconds from the window's first slice, so
// the tracks of ranks on different hosts line up as well as their clocks agree (NTP: about a
// millisecond); on one host they are exact.
//
// A failure inside the window (a peer lost, a re-plan) drops that window; nothing is written and
// training goes on. Cost outside the window: one branch per slice.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace tessel::comm {
class Communicator;
}

namespace tessel::runtime {

class StepTracer {
 public:
  using Clock = std::chrono::system_clock;

  StepTracer() = default;  // disabled
  // `path` empty disables. `steps` >= 1: how many steps to record.
  StepTracer(std::string path, int steps);

  bool enabled() const { return !path_.empty(); }
  // Called at the start of each step of this launch; true when the step is recorded.
  bool begin_step();
  // True while the current step is recorded.
  bool active() const { return recording_; }
  // Records [t0, t1) on this rank's track (no-op unless active()). `detail` goes into args.
  void slice(std::string name, std::string category, Clock::time_point t0, Clock::time_point t1,
             std::string detail = {});
  // Called at the end of each recorded step: when it was the window's last, gathers every rank's
  // slices over `world` (collective: every rank of the world calls it at the same step) and rank
  // 0 writes the trace. `label` names this rank's track ("rank 3 (dp 0, tp 1, pp 1)"); a
  // `generation` above 0 writes beside the path (trace.json -> trace.g2.json). Throws IoError when
  // rank 0 cannot write the file.
  void end_step(comm::Communicator& world, const std::string& label, int generation = 0);
  // Where generation `generation`'s trace goes.
  static std::string path_of(const std::string& path, int generation);
  // Forgets a window a failure interrupted (the next launch of the step starts a new one).
  void reset();

  // Parses the gathered slices of all ranks (the all-gather's bytes) into the trace's JSON; the
  // tested half of end_step.
  struct Slice {
    std::string name, category, detail;
    int64_t start_us = 0, dur_us = 0;
  };
  static std::string encode(const std::string& label, const std::vector<Slice>& slices);
  static std::string merged_json(const std::vector<std::string>& ranks);

 private:
  std::string path_;
  int steps_ = 0;
  int launched_ = 0;  // steps begun in this launch
  int recorded_ = 0;  // steps recorded in the current window
  bool recording_ = false;
  bool written_ = false;
  std::vector<Slice> slices_;
};

// Times a scope as one slice of `tracer` (when it is active at the scope's start).
class TraceScope {
 public:
  TraceScope(StepTracer* tracer, const char* name, const char* category)
      : tracer_(tracer && tracer->active() ? tracer : nullptr), name_(name), category_(category) {
    if (tracer_) t0_ = StepTracer::Clock::now();
  }
  ~TraceScope() {
    try {
      if (tracer_) tracer_->slice(name_, category_, t0_, StepTracer::Clock::now());
    } catch (...) {
      // Out of memory for a slice: the trace misses it, the step goes on.
    }
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  StepTracer* tracer_;
  const char* name_;
  const char* category_;
  StepTracer::Clock::time_point t0_;
};

}  // namespace tessel::runtime
