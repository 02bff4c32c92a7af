// `tessel simulate`: one training step of a plan, run through the planner's discrete-event
// simulator (planner/simulator.h) on the cost model's per-stage times, as tessel's runtime
// executes it.
//
//   tessel simulate --plan plan.json --model gpt2-124m --cluster dgx-a100 [--seq 1024]
//   tessel simulate --config train.yaml --profile profile.json [--trace step.json]
//   options: [--schedule gpipe|1f1b|interleaved-1f1b|zb-h1|greedy] [--memory-cap N]
//            [--jitter 0.1] [--seed S] [--slow-stage 1:1.5 ...] [--dp-overlap x]
//            [--bucket-mb MB] [--json]
//
// --plan takes a plan JSON (layout::to_json, what `tessel plan --out` writes) or the whole
// `tessel plan --json` document; --config takes a train config (model, seq_len, global batch and
// its parallel: plan, with the same default stage split the runtime uses). --cluster is a preset
// or a cluster YAML; --profile a `tessel profile` JSON (this machine: measured rates and layer
// times). The cluster is resized to the plan's world. --schedule overrides the plan's schedule:
// zb-h1 splits every backward into input and weight gradients (simulation only: the runtime does
// not run it yet), greedy is the dispatcher of simulate_greedy with per-stage activation caps
// p - s (1F1B's budget; interleaved 1F1B's with virtual stages) or --memory-cap. Prints the
// per-stage table, the makespan, the bubble beside the analytic one, the peak activation memory per
// stage and the predicted step time;
// --json prints a JSON document instead; --trace writes the simulated pipeline as Chrome-trace
// JSON (Perfetto).
//
// The step itself (what the pipeline, CPU sharing, dp sync and collectives cost) is
// planner::simulate_step (planner/step_simulation.h); this file parses the arguments into its
// request and prints its result.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `simulate` subcommand to `app`; when it is chosen, `action` is set to run it. The
// subcommand's option values live as long as `app`.
void add_simulate_command(CLI::App& app, std::function<int()>& action);

}  // namespace tessel::cli
