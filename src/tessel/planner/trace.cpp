#include "tessel/planner/trace.h"

#include <fmt/format.h>

#include <fstream>

#include "tessel/core/check.h"

namespace tessel::planner {

nlohmann::json to_json(const Trace& trace) {
  nlohmann::json events = nlohmann::json::array();
  auto metadata = [&](const char* what, int pid, const int* tid, nlohmann::json args) {
    nlohmann::json e = {{"name", what}, {"ph", "M"}, {"pid", pid}, {"args", std::move(args)}};
    if (tid) e["tid"] = *tid;
    events.push_back(std::move(e));
  };
  for (const auto& [pid, name] : trace.process_names) {
    metadata("process_name", pid, nullptr, {{"name", name}});
    metadata("process_sort_index", pid, nullptr, {{"sort_index", pid}});
  }
  for (const auto& [key, name] : trace.track_names) {
    metadata("thread_name", key.first, &key.second, {{"name", name}});
    metadata("thread_sort_index", key.first, &key.second, {{"sort_index", key.second}});
  }
  for (const TraceEvent& e : trace.events)
    events.push_back({{"name", e.name},
                      {"cat", e.category},
                      {"ph", "X"},
                      {"ts", e.start_us},
                      {"dur", e.dur_us},
                      {"pid", e.process},
                      {"tid", e.track},
                      {"args", e.args}});
  nlohmann::json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  if (!trace.other_data.empty()) doc["otherData"] = trace.other_data;
  return doc;
}

void write_trace(const Trace& trace, const std::filesystem::path& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TESSEL_CHECK(out.is_open(), IoError,
               "cannot open trace file '{}' for writing; check that its directory exists and is "
               "writable",
               path.string());
  out << to_json(trace).dump() << '\n';
  out.close();
  TESSEL_CHECK(!out.fail(), IoError, "writing trace file '{}' failed (disk full?)", path.string());
}

Trace simulation_trace(const SimResult& r, double us_per_unit) {
  Trace t;
  t.process_names[0] =
      fmt::format("simulated {} (p={} m={} v={})", r.name, r.stages, r.micro_batches, r.chunks);
  for (int s = 0; s < r.stages; ++s) t.track_names[{0, s}] = fmt::format("stage {}", s);
  for (size_t s = 0; s < r.timeline.size(); ++s)
    for (const TimelineEntry& e : r.timeline[s]) {
      schedule::Instruction in{e.op, e.micro_batch, e.chunk, -1};
      nlohmann::json args = {{"stage", s}};
      if (e.op != schedule::Op::optimizer_step) {
        args["micro_batch"] = e.micro_batch;
        args["chunk"] = e.chunk;
      }
      t.events.push_back({schedule::to_string(in), std::string(schedule::op_code(e.op)), 0, int(s),
                          e.start * us_per_unit, (e.end - e.start) * us_per_unit, std::move(args)});
    }
  t.other_data = {{"schedule", r.name},
                  {"stages", r.stages},
                  {"micro_batches", r.micro_batches},
                  {"chunks", r.chunks},
                  {"makespan_us", r.makespan * us_per_unit},
                  {"bubble_fraction", r.bubble_fraction()},
                  {"peak_in_flight", r.peak_in_flight},
                  {"peak_activation_bytes", r.peak_activation_bytes}};
  return t;
}

}  // namespace tessel::planner
