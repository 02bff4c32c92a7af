#include "tessel/cli/app.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <random>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/cli/cluster_command.h"
#include "tessel/cli/convert_command.h"
#include "tessel/cli/count_flag.h"
#include "tessel/cli/generate_command.h"
#include "tessel/cli/output_guard.h"
#include "tessel/cli/plan_command.h"
#include "tessel/cli/profile_command.h"
#include "tessel/cli/report_command.h"
#include "tessel/cli/simulate_command.h"
#include "tessel/cli/store_command.h"
#include "tessel/config/init_from.h"
#include "tessel/core/error.h"
#include "tessel/core/json_file.h"
#include "tessel/core/log.h"
#include "tessel/core/stop_signal.h"
#include "tessel/data/tokenizer.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/coordinator.h"
#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
#include "tessel/process/launcher.h"
#include "tessel/process/parent_watch.h"
#include "tessel/runtime/parallel_trainer.h"

namespace tessel::cli {

namespace {

// Parsed command-line values; outlives parsing so the chosen action can read them.
struct Args {
  std::string log_level = "info";
  std::string config;
  int64_t steps = 0;
  std::vector<std::string> inputs;
  std::string output;
  bool force = false;     // data prepare --force
  std::string tokenizer;  // data prepare --tokenizer
  int nproc = 1;
  std::string log_dir = "logs";
  double stop_timeout_s = 10;
  double peer_grace_s = 0;
  std::vector<std::string> worker_command;
  std::string train_log_dir;
  std::string job_id;
  std::string cluster;     // train --cluster
  bool eval_only = false;  // tessel eval (and its workers)
  std::string init_from;   // eval --checkpoint
  std::string eval_data;   // eval --data
  int64_t eval_batches = 0;
  std::string token_file;  // train --cluster --token-file
  std::string plan_file;   // train --plan (and its workers)
};

// `tessel eval`: the config's model, data and layout, evaluated once from the weights given
// (--checkpoint, else the config's init_from); nothing read from or written to the run's
// checkpoint.dir and outputs, no timeline.
void apply_eval_flags(config::TrainConfig& cfg, const Args& args) {
  cfg.eval_only = true;
  if (!args.init_from.empty()) {
    const std::string path = std::filesystem::absolute(args.init_from).lexically_normal().string();
    config::check_init_from_model(cfg.model, config::init_from_model(path), path);
    cfg.init_from = path;
  }
  if (!args.eval_data.empty())
    cfg.data.path = std::filesystem::absolute(args.eval_data).lexically_normal().string();
  if (args.eval_batches > 0) cfg.training.eval_batches = args.eval_batches;
  cfg.checkpoint = {};
  cfg.checkpoint.resume = false;
  cfg.metrics_path.clear();
  cfg.events_path.clear();
  cfg.data_order_path.clear();
  cfg.rank_params_dir.clear();
  cfg.timeline.clear();
}

config::TrainConfig load_train_config(const Args& args) {
  auto cfg = config::TrainConfig::load(args.config);
  if (args.steps > 0) cfg.training.steps = args.steps;
  if (args.eval_only) apply_eval_flags(cfg, args);
  if (!args.plan_file.empty()) {
    layout::Plan plan;
    try {
      plan = layout::plan_from_json(read_json_file(args.plan_file));
    } catch (const CorruptDataError& e) {
      TESSEL_THROW(
          ConfigError,
          "--plan {} is not a runtime plan ({}); write one with `tessel plan --model ... "
          "--out FILE` or, when its plan is runnable, `tessel plan --graph ... --out FILE`",
          args.plan_file, e.what());
    }
    cfg.use_plan(plan, args.plan_file);
  }
  return cfg;
}

std::string random_job_id() {
  std::random_device rd;
  return fmt::format("{:08x}{:04x}", rd(), rd() & 0xffff);
}

// What the workers of `tessel train` with the embedded control store get when it dies, instead
// of SIGKILL: they block it once they watch the launcher themselves (process/parent_watch.h);
// until then it ends them, and they hold nothing yet.
constexpr int kLauncherDeathSignal = SIGHUP;

// An inheritable duplicate of this process's standard output (TESSEL_CONSOLE_FD): the workers'
// last lines go there once this process, which read their pipes, is gone. Closed when the launch
// ends (the workers have their own copies).
struct ConsoleForWorkers {
  int fd = -1;
  ConsoleForWorkers() {
    // No close-on-exec, so every worker inherits it; above stdio so nothing is overwritten.
    fd = ::fcntl(STDOUT_FILENO, F_DUPFD, 3);
  }
  ~ConsoleForWorkers() {
    if (fd >= 0) ::close(fd);
  }
  ConsoleForWorkers(const ConsoleForWorkers&) = delete;
  ConsoleForWorkers& operator=(const ConsoleForWorkers&) = delete;
};

// A worker's watch on `tessel train` (env.launcher): the training thread hears of its death
// through env.launcher, and `elastic.stop_grace_s` later the process ends here, at its boundary,
// whatever it is still blocked on (a collective whose peer is gone, a save that cannot finish):
// no worker outlives its launcher by more than the grace.
process::ParentWatchOptions watch_launcher(const runtime::WorkerEnv& env, double grace_s) {
  process::ParentWatchOptions o;
  o.parent = pid_t(env.launcher->pid());
  o.death_signal = kLauncherDeathSignal;
  o.console_fd = env.console_fd;
  o.grace = std::chrono::milliseconds(int64_t(grace_s * 1000));
  o.on_gone = [loss = env.launcher] { loss->notice(); };
  o.on_overdue = [rank = env.rank, pid = env.launcher->pid(), grace_s] {
    spdlog::error(
        "process {}: the coordinator (tessel train, pid {}) is gone, and this process did not "
        "save and leave within elastic.stop_grace_s ({} s): ending it now, without what it had "
        "not saved",
        rank, pid, grace_s);
    spdlog::default_logger()->flush();
    // The documented watchdog: the training thread may be blocked where nothing else reaches it.
    ::_exit(1);
  };
  return o;
}

// Validates the config and plan here, before any worker starts, then runs `nproc` copies of this
// executable as `tessel worker CONFIG` under the launcher.
int launch_training(const Args& args) {
  auto cfg = load_train_config(args);
  cfg.validate_for_workers(args.nproc);
  process::LaunchOptions opt;
  opt.nproc = args.nproc;
  opt.command = {std::filesystem::read_symlink("/proc/self/exe").string(), "--log-level",
                 args.log_level, "worker", args.config};
  if (args.steps > 0) {
    opt.command.push_back("--steps");
    opt.command.push_back(std::to_string(args.steps));
  }
  if (!args.plan_file.empty())
    opt.command.insert(opt.command.end(),
                       {"--plan", std::filesystem::absolute(args.plan_file).string()});
  if (args.eval_only) {
    // The workers read the same config: they are told the same overrides, resolved.
    opt.command.push_back("--eval");
    if (!cfg.init_from.empty())
      opt.command.insert(opt.command.end(), {"--init-from", cfg.init_from});
    opt.command.insert(opt.command.end(), {"--data", cfg.data.path, "--eval-batches",
                                           std::to_string(cfg.training.eval_batches)});
  }
  opt.log_dir = args.train_log_dir;
  opt.stop_timeout = std::chrono::milliseconds(int64_t(args.stop_timeout_s * 1000));
  // After one worker fails, the others get up to the comm timeout (plus a little) to end with
  // their own PeerLostError / TimeoutError, so their logs say what they saw, before SIGTERM.
  opt.peer_grace = std::chrono::milliseconds(int64_t(cfg.comm_timeout_s * 1000) + 2000);
  // The embedded coordinator (elastic/coordinator.h): starts the workers a timeline or a scale
  // request adds, and takes `tessel ctl` commands. Only the first plan's workers start now; a
  // resumed run starts in the plan in force at its checkpoint's step.
  // checkpoint.dir is this job's alone, writable, and free of what interrupted saves left --
  // checked now, not at the first save; the lock lives as long as the job.
  std::unique_ptr<checkpoint::CheckpointDirLock> checkpoint_lock;
  if (!cfg.checkpoint.dir.empty()) {
    checkpoint_lock = checkpoint::lock_checkpoint_dir(cfg.checkpoint.dir);
    checkpoint::remove_interrupted_saves(cfg.checkpoint.dir);
  }
  const auto resume = checkpoint::find_resume_point(cfg);
  // With the embedded store this process is the job's whole control plane. When it dies (the OOM
  // killer, a crash, kill -9), the workers save at their next step boundary and leave within
  // elastic.stop_grace_s instead of dying with it (docs/architecture.md, "Failures"): they are
  // told this process's pid and given its console, and get a signal they can watch for instead
  // of SIGKILL. etcd outlives this process: its workers still die with it.
  std::optional<ConsoleForWorkers> console;
  if (cfg.control_store == "embedded") {
    opt.parent_death_signal = kLauncherDeathSignal;
    opt.extra_env["TESSEL_LAUNCHER_PID"] = std::to_string(::getpid());
    console.emplace();
    if (console->fd >= 0) opt.extra_env["TESSEL_CONSOLE_FD"] = std::to_string(console->fd);
  }
  opt.nproc = cfg.plan_at(resume ? resume->step : 0).world();
  opt.extra_env["TESSEL_RESUME_FROM"] = resume ? resume->path : "";
  opt.world_size = cfg.max_workers();
  opt.job_id = random_job_id();
  opt.extra_env["TESSEL_ELASTIC"] = "1";
  opt.file_store = false;  // every communicator meets through the control store
  auto coordinator =
      std::make_shared<elastic::Coordinator>(cfg, opt.job_id, opt.nproc, resume ? resume->step : 0);
  opt.extra_env["TESSEL_CONTROL_STORE"] = coordinator->endpoint();
  // The coordinator acts when something happens (wake_fds); the tick bounds only its deadlines
  // (a recovery whose reports do not come).
  opt.wake_fds = coordinator->wake_fds();
  opt.tick = std::chrono::milliseconds(1000);
  opt.on_tick = [coordinator](const process::LaunchOptions::Workers& workers,
                              const process::LaunchResult&) { coordinator->tick(workers); };
  // SIGTERM (a preemption notice) or SIGINT: the workers save at their next step boundary and
  // exit, within elastic.stop_grace_s; a second signal stops them at once.
  opt.on_interrupt = [coordinator](int signal) {
    coordinator->stop(fmt::format("`tessel train` received {}", process::signal_name(signal)));
  };
  opt.interrupt_grace = std::chrono::milliseconds(int64_t(cfg.stop_grace_s * 1000));
  // A worker killed by a signal is recovered from; the others keep running.
  opt.on_exit = [coordinator](const process::WorkerExit& e) { return coordinator->on_exit(e); };
  spdlog::info("job {}: `tessel ctl scale N` changes the number of workers", opt.job_id);
  std::fflush(stdout);  // the launcher writes workers' lines straight to fd 1
  auto result = process::launch(opt);
  if (!result.console_error.empty()) {
    // The training may have gone well, but what it printed did not all arrive.
    fmt::print(
        stderr, "tessel: the console output is incomplete: {}{}\n", result.console_error,
        args.train_log_dir.empty()
            ? ""
            : fmt::format(" (every worker's lines are in {}/rank*.log)", args.train_log_dir));
    if (result.exit_code == 0) return 1;
  }
  const std::string stopped = coordinator->stop_reason();
  if (!stopped.empty() && (result.exit_code == 0 || result.exit_code == 128 + SIGTERM ||
                           result.exit_code == 128 + SIGINT)) {
    // Stopped before its last step, on purpose: not a success (a scheduler retries it), not a
    // failure either.
    fmt::print(stderr, "tessel: training stopped ({}); run the same command to resume{}\n", stopped,
               cfg.checkpoint.dir.empty() ? " -- without checkpoint.dir nothing was saved" : "");
    return result.exit_code != 0 ? result.exit_code : 128 + SIGTERM;
  }
  if (result.exit_code != 0) fmt::print(stderr, "tessel: training failed: {}\n", result.failure);
  return result.exit_code;
}

void add_train(CLI::App& app, Args& args, std::function<int()>& action) {
  auto* cmd = app.add_subcommand("train", "train a model from a YAML config");
  cmd->add_option("config", args.config, "YAML config file")->required();
  // Counts are checked where they are read: a value out of range is an error, not ignored.
  cmd->add_option("--steps", args.steps, "override training.steps")->check(kCount);
  auto* nproc = cmd->add_option("--nproc", args.nproc,
                                "local worker processes (default: as many as the config's plans "
                                "need); must equal dp * tp * "
                                "pp of the parallel section, or the largest plan of the timeline")
                    ->check(kCount);
  cmd->add_option("--plan", args.plan_file,
                  "train with this plan (`tessel plan ... --out FILE`) instead of the config's "
                  "parallel section");
  cmd->add_option("--log-dir", args.train_log_dir,
                  "directory for one log file per worker (--nproc > 1)");
  cmd->add_option("--cluster", args.cluster,
                  "run on a cluster of `tessel agent`s instead of this host: etcd's URL, "
                  "http://host:port[/cluster]")
      ->excludes(nproc);
  cmd->add_option("--token-file", args.token_file,
                  "with --cluster: the cluster's token file, the secret its agents hold")
      ->envname(elastic::kClusterTokenEnv);
  cmd->callback([&, nproc] {
    action = [&, nproc] {
      if (!args.cluster.empty())
        return train_on_cluster(args.config, args.steps, args.cluster, args.token_file);
      auto cfg = load_train_config(args);
      if (nproc->count() == 0) args.nproc = cfg.max_workers();
      // One worker too: a world of one, run by the same loop as every layout (and scalable
      // with `tessel ctl scale N`).
      return launch_training(args);
    };
  });
  // One rank of `tessel train --nproc N`; started by it, not meant to be run by hand.
  auto* worker = app.add_subcommand("worker", "");
  worker->group("");  // hidden
  // Without a config: the job its cluster runs (TESSEL_CLUSTER, started by `tessel agent`).
  worker->add_option("config", args.config, "YAML config file");
  worker->add_option("--steps", args.steps, "override training.steps")->check(kCount);
  worker->add_flag("--eval", args.eval_only);
  worker->add_option("--plan", args.plan_file);
  worker->add_option("--init-from", args.init_from);
  worker->add_option("--data", args.eval_data);
  worker->add_option("--eval-batches", args.eval_batches)->check(kCount);
  worker->callback([&] {
    action = [&] {
      const auto env = runtime::WorkerEnv::from_environment();
      auto cfg = args.config.empty() ? env.cluster_config() : load_train_config(args);
      // Started by `tessel train` serving the job's control store: watch it. First, before any
      // thread starts -- the watch blocks the launcher's death signal for every later thread.
      std::optional<process::ParentWatch> watch;
      if (env.launcher) watch.emplace(watch_launcher(env, cfg.stop_grace_s));
      // SIGTERM or SIGINT to a worker: it finishes its step and leaves (runtime/parallel_trainer.h)
      // instead of dying with the steps since the last checkpoint.
      StopSignals stop_signals;
      int rc = 0;
      try {
        runtime::ParallelTrainer trainer(cfg, env);
        trainer.run();
      } catch (const runtime::CoordinatorLostError& e) {
        // The process's last line, on the launcher's console: what it did not save, and why.
        spdlog::warn("{}", e.what());
        rc = 1;
      } catch (const Error& e) {
        if (!env.launcher || !env.launcher->noticed()) throw;
        // E.g. a rendezvous through the store that died with the launcher.
        spdlog::warn(
            "process {}: the coordinator (tessel train, pid {}) is gone and {}: {}; "
            "leaving without saving",
            env.rank, env.launcher->pid(), e.kind(), e.what());
        rc = 1;
      }
      // Lines written between the launcher's death and the watch pointing the output at its
      // console failed (nobody read the pipe any more): expected, not this process's failure.
      if (env.launcher && env.launcher->noticed()) std::clearerr(stdout);
      return rc;
    };
  });
}

// `tessel eval CONFIG --checkpoint PATH`: the loss of a checkpoint (or Hugging Face model) on the
// held-out samples of the config's data (or --data), under the config's layout.
void add_eval(CLI::App& app, Args& args, std::function<int()>& action) {
  auto* cmd = app.add_subcommand(
      "eval",
      "compute the loss of a checkpoint or Hugging Face model on a dataset, under the "
      "config's layout");
  cmd->add_option("config", args.config, "YAML config file (model, data, parallel)")->required();
  cmd->add_option("--checkpoint", args.init_from,
                  "weights to evaluate: a tessel checkpoint, a run's checkpoint.dir or a Hugging "
                  "Face directory (default: the config's init_from)");
  cmd->add_option("--data", args.eval_data,
                  "token file to evaluate on (default: data.path); its held-out share "
                  "(data.eval_fraction) is read");
  cmd->add_option("--batches", args.eval_batches,
                  "micro-batches to evaluate (default: training.eval_batches)")
      ->check(kCount);
  auto* nproc = cmd->add_option("--nproc", args.nproc,
                                "local worker processes (default: as many as the config's "
                                "parallel section needs)")
                    ->check(kCount);
  cmd->callback([&, nproc] {
    action = [&, nproc] {
      args.eval_only = true;
      auto cfg = load_train_config(args);
      if (nproc->count() == 0) args.nproc = cfg.max_workers();
      return launch_training(args);
    };
  });
}

void add_data(CLI::App& app, Args& args, std::function<int()>& action) {
  auto* data = app.add_subcommand("data", "prepare training data");
  data->require_subcommand(1);
  auto* prepare = data->add_subcommand(
      "prepare", "tokenize text files into a token file (bytes, or the --tokenizer)");
  prepare->add_option("--input", args.inputs, "text files, one document each")->required();
  prepare->add_option("--output", args.output, "token file to write")->required();
  prepare->add_option("--tokenizer", args.tokenizer,
                      "a Hugging Face tokenizer.json (byte-level BPE: GPT-2, LLaMA-3), a "
                      "SentencePiece .model, or a model directory holding either; default: "
                      "bytes (vocab 257)");
  prepare->add_flag("--force", args.force, "replace the --output file if it exists");
  prepare->callback([&] {
    action = [&] {
      // The tokenizer is read too: --output must not be it (nor, for a directory, its files).
      auto read = args.inputs;
      if (!args.tokenizer.empty()) {
        read.push_back(args.tokenizer);
        for (const char* name : {"tokenizer.json", "tokenizer.model"})
          read.push_back((std::filesystem::path(args.tokenizer) / name).string());
      }
      check_output_file(args.output, read, args.force, "--output");
      const auto tokenizer = data::load_tokenizer(args.tokenizer);
      auto stats = data::prepare_dataset(args.inputs, args.output, *tokenizer);
      fmt::print("wrote {}: {} documents, {} bytes, {} tokens (vocab {}, uint{})\n", args.output,
                 stats.documents, stats.bytes, stats.tokens, stats.vocab_size,
                 8 * stats.token_width);
      fmt::print("tokenizer: {}\n", tokenizer->describe());
      if (!tokenizer->eot())
        fmt::print(
            "the tokenizer has no end-of-text token: documents follow each other without "
            "a separator\n");
      fmt::print("unigram entropy of the {}: {:.3f} bits = {:.3f} nats per token\n",
                 args.tokenizer.empty() ? "bytes" : "tokens", stats.entropy_bits,
                 stats.entropy_nats);
      return 0;
    };
  });
}

void add_launch(CLI::App& app, Args& args, std::function<int()>& action) {
  auto* cmd = app.add_subcommand(
      "launch",
      "run N local copies of a worker command, torchrun style (rank and world in the environment)");
  cmd->add_option("-n,--nproc", args.nproc, "number of workers")->required()->check(kCount);
  cmd->add_option("--log-dir", args.log_dir, "directory for one log file per rank");
  cmd->add_option("--stop-timeout", args.stop_timeout_s,
                  "seconds the other workers get to stop after one fails, before SIGKILL")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--peer-grace", args.peer_grace_s,
                  "seconds the other workers get to end by themselves after one fails (e.g. "
                  "with a peer-lost error in their logs) before they are stopped")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("command", args.worker_command, "worker command (after --)")->required();
  cmd->callback([&] {
    action = [&] {
      process::LaunchOptions opt;
      opt.peer_grace = std::chrono::milliseconds(int64_t(args.peer_grace_s * 1000));
      opt.nproc = args.nproc;
      opt.command = args.worker_command;
      opt.log_dir = args.log_dir;
      opt.stop_timeout = std::chrono::milliseconds(int64_t(args.stop_timeout_s * 1000));
      std::fflush(stdout);  // the launcher writes workers' lines straight to fd 1
      auto result = process::launch(opt);
      if (result.exit_code != 0) fmt::print(stderr, "tessel: launch failed: {}\n", result.failure);
      return result.exit_code;
    };
  });
}

// `tessel ctl scale N | status | stop [--job ID]`: talks to a running job's coordinator.
void add_ctl(CLI::App& app, Args& args, std::function<int()>& action) {
  auto* cmd = app.add_subcommand("ctl", "control a running training job (scale N, status, stop)");
  cmd->add_option("--job", args.job_id, "job id (default: the only running job)");
  cmd->add_option("command", args.worker_command, "scale N | status | stop")->required();
  cmd->callback([&] {
    action = [&] {
      std::string line;
      for (const auto& w : args.worker_command) line += (line.empty() ? "" : " ") + w;
      const std::string reply = elastic::send_control_command(args.job_id, line);
      std::printf("%s\n", reply.c_str());
      return reply.rfind("ok:", 0) == 0 ? 0 : 1;
    };
  });
}

void add_presets(CLI::App& app, std::function<int()>& action) {
  auto* cmd = app.add_subcommand("presets", "list the named model presets");
  cmd->callback([&action] {
    action = [] {
      for (const auto& name : model::ModelConfig::preset_names()) {
        auto c = model::ModelConfig::preset(name);
        fmt::print(
            "{:<12} {:<6} layers {:>3}  hidden {:>6}  heads {:>3}/{:<3}  vocab {:>6}  params "
            "{:.3g}\n",
            name, model::family_name(c.family), c.n_layer, c.n_embd, c.n_head, c.n_kv_head,
            c.vocab_size, double(c.num_params()));
      }
      return 0;
    };
  });
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"tessel: elastic 3D-parallel transformer training"};
  app.require_subcommand(1);
  Args args;
  app.add_option("--log-level", args.log_level, "trace, debug, info, warn, error or off");
  std::function<int()> action;
  add_train(app, args, action);
  add_eval(app, args, action);
  add_data(app, args, action);
  add_launch(app, args, action);
  add_agent_command(app, args.log_level, action);
  add_presets(app, action);
  add_ctl(app, args, action);
  add_plan_command(app, action);
  add_store_command(app, action);
  add_convert_command(app, action);
  add_init_command(app, action);
  add_generate_command(app, action);
  add_profile_command(app, action);
  add_simulate_command(app, action);
  add_report_command(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Every expected failure is a tessel::Error: report it as one line and exit non-zero.
  // Config mistakes exit 2 (like a usage error), everything else 1.
  try {
    set_log_level(args.log_level);
    const int rc = action ? action() : 0;
    // What a command printed must have arrived: `tessel plan ... > /dev/full` is a failure, as
    // for any Unix tool.
    const bool flushed = std::fflush(stdout) == 0;
    if (!flushed || std::ferror(stdout)) {
      fmt::print(stderr, "tessel: cannot write the standard output: {}\n",
                 flushed ? "an earlier write failed" : std::strerror(errno));
      return rc != 0 ? rc : 1;
    }
    return rc;
  } catch (const ConfigError& e) {
    std::fflush(stdout);
    fmt::print(stderr, "tessel: {}: {}\n", e.kind(), e.what());
    return 2;
  } catch (const Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "tessel: {}: {}\n", e.kind(), e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "tessel: out of memory: use a smaller model or micro-batch\n");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "tessel: internal error: {}\n", e.what());
    return 1;
  }
}

}  // namespace tessel::cli
