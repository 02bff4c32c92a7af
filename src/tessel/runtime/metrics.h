// Reporting training progress: JSON-lines metrics for machines and a progress line for people.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace tessel::runtime {

// Appends one JSON object per line and writes it at once, so a crash loses at most the line in
// flight and `tail -f` works while training runs. A line that cannot be written (a full disk,
// /dev/full) does not stop training: the first failure is logged, and the path is kept in
// incomplete_outputs(), which the run checks at its end -- a run whose outputs are incomplete
// says so and does not end as a success.
class MetricsWriter {
 public:
  MetricsWriter() = default;
  // Opens `path` for appending (empty path: a writer that drops everything). Throws IoError.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const nlohmann::json& record);

 private:
  void fail(const std::string& why);

  std::string path_;
  int fd_ = -1;
  bool failed_ = false;
};

// "<path>: <why>" for every output file of this process that lost a write, in order.
std::vector<std::string> incomplete_outputs();
// Adds one ("<what>: <why>"), for outputs written elsewhere (a checkpoint that could not be saved).
void record_incomplete_output(const std::string& what);

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
