// `tessel profile`: measures this machine for the planner (planner/profiler.h) and writes the
// profile JSON that `tessel plan --profile` and `tessel simulate --profile` read.
//
//   tessel profile --model gpt2-124m [--seq 256] [--workers 2] [--max-micro-batch 8]
//                  [--out profile.json]
//   tessel profile --config train.yaml [--workers 4] ...   (model and seq from a train config;
//                                                           workers default to its plan's world)
//
// --workers is the number of worker processes a run here will have: the compute is measured in
// that many processes at once with --threads OpenMP threads each (default max(1, cores /
// workers), what `tessel train --nproc` gives them), and the profile describes a one-host cluster
// of that many devices. Prints a summary; the JSON goes to --out (atomically), or to stdout
// without --out.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `profile` subcommand to `app`; when it is chosen, `action` is set to run it. The
// subcommand's option values live as long as `app`.
void add_profile_command(CLI::App& app, std::function<int()>& action);

}  // namespace tessel::cli
