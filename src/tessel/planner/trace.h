// Chrome trace-event JSON, the format Perfetto (ui.perfetto.dev) and chrome://tracing open:
//
//   {"traceEvents": [
//      {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "..."}},
//      {"name": "thread_name", "ph": "M", "pid": 0, "tid": 2, "args": {"name": "stage 2"}},
//      {"name": "F3.0", "cat": "F", "ph": "X", "ts": 12.5, "dur": 1.0, "pid": 0, "tid": 2,
//       "args": {...}}, ...],
//    "displayTimeUnit": "ms", "otherData": {...}}
//
// ts and dur are in microseconds. Every event is a complete ("X") slice on one track (a thread
// of a process); slices on one track should nest or not overlap, which holds for anything that
// runs one thing at a time (a pipeline stage, a rank's compute stream).
//
// The writer is generic so that the runtime can record real step timelines the same way; the
// simulator's timeline is one conversion (simulation_trace).
#pragma once

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "tessel/planner/simulator.h"

namespace tessel::planner {

struct TraceEvent {
  std::string name = {};
  std::string category = {};
  int process = 0;  // "pid": a group of tracks (a run, a host)
  int track = 0;    // "tid": one timeline row (a stage, a rank, a stream)
  double start_us = 0;
  double dur_us = 0;
  nlohmann::json args = nlohmann::json::object();
};

struct Trace {
  std::vector<TraceEvent> events;
  std::map<int, std::string> process_names;                // by process
  std::map<std::pair<int, int>, std::string> track_names;  // by (process, track)
  nlohmann::json other_data = nlohmann::json::object();    // written as "otherData" if not empty
};

// The trace as a JSON document: name metadata first (with sort indexes so tracks appear in
// number order), then the events in the order given.
nlohmann::json to_json(const Trace& trace);

// Writes to_json(trace) to `path`. Throws IoError naming the path when it cannot be written.
void write_trace(const Trace& trace, const std::filesystem::path& path);

// A simulated step: process 0 named after the schedule, one track per stage ("stage s") with one
// slice per executed compute and optimizer step, named like the schedule text ("F3.0", "Bi2.1",
// "step") with the op code as category and micro_batch, chunk and stage in args. Simulator time
// is multiplied by us_per_unit (seconds -> microseconds by default). otherData holds makespan,
// bubble fraction and the per-stage peaks. Needs a result simulated with record_timeline.
Trace simulation_trace(const SimResult& result, double us_per_unit = 1e6);

}  // namespace tessel::planner
