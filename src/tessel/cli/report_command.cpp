#include "tessel/cli/report_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "tessel/cli/output_guard.h"
#include "tessel/cli/run_report.h"
#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"

namespace tessel::cli {

namespace {

namespace fs = std::filesystem;

struct ReportArgs {
  std::string run_dir;
  std::string metrics;
  std::string events;
  std::string out;
  std::string title;
  bool force = false;
};

// `path` must name a file that exists: `what` says which, `fix` how to name another.
void check_input_file(const std::string& path, std::string_view what, std::string_view fix) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  TESSEL_CHECK(fs::exists(status), ConfigError, "{} {} does not exist; {}", what, path, fix);
  TESSEL_CHECK(!fs::is_directory(status), ConfigError, "{} {} is a directory, not a file; {}", what,
               path, fix);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSEL_CHECK(in.is_open(), IoError, "cannot open {}: {}", path, std::strerror(errno));
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  TESSEL_CHECK(!in.bad(), IoError, "cannot read {}: {}", path, std::strerror(errno));
  return text;
}

int run_report(const ReportArgs& a) {
  TESSEL_CHECK(!a.run_dir.empty() || !a.metrics.empty(), ConfigError,
               "tessel report needs a run directory (one holding metrics.jsonl) or --metrics FILE");
  if (!a.run_dir.empty()) {
    std::error_code ec;
    const auto status = fs::status(a.run_dir, ec);
    TESSEL_CHECK(fs::exists(status), ConfigError,
                 "run directory {} does not exist; give the directory a run wrote its "
                 "metrics.jsonl to (its config's output.metrics), or --metrics FILE",
                 a.run_dir);
    TESSEL_CHECK(fs::is_directory(status), ConfigError,
                 "{} is not a directory; give the run's directory, or the file with --metrics "
                 "FILE",
                 a.run_dir);
  }
  const std::string metrics =
      !a.metrics.empty() ? a.metrics : (fs::path(a.run_dir) / "metrics.jsonl").string();
  if (!a.metrics.empty())
    check_input_file(metrics, "--metrics", "name the run's metrics file (output.metrics)");
  else
    check_input_file(metrics, "the metrics file",
                     fmt::format("is {} the run's directory? Its config's output.metrics names "
                                 "the file; give that with --metrics FILE",
                                 a.run_dir));
  std::string events = a.events;
  if (!events.empty()) {
    check_input_file(events, "--events", "name the run's events file (output.events)");
  } else if (!a.run_dir.empty()) {
    // Optional: a run that never changed its plan may have written none.
    const auto beside = (fs::path(a.run_dir) / "events.jsonl").string();
    std::error_code ec;
    if (fs::is_regular_file(beside, ec)) events = beside;
  }
  const std::string out =
      !a.out.empty()
          ? a.out
          : ((a.run_dir.empty() ? fs::path(metrics).parent_path() : fs::path(a.run_dir)) /
             "report.html")
                .string();
  std::vector<std::string> inputs = {metrics};
  if (!events.empty()) inputs.push_back(events);
  check_output_file(out, inputs, a.force || a.out.empty(), "--out");

  RunRecords run;
  run.metrics_source = metrics;
  run.events_source = events;
  run.title = !a.title.empty()
                  ? a.title
                  : fmt::format("tessel run: {}", a.run_dir.empty() ? metrics : a.run_dir);
  run.steps = parse_metrics_lines(read_text(metrics), metrics);
  if (!events.empty()) run.events = parse_event_lines(read_text(events), events);
  // Nothing is written before everything is read and rendered: a bad input leaves no page.
  write_file_atomically(out, render_run_report(run));
  fmt::print("wrote {}: {} metrics lines, {} events\n", out, run.steps.size(), run.events.size());
  return 0;
}

}  // namespace

void add_report_command(CLI::App& app, std::function<int()>& action) {
  auto args = std::make_shared<ReportArgs>();
  auto* cmd = app.add_subcommand(
      "report", "write a training run's metrics and events as one HTML page with charts");
  cmd->add_option("run_dir", args->run_dir,
                  "the run's directory: reads metrics.jsonl and events.jsonl there, writes "
                  "report.html there");
  cmd->add_option("--metrics", args->metrics,
                  "the metrics file (a config's output.metrics), instead of RUN_DIR/metrics.jsonl");
  cmd->add_option("--events", args->events,
                  "the events file (a config's output.events), instead of RUN_DIR/events.jsonl");
  cmd->add_option("--out", args->out,
                  "the page to write (default: report.html in RUN_DIR, or beside --metrics)");
  cmd->add_option("--title", args->title, "the page's heading (default: the run's directory)");
  cmd->add_flag("--force", args->force, "replace the --out file if it exists");
  cmd->callback([args, &action] { action = [args] { return run_report(*args); }; });
}

}  // namespace tessel::cli
