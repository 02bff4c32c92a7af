// `tessel report`: a training run's metrics and events as one self-contained HTML page
// (cli/run_report.h renders it).
//
//   tessel report RUN_DIR [--out FILE] [--title TEXT]
//                          reads RUN_DIR/metrics.jsonl and, when it exists, RUN_DIR/events.jsonl;
//                          writes RUN_DIR/report.html (replaced each time) or FILE
//   tessel report --metrics FILE [--events FILE] [--out FILE]
//                          the files named (a config's output.metrics / output.events); the page
//                          goes beside the metrics unless --out says where
//
// The page is written atomically (core/atomic_file.h) once everything is read and rendered, so a
// bad input leaves nothing behind. A missing directory or file is a ConfigError naming it; an
// empty metrics file, or a line that is not a JSON record, a CorruptDataError naming the file
// and line. An --out file that exists is replaced only with --force (the default report.html
// always is: it is this command's own output).
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `report` subcommand to `app`; when it is chosen, `action` is set to run it. The
// subcommand's option values live as long as `app`.
void add_report_command(CLI::App& app, std::function<int()>& action);

}  // namespace tessel::cli
