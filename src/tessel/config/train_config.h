// The training job configuration, read from a YAML file.
//
//   model:      {preset: gpt2-tiny, n_layer: 4, ...}   a preset, optionally with fields overridden
//   init_from:  hf-model-dir | tessel checkpoint   weights to start from (fine-tuning); the model
//               section may then be left out
//   data:       {path: train.tok, seq_len: 64, eval_fraction: 0.05, seed: 1}
//   training:   {steps, global_batch, micro_batch, seed, grad_clip, eval_every, eval_batches,
//                log_every, backend, gemm, huge_pages, threads, stop_at}
//   optimizer:  {lr, min_lr, warmup_steps, beta1, beta2, eps, weight_decay}
//   checkpoint: {dir, every, resume, keep, copies, async, on_error}
//   output:     {metrics, events, data_order, rank_params, trace, trace_steps}
//   parallel:   {dp, tp, pp, virtual_stages, micro_batch, schedule, zero_stage, layers_per_stage,
//                rank_order, recompute: none|selective|full, timeout_s, bucket_mb}
//               (optional; default: one worker)
//               or {plan_file: plan.json, timeout_s, bucket_mb}: the layout from `tessel plan
//               --out`
//   timeline:   [{at_step: S, parallel: {dp, tp, pp, ...}} or {at_step: S, workers: N}, ...]
//   elastic:    {hosts_file, replace_failed, prepare_steps, reshard_transport, transfer_streams,
//                control_store, heartbeat_timeout_s, stop_grace_s, grow_to_slots}
//               (see TrainConfig::hosts_file, ...)
//
// parallel.micro_batch is the samples per forward/backward on ONE data-parallel replica; when it
// is not given it is training.micro_batch with dp 1, and otherwise the largest divisor of the
// per-replica batch (global_batch / dp) that does not exceed training.micro_batch. micro_batches
// per step follow as global_batch / (dp * micro_batch), and training.micro_batch is set to the
// plan's micro_batch.
//
// timeline: live re-partitioning at step boundaries. Before step S (0-based: after S steps) the
// running workers switch to the entry's plan (its `parallel` keys as above, minus the job-wide
// timeout_s and bucket_mb), moving the whole training state directly between them
// (reshard/transfer_plan.h), and continue; `workers: N` lets the planner choose the plan for N
// workers (planner/local_plan.h). Entries are in increasing step order within
// (0, training.steps). `tessel train --nproc N` needs N = the largest world over all plans.
//
// Every key is checked (unknown keys are errors) and the whole config is validated before any
// work starts, so mistakes surface as one ConfigError naming the field and the fix.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "tessel/kernels/optimizer.h"
#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"

namespace tessel::config {

struct DataConfig {
  std::string path;  // token file (tessel .tok) or Megatron prefix (.bin/.idx)
  int seq_len = 64;
  double eval_fraction = 0.05;  // share of samples held out for evaluation
  uint64_t seed = 1;            // sample order
};

struct TrainingConfig {
  int64_t steps = 100;
  int64_t global_batch = 8;  // samples per optimizer step
  int64_t micro_batch = 8;   // samples per forward/backward
  uint64_t seed = 1234;      // parameter init
  double grad_clip = 1.0;    // max global grad norm; <= 0 disables
  int64_t eval_every = 0;    // steps; 0 = never
  int64_t eval_batches = 4;  // micro-batches per evaluation
  // Samples per eval batch: training.micro_batch as written (a plan sets training.micro_batch to
  // its own), so every layout evaluates the same held-out samples; 0: micro_batch.
  int64_t eval_micro_batch = 0;
  int64_t eval_batch_size() const { return eval_micro_batch > 0 ? eval_micro_batch : micro_batch; }
  int64_t log_every = 10;  // steps between log lines when not on a terminal
  std::string backend = "cpu";
  // training.gemm: the CPU backend's GEMM provider, "onednn" or "openblas" (kernels/gemm.h);
  // "auto": $TESSEL_GEMM if set (the test matrix runs the suite under each), else onednn.
  std::string gemm = "auto";
  // training.precision: "fp32", or "bf16" -- the linear layers multiply bf16 operands with float
  // accumulation, as torch.autocast does (model/transformer.h, set_bf16_matmuls); the training
  // state (parameters, gradients, Adam moments) and every other op stay fp32, so checkpoints and
  // re-partitions are the fp32 model's and a run may resume under either precision.
  std::string precision = "fp32";
  bool bf16() const { return precision == "bf16"; }
  // training.huge_pages: back buffers of 2 MiB and more with transparent huge pages
  // (tensor/allocator.h): fewer TLB misses, but a slow first touch on VMs whose host backs
  // memory lazily (bench/README.md, elastic).
  bool huge_pages = true;
  int threads = 0;  // OpenMP threads; 0 = all cores
  // Ends this run after this many steps (0: at `steps`), with a checkpoint, without changing the
  // learning-rate schedule, which always spans `steps`: for jobs that run in slices.
  int64_t stop_at = 0;
  int64_t end_step() const { return stop_at > 0 ? std::min(stop_at, steps) : steps; }
};

struct OptimizerConfig {
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 10;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;

  // The AdamW settings for one optimizer step (0-based `step`, at learning rate `lr`): gradients
  // are scaled by the clip factor and zeroed as they are read. weight_decay is set per parameter.
  kernels::AdamWConfig adamw_step(double lr, int64_t step, float clip_factor) const;
};

struct CheckpointConfig {
  std::string dir;     // empty = no checkpoints
  int64_t every = 0;   // steps; 0 = only at the end
  bool resume = true;  // continue from the latest checkpoint in dir when there is one
  int keep = 2;        // newest checkpoints kept
  // A cluster job (elastic/cluster_checkpoints.h): each host keeps its ranks' files on its own
  // disk, and with 2 a second copy of each on another host, so losing one host loses nothing.
  int copies = 2;
  // Multi-worker runs: snapshot the state into host memory at the step boundary and write it in
  // a background thread while training continues (rank 0 publishes the checkpoint once every
  // rank's file is in place). The run's end waits for the last one.
  bool async = false;
  // A save that fails (a full disk, an I/O error): "continue" (default) logs it, removes what it
  // wrote, keeps the previous checkpoint and tries again at the next interval -- a run whose last
  // save failed still ends with an error; "stop" ends the job with the error.
  std::string on_error = "continue";
};

// One entry of the timeline: from step at_step on, train under `plan`.
struct PlanSwitch {
  int64_t at_step = 0;
  layout::Plan plan;  // with layers_per_stage filled in
  int workers = 0;    // > 0: `plan` is the planner's choice for this many workers
};

struct TrainConfig {
  std::string source;  // file it was read from, for messages
  model::ModelConfig model;
  // init_from: the weights the run starts from (config/init_from.h), absolute; empty = the
  // deterministic initialisation from training.seed. A resume from checkpoint.dir takes
  // precedence: init_from only decides how step 0 starts.
  std::string init_from;
  // `tessel eval`: the workers evaluate the weights once (init_from's, else the seed's) on the
  // held-out samples under the plan, print the loss and leave; nothing is trained or saved.
  bool eval_only = false;
  DataConfig data;
  TrainingConfig training;
  OptimizerConfig optimizer;
  CheckpointConfig checkpoint;
  std::string metrics_path;  // JSON lines; empty = none
  std::string events_path;   // JSON lines, one per reconfiguration; empty = none
  // output.data_order: JSON lines, one per step attempt and data-parallel replica, written when
  // the replica loads its samples: which positions of the global sample order it trains on
  // ({"step", "generation", "process", "dp_rank", "first", "count"}). For each step, the lines of
  // the last generation that ran it are the samples the final state learned from; they prove
  // that reconfigurations and failures repeat or skip no sample.
  std::string data_order_path;
  // output.rank_params: a directory where, at the end of the run, every rank writes its local
  // parameter shards (runtime/stage.h: Stage::dump_params), for debugging and the tests. Empty:
  // none.
  std::string rank_params_dir;
  // output.trace: a Chrome trace-event file (Perfetto) of output.trace_steps steps of every rank
  // (runtime/step_trace.h), written by rank 0 when they are done; a later generation of an
  // elastic job writes its own beside it (`.g<N>` before the extension). Empty: none.
  std::string trace_path;
  int trace_steps = 3;
  layout::Plan plan;  // with layers_per_stage filled in (Plan::with_defaults)
  // parallel.timeout_s: bound in seconds on every rendezvous and collective of a multi-worker
  // run; a peer that stops answering surfaces as PeerLostError / TimeoutError after at most this.
  double comm_timeout_s = 60;
  // parallel.bucket_mb: size of the buckets in which data-parallel gradients are all-reduced
  // while backward still runs (ZeRO stage 0).
  double bucket_mb = 25;
  std::vector<PlanSwitch> timeline;  // in increasing at_step order
  // elastic.hosts_file: a worker list the coordinator watches (like Varuna's machine list): one
  // line per worker slot (blank lines and '#' comments ignored); when its count changes, the job
  // scales to it as with `tessel ctl scale N`. Empty: none.
  std::string hosts_file;
  // elastic.replace_failed: when a worker dies, start a new process in its place (it receives
  // its share of the state in the recovery) instead of going on with the survivors only.
  bool replace_failed = false;
  // elastic.prepare_steps: a timeline switch is prepared this many steps ahead while training
  // goes on: the processes it adds are started and build their buffers, and every survivor
  // builds the buffers of the chunks it will hold and does not hold now. The pause then holds
  // only the transfer. Costs the successor's memory beside the current one's during those steps;
  // 0: build everything during the pause.
  int prepare_steps = 2;
  // elastic.reshard_transport: how a re-partition moves state between processes of one host:
  // "direct" (the receiver reads the sender's memory, one copy; the network where the system
  // does not allow it) or "network" (always through the transition world's connections).
  std::string reshard_transport = "direct";
  // elastic.transfer_streams: TCP streams per pair of processes for what a re-partition moves
  // over the network (between hosts, or within one with reshard_transport: network). One stream
  // is bound by one core (2.1 GiB/s between network namespaces of a 2-core VM, 4.7 on two);
  // hosts with many cores and fast NICs may want more. 1..16.
  int transfer_streams = 2;
  // elastic.control_store: where the coordinator and the workers keep the job's decisions,
  // reports and rendezvous (elastic/reconfiguration.h). "embedded" (the default): `tessel train`
  // serves them itself, nothing to start. Else an etcd v3 endpoint, "http://host:port".
  std::string control_store = "embedded";
  // elastic.heartbeat_timeout_s: a worker renews a heartbeat in the control store (a lease) a few
  // times within this bound; one that stops renewing (SIGSTOP, a frozen VM) is fenced -- killed --
  // and the job recovers without it, as from a death.
  double heartbeat_timeout_s = 10;
  // elastic.stop_grace_s: after SIGTERM or SIGINT (a preemption notice) to `tessel train`, the
  // workers finish their step, save a checkpoint and exit within this many seconds; then they are
  // stopped.
  double stop_grace_s = 30;
  // elastic.grow_to_slots: on a cluster of `tessel agent`s, a host that joins makes the job grow,
  // at a step boundary, to the largest worker count the hosts' slots hold that the planner lays
  // out. false: the job keeps its worker count (hosts that join only take replacements).
  bool grow_to_slots = true;

  // The config's plans, numbered 0 for `plan` and i for timeline[i - 1], and the one in force
  // during step `step` (0-based). (The running job's generation counter differs: it also counts
  // switches made by scale requests.)
  const layout::Plan& plan_at(int64_t step) const;
  int generation_at(int64_t step) const;
  const layout::Plan& plan_of_generation(int generation) const;
  int generations() const { return int(timeline.size()) + 1; }
  // The most workers any plan of the run needs.
  int max_workers() const;
  // The planner's plan for this run's model and batch on `workers` local worker processes
  // (planner/local_plan.h); throws ConfigError with the planner's reason when none fits.
  // `prefer_micro_batch`: planner::LocalPlanRequest::prefer_micro_batch.
  layout::Plan plan_for_workers(int workers, int prefer_micro_batch = 0) const;

  // `tessel train --plan FILE`: a runtime plan (`tessel plan ... --out FILE`, layout::to_json)
  // in place of the parallel section. Throws ConfigError naming the file when the config has a
  // timeline, the plan's global batch is not training.global_batch, or it does not fit the model.
  void use_plan(const layout::Plan& plan, const std::string& path);

  // Reads and validates; relative paths are resolved against the config file's directory.
  static TrainConfig load(const std::string& path);
  // The same for YAML text read from `path` already (messages name it, relative paths resolve
  // against its directory; the file itself is not read).
  static TrainConfig parse(const std::string& text, const std::string& path);
  // Throws ConfigError naming the first inconsistent field.
  // Checks the plan against the model and batch but not against a worker count.
  void validate() const;
  // validate() plus the plan against `workers` started processes (Plan::validate), and the
  // features a multi-worker run does not support yet (ZeRO stages above 1). Throws
  // ConfigError naming the field and the fix.
  void validate_for_workers(int workers) const;
  // Whether the run needs the multi-worker path (more than one worker, or a timeline).
  bool is_parallel() const { return plan.world() > 1 || !timeline.empty(); }
  // Plan::validate against `workers`, its message prefixed with the config file.
  void validate_plan(int workers) const;
  int64_t micro_steps() const { return training.global_batch / training.micro_batch; }
};

}  // namespace tessel::config
