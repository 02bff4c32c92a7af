// `tessel plan`: the automatic layout search (planner/search.h) from the command line.
//
//   tessel plan --model gpt3-175b --cluster dgx-a100 --gpus 1024 --global-batch 1536 --seq 2048
//               [--top 10] [--precision bf16] [--json] [--out plan.json]
//   tessel plan --model gpt2-124m --profile profile.json --global-batch 32 --seq 256
//
// --cluster is a preset (dgx-a100, dgx-h100), a cluster YAML file (planner/cluster.h) or
// this-machine, which needs --profile (a `tessel profile` JSON: measured rates and layer times).
// --gpus sets the device count (default: the cluster's). Prints a ranked table by default and
// JSON with --json: {"plan": <the best plan, layout::to_json>, "predicted": {...},
// "alternatives": [...], ...}. --out writes the best plan (layout::to_json form, what
// layout::plan_from_json reads) to a file. A request nothing fits is a ConfigError saying why and
// what would fit.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `plan` subcommand to `app`; when it is chosen, `action` is set to run it. The
// subcommand's option values live as long as `app`.
void add_plan_command(CLI::App& app, std::function<int()>& action);

}  // namespace tessel::cli
