// Checks a training run one step at a time against the single-process ReferenceTrainer.
//
// A run under another layout (data, tensor, pipeline parallelism, ZeRO-1, switches between them,
// recoveries) sums the same terms in other orders, so it differs from one process by rounding --
// which AdamW amplifies where a gradient is tiny, and which the next gradients then carry further
// (testing/rounding.h, AdamDivergence): whole trajectories have no bound that follows from the
// arithmetic. One step from a shared state has an exact one. So for every step t of the run, the
// state it saved after step t-1 (the seed's initial state for t = 1) is loaded into a
// single-process ReferenceTrainer, which takes step t, and
//   * the run's logged loss of step t equals the ReferenceTrainer's within the forward pass'
//   rounding
//     (model::test_util::step_tolerance, forward only), and
//   * the run's saved state after step t (parameters, Adam moments, step, cursor) equals the
//     ReferenceTrainer's within AdamDivergence's bound for one step whose gradients differ by the
//     rounding of a forward and backward pass (step_tolerance), the clipping factor by what that
//     does to the gradient norm.
// By induction the whole run is a chain of single-process steps, each exact to rounding.
// The run must checkpoint every step: checkpoint: {dir: .., every: 1, keep: <at least steps>}.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/train_config.h"
#include "tessel/model/rounding_test_util.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/testing/adam_divergence.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::runtime::testing {

// `tessel train CONFIG --nproc N` with one OpenMP thread per worker and `env` (VAR=value ...)
// before it; returns the exit code, the output in *out.
inline int run_train(const std::string& config, int nproc, std::string* out,
                     const std::string& env = "") {
  return tessel::testing::run_command(
      fmt::format("OMP_NUM_THREADS=1 {} {} train {} --nproc {}", env,
                  tessel::testing::tessel_binary().string(), config, nproc),
      out);
}

// The checkpoint lines a config needs for expect_steps_match_one_process over `steps` steps.
inline std::string every_step_checkpoints(int64_t steps, const std::string& dir = "steps") {
  return fmt::format("checkpoint: {{dir: {}, every: 1, keep: {}}}\n", dir, steps + 1);
}

// Per step, the value of `key` a metrics file (output.metrics) logged; a step logged twice (redone
// after a failure) keeps its last record. A record without the key fails the test when `every`
// record must have it, else is skipped.
inline std::map<int64_t, double> read_logged(const std::filesystem::path& metrics,
                                             const std::string& key, bool every) {
  std::ifstream in(metrics);
  EXPECT_TRUE(in) << metrics << " was not written";
  std::map<int64_t, double> values;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto record = nlohmann::json::parse(line);
    if (!every && !record.contains(key)) continue;
    values[record.at("step").get<int64_t>()] = record.at(key).get<double>();
  }
  return values;
}

// The loss logged for each step.
inline std::map<int64_t, double> read_step_losses(const std::filesystem::path& metrics) {
  return read_logged(metrics, "loss", true);
}

// Two runs' latest checkpoints under `a` and `b` (checkpoint dirs) hold the same tensors, byte for
// byte (parameters and Adam moments alike); returns the second's meta for further checks.
inline nlohmann::json expect_same_latest_checkpoint(const std::filesystem::path& a,
                                                    const std::filesystem::path& b) {
  store::CheckpointReader x(*checkpoint::latest_sharded_checkpoint(a.string()));
  store::CheckpointReader y(*checkpoint::latest_sharded_checkpoint(b.string()));
  EXPECT_EQ(x.tensors().size(), y.tensors().size());
  for (const auto& t : x.tensors()) {
    const Tensor u = x.read(t.name), v = y.read(t.name);
    EXPECT_EQ(u.numel(), v.numel()) << t.name;
    if (u.numel() != v.numel()) continue;
    EXPECT_EQ(std::memcmp(u.raw(), v.raw(), size_t(u.numel()) * dtype_size(u.dtype())), 0)
        << t.name;
  }
  return y.meta();
}

// The eval loss logged for each step that evaluated (training.eval_every).
inline std::map<int64_t, double> read_eval_losses(const std::filesystem::path& metrics) {
  return read_logged(metrics, "eval_loss", false);
}

// What a check covered. (TESSEL_REPORT_MARGINS=1 prints how close each comparison came to its
// bound, testing::within_bounds.)
struct StepCheck {
  int64_t steps = 0;      // steps checked
  int64_t unlogged = 0;   // of them, without a logged loss (only their state was checked)
  int64_t evaluated = 0;  // eval losses checked
};

// `single_config`: the single-process run's config (same model, data, batch and optimizer as the
// run). `checkpoints`: the run's checkpoint folder. `losses`: the run's logged loss per step.
// Checks steps first..last: each must have its checkpoint saved (and the one before `first` too
// unless first == 1); a step without a logged loss (a worker died while it was being reduced) has
// only its state checked, and is counted in `unlogged`. `eval_losses` (read_eval_losses): the
// run's eval loss after step t must equal the single-process evaluation of its saved state at t
// within the forward pass' rounding over the eval tokens.
inline StepCheck expect_steps_match_one_process(const std::string& single_config,
                                                const std::filesystem::path& checkpoints,
                                                const std::map<int64_t, double>& losses,
                                                int64_t first, int64_t last,
                                                const std::map<int64_t, double>& eval_losses = {}) {
  const auto start = std::chrono::steady_clock::now();
  StepCheck checked;
  config::TrainConfig cfg = config::TrainConfig::load(single_config);
  cfg.checkpoint = {};
  cfg.checkpoint.resume = false;
  cfg.metrics_path.clear();
  cfg.events_path.clear();
  cfg.data_order_path.clear();
  const int64_t tokens = cfg.training.global_batch * cfg.data.seq_len;
  const double grad_tol = model::test_util::step_tolerance(cfg.model, tokens, cfg.data.seq_len);
  const double loss_tol =
      model::test_util::step_tolerance(cfg.model, tokens, cfg.data.seq_len, /*backward=*/false);
  const int64_t eval_tokens =
      cfg.training.eval_batches * cfg.training.micro_batch * cfg.data.seq_len;
  const double eval_tol = model::test_util::step_tolerance(cfg.model, eval_tokens, cfg.data.seq_len,
                                                           /*backward=*/false);
  auto saved = [&](int64_t step) {
    return (checkpoints / checkpoint::checkpoint_step_name(step)).string();
  };
  // `single` holds the state before step t: the seed's, or the run's saved one.
  auto single = std::make_unique<ReferenceTrainer>(cfg);
  if (first > 1) single->load_checkpoint(saved(first - 1));
  for (int64_t t = first; t <= last; ++t) {
    SCOPED_TRACE(fmt::format("step {}", t));
    if (single->step() != t - 1) {
      ADD_FAILURE() << "the checkpoint before step " << t << " is at step " << single->step();
      return checked;
    }
    const std::vector<float> m0(single->adam_m().begin(), single->adam_m().end());
    const std::vector<float> v0(single->adam_v().begin(), single->adam_v().end());
    const auto& views = single->model().param_views();
    const std::span<const float> params(single->model().params().data<float>(),
                                        size_t(single->model().num_params()));
    tessel::testing::AdamDivergence bound(m0, v0, cfg.optimizer.beta1, cfg.optimizer.beta2,
                                          cfg.optimizer.eps);
    single->observe_gradients([&](std::span<const float> g, const kernels::AdamWConfig& opt) {
      std::vector<double> delta = model::test_util::gradient_bounds(views, g, grad_tol);
      // The clipping factor c = max_norm / (|g| + 1e-6) moves with the norm, and
      // ||g'| - |g|| <= |g' - g| <= sqrt(sum delta^2) = rho |g|: c' is within c rho / (1 - rho)
      // of c (plus its own float rounding), whether or not either run clips.
      double norm2 = 0, delta2 = 0;
      for (size_t i = 0; i < g.size(); ++i)
        norm2 += double(g[i]) * g[i], delta2 += delta[i] * delta[i];
      const double c = opt.grad_scale;
      const double rho = norm2 > 0 ? std::sqrt(delta2 / norm2) : 0;
      const double dc =
          cfg.training.grad_clip > 0
              ? (rho < 1 ? c * (rho / (1 - rho) + 4 * tessel::testing::kUnitRoundoff) : INFINITY)
              : 0;
      for (size_t i = 0; i < g.size(); ++i)
        delta[i] = c * delta[i] + dc * (std::fabs(double(g[i])) + delta[i]);
      bound.step(g, opt.grad_scale, delta, params, opt.lr, cfg.optimizer.weight_decay, opt.step);
    });
    const double loss = single->train_step();
    const std::string at = fmt::format("step {}: ", t);
    if (losses.count(t)) {
      EXPECT_TRUE(tessel::testing::within_bound(losses.at(t), loss, loss_tol * std::fabs(loss),
                                                (at + "loss").c_str()));
    } else {
      ++checked.unlogged;
    }

    auto run = std::make_unique<ReferenceTrainer>(cfg);
    run->load_checkpoint(saved(t));
    EXPECT_EQ(run->step(), single->step());
    EXPECT_EQ(run->cursor(), single->cursor());
    if (const auto e = eval_losses.find(t); e != eval_losses.end()) {
      // The same parameters (the run's own, saved): only the forward's rounding differs.
      const double want = run->evaluate();
      EXPECT_TRUE(tessel::testing::within_bound(e->second, want, eval_tol * std::fabs(want),
                                                (at + "eval loss").c_str()));
      ++checked.evaluated;
    }
    const std::span<const float> got(run->model().params().data<float>(),
                                     size_t(run->model().num_params()));
    struct Compared {
      const char* what;
      std::span<const float> got, want;
      std::span<const double> bound;
    };
    for (const Compared& c :
         {Compared{"parameters", got, params, bound.bounds()},
          Compared{"Adam m", run->adam_m(), single->adam_m(), bound.m_bounds()},
          Compared{"Adam v", run->adam_v(), single->adam_v(), bound.v_bounds()}}) {
      for (const model::ParamView& v : views) {
        const auto part = [&](auto x) { return x.subspan(size_t(v.offset), size_t(v.numel)); };
        EXPECT_TRUE(tessel::testing::within_bounds(part(c.got), part(c.want), part(c.bound),
                                                   (at + v.name + " " + c.what).c_str()));
      }
    }
    ++checked.steps;
    single = std::move(run);  // the state before the next step
  }
  std::printf(
      "[steps] %lld steps checked against one single-process step each (%lld without a "
      "logged loss; %lld eval losses), in %.1f s\n",
      static_cast<long long>(checked.steps), static_cast<long long>(checked.unlogged),
      static_cast<long long>(checked.evaluated),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return checked;
}

}  // namespace tessel::runtime::testing
