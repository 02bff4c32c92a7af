// Reporting training progress: JSON-lines metrics for machines and a progress line for people.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>

namespace tessel::runtime {

// Appends one JSON object per line and flushes it, so a crash loses at most the line in flight
// and `tail -f` works while training runs.
class MetricsWriter {
 public:
  MetricsWriter() = default;
  // Opens `path` for appending (empty path: a writer that drops everything). Throws IoError.
  explicit MetricsWriter(const std::string& path);
  void write(const nlohmann::json& record);

 private:
  std::ofstream out_;
};

// One progress line per step. On a terminal it rewrites itself in place
// ("step 120/500 | loss 2.314 | 18.2k tok/s | ETA 1m12s"); otherwise it prints a log line every
// `log_every` steps and at the last step.
class ProgressLine {
 public:
  ProgressLine(int64_t total_steps, int64_t log_every);
  void step(int64_t step, double loss, double lr, double tokens_per_s, double seconds_per_step);
  // Prints a message on its own line (e.g. an eval result) without garbling the progress line.
  void message(const std::string& text);
  void finish();

 private:
  int64_t total_, log_every_;
  bool tty_;
  bool line_open_ = false;
};

std::string format_duration(double seconds);
std::string format_rate(double per_second);

}  // namespace tessel::runtime
