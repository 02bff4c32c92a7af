// A training run's story as one self-contained HTML page (`tessel report`, report_command.h).
//
// The input is what a run writes as JSON lines: its metrics (output.metrics, one line per step,
// runtime/parallel_trainer.cpp) and its events (output.events, one line per reconfiguration or
// recovery, runtime/elastic_worker.cpp). parse_metrics_lines / parse_event_lines turn the text of
// those files into records, render_run_report turns records into the page: a header of what the
// files say about the run, inline SVG charts (loss and eval loss, tokens/s, workers with the plan
// of each segment, every event a vertical line with a hover title; pause and bytes moved per
// event as bars) and a table of the events. The page needs no network and no JavaScript; every
// text taken from the files is escaped.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::cli {

// One metrics line. Only step and loss are required; the others are absent in older files or
// in some layouts (eval_loss only on evaluation steps).
struct StepRecord {
  int64_t step = 0;  // 1-based: the step this line ends
  double loss = 0;
  std::optional<double> eval_loss;
  std::optional<double> tokens_per_s;
  std::optional<double> step_s;
  std::optional<double> time;  // Unix seconds at the step's end
  std::optional<double> elapsed_s;
  std::optional<int64_t> workers;
  std::optional<int64_t> cursor;
  std::string model;  // when a line names it
};

// One events line: a reconfiguration ("reconfigure": timeline, scale request, planned leave)
// or a failure's recovery ("recover").
struct RunEvent {
  int64_t step = 0;   // steps done when it happened: the new plan runs from step + 1
  std::string kind;   // the line's "event"
  std::string cause;  // the coordinator's words
  std::optional<int64_t> old_workers, new_workers;
  std::string old_plan, new_plan;
  std::optional<double> total_pause_s;
  std::optional<double> detection_s;
  std::optional<double> bytes_moved;
  std::optional<int64_t> steps_lost;
  std::string restored_from;  // "survivors" or a checkpoint
  std::string lost;           // what had no other copy, when something had none

  bool is_failure() const { return kind == "recover"; }
};

struct RunRecords {
  std::string title;           // the page's heading
  std::string metrics_source;  // the files, named in the page
  std::string events_source;   // empty: no events file
  std::vector<StepRecord> steps;
  std::vector<RunEvent> events;
};

// The records of a metrics file's text; `source` names the file in errors. Blank lines are
// skipped. Throws CorruptDataError naming source:line for a line that is not a JSON object or
// lacks a numeric step or loss, and for a text without any record (an empty file).
std::vector<StepRecord> parse_metrics_lines(std::string_view text, const std::string& source);

// The records of an events file's text (may be empty). Throws CorruptDataError naming
// source:line for a line that is not a JSON object or lacks a numeric step.
std::vector<RunEvent> parse_event_lines(std::string_view text, const std::string& source);

// The page. Steps are charted in step order; when several lines hold the same step (steps run
// again after a recovery that lost them, or a resumed run appending), the last one counts.
// Throws InvalidArgumentError when `run.steps` is empty.
std::string render_run_report(const RunRecords& run);

// Text made safe inside HTML and SVG elements and attribute values (& < > " ').
std::string html_escape(std::string_view text);

}  // namespace tessel::cli
