#include "tessel/runtime/step_trace.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "tessel/comm/communicator.h"
#include "tessel/core/check.h"
#include "tessel/core/error.h"
#include "tessel/planner/trace.h"

namespace tessel::runtime {

StepTracer::StepTracer(std::string path, int steps) : path_(std::move(path)), steps_(steps) {
  TESSEL_CHECK(steps_ >= 1 || path_.empty(), ConfigError,
               "output.trace_steps is {}; record at least 1 step", steps_);
}

bool StepTracer::begin_step() {
  ++launched_;
  // The previous step did not end (it failed): its window is incomplete, start again.
  if (recording_) reset();
  // The launch's first step allocates its buffers and warms the caches: start at the second.
  recording_ = enabled() && !written_ && launched_ >= 2;
  return recording_;
}

void StepTracer::slice(std::string name, std::string category, Clock::time_point t0,
                       Clock::time_point t1, std::string detail) {
  if (!recording_) return;
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  slices_.push_back({std::move(name), std::move(category), std::move(detail),
                     duration_cast<microseconds>(t0.time_since_epoch()).count(),
                     duration_cast<microseconds>(t1 - t0).count()});
}

void StepTracer::reset() {
  slices_.clear();
  recorded_ = 0;
  recording_ = false;
}

std::string StepTracer::encode(const std::string& label, const std::vector<Slice>& slices) {
  nlohmann::json j = {{"label", label}, {"slices", nlohmann::json::array()}};
  for (const auto& s : slices)
    j["slices"].push_back({s.name, s.category, s.detail, s.start_us, s.dur_us});
  return j.dump();
}

std::string StepTracer::merged_json(const std::vector<std::string>& ranks) {
  planner::Trace trace;
  trace.process_names[0] = "training";
  std::vector<nlohmann::json> parsed;
  int64_t origin = std::numeric_limits<int64_t>::max();
  for (const auto& text : ranks) {
    auto j = nlohmann::json::parse(text, nullptr, false);
    TESSEL_CHECK(!j.is_discarded() && j.contains("slices"), CorruptDataError,
                 "output.trace: a rank's slices did not arrive whole ({} bytes)", text.size());
    for (const auto& s : j["slices"]) origin = std::min(origin, s[3].get<int64_t>());
    parsed.push_back(std::move(j));
  }
  if (origin == std::numeric_limits<int64_t>::max()) origin = 0;
  for (size_t r = 0; r < parsed.size(); ++r) {
    const int track = int(r);
    trace.track_names[{0, track}] = parsed[r]["label"].get<std::string>();
    for (const auto& s : parsed[r]["slices"]) {
      planner::TraceEvent e;
      e.name = s[0].get<std::string>();
      e.category = s[1].get<std::string>();
      e.track = track;
      e.start_us = double(s[3].get<int64_t>() - origin);
      e.dur_us = double(s[4].get<int64_t>());
      if (const auto detail = s[2].get<std::string>(); !detail.empty()) e.args["detail"] = detail;
      trace.events.push_back(std::move(e));
    }
  }
  trace.other_data["clock"] = "wall-clock microseconds from the first slice";
  trace.other_data["origin_unix_us"] = origin;
  return planner::to_json(trace).dump();
}

std::string StepTracer::path_of(const std::string& path, int generation) {
  if (generation <= 0) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() /
          (p.stem().string() + ".g" + std::to_string(generation) + p.extension().string()))
      .string();
}

void StepTracer::end_step(comm::Communicator& world, const std::string& label, int generation) {
  if (!recording_) return;
  recording_ = false;
  if (++recorded_ < steps_) return;
  written_ = true;
  const std::string mine = encode(label, slices_);
  slices_.clear();
  const int n = world.size();
  std::vector<int64_t> sizes(size_t(n), 0);
  const int64_t my_size = int64_t(mine.size());
  world.all_gather(&my_size, 1, sizes.data());
  std::vector<size_t> counts(sizes.begin(), sizes.end());
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::vector<uint8_t> all(total);
  world.all_gather_v(reinterpret_cast<const uint8_t*>(mine.data()), counts, all.data());
  if (world.rank() != 0) return;
  std::vector<std::string> ranks;
  size_t at = 0;
  for (size_t c : counts) {
    ranks.emplace_back(reinterpret_cast<const char*>(all.data() + at), c);
    at += c;
  }
  const std::string doc = merged_json(ranks);
  // Through a temporary file: a reader never sees half a trace.
  const std::string path = path_of(path_, generation);
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  out << doc << '\n';
  out.close();
  TESSEL_CHECK(out.good(), IoError, "output.trace: cannot write {} (is its directory writable?)",
               tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  TESSEL_CHECK(!ec, IoError, "output.trace: cannot rename {} to {}: {}", tmp, path, ec.message());
}

}  // namespace tessel::runtime
