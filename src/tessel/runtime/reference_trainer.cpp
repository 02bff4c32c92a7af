#include "tessel/runtime/reference_trainer.h"

#include <cmath>
#include <filesystem>

#include "tessel/checkpoint/model_weights.h"
#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/data/batch_loader.h"
#include "tessel/data/token_source.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/evaluation.h"
#include "tessel/runtime/host_settings.h"
#include "tessel/runtime/lr_schedule.h"
#include "tessel/runtime/metrics.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {

using checkpoint::add_rank_state;
using checkpoint::check_resumable;
using checkpoint::checkpoint_meta;
using checkpoint::checkpoint_step_name;
using checkpoint::latest_sharded_checkpoint;
using checkpoint::load_rank_state;
using checkpoint::publish_checkpoint;
using config::TrainConfig;

struct ReferenceTrainer::Impl {
  TrainConfig cfg;
  std::unique_ptr<kernels::Backend> backend;
  std::shared_ptr<const data::TokenSource> source;
  std::unique_ptr<data::BatchLoader> loader;
  std::unique_ptr<model::Transformer> model;
  Tensor adam_m, adam_v;
  std::vector<int32_t> inputs, targets;  // one global batch
  LrSchedule schedule;
  int64_t step = 0;    // optimizer steps taken
  int64_t cursor = 0;  // samples consumed from the training order
  MetricsWriter metrics;
  GradientObserver observer;

  explicit Impl(TrainConfig c) : cfg(std::move(c)) {
    apply_host_settings(cfg.training);
    backend = kernels::make_backend(cfg.training.backend);
    source = data::open_token_source(cfg.data.path);
    TESSEL_CHECK(source->vocab_size() <= uint64_t(cfg.model.vocab_size), ConfigError,
                 "{}: the data {} has token ids up to {} but model '{}' has vocab_size {}: set "
                 "model.vocab_size >= {} or prepare the data with a matching tokenizer",
                 cfg.source, source->describe(), source->vocab_size() - 1, cfg.model.name,
                 cfg.model.vocab_size, source->vocab_size());
    loader = std::make_unique<data::BatchLoader>(source, cfg.data.seq_len, cfg.data.seed,
                                                 cfg.data.eval_fraction);
    const int64_t mb = cfg.training.micro_batch, T = cfg.data.seq_len;
    model = std::make_unique<model::Transformer>(cfg.model, *backend, int(mb), int(T));
    model->set_bf16_matmuls(cfg.training.bf16());
    adam_m = Tensor::zeros({model->num_params()});
    adam_v = Tensor::zeros({model->num_params()});
    inputs.resize(size_t(cfg.training.global_batch * T));
    targets.resize(inputs.size());
    schedule = LrSchedule{cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.warmup_steps,
                          cfg.training.steps};
    if (!resume()) {
      if (cfg.init_from.empty()) {
        model->init(cfg.training.seed);
      } else {
        const auto weights = checkpoint::ModelWeights::open(cfg.init_from);
        checkpoint::load_rank_weights(*weights, state_layout(), 0, state_buffers());
        spdlog::info("initialised from {}", weights->describe());
      }
    }
    metrics = MetricsWriter(cfg.metrics_path);
  }

  // The state in StateLayout order for the one-rank plan: parameters, Adam m, Adam v.
  std::vector<std::span<float>> state_buffers() {
    return {{model->params().data<float>(), size_t(model->num_params())},
            {adam_m.data<float>(), size_t(adam_m.numel())},
            {adam_v.data<float>(), size_t(adam_v.numel())}};
  }
  // The one-rank plan this loop runs: training.micro_batch samples per forward/backward, the
  // global batch in global_batch / micro_batch of them (what a checkpoint's meta records).
  layout::Plan plan() const {
    layout::Plan p;
    p.micro_batch = cfg.training.micro_batch;
    p.micro_batches = cfg.training.global_batch / cfg.training.micro_batch;
    return p.with_defaults(cfg.model);
  }
  layout::StateLayout state_layout() const { return layout::StateLayout::build(cfg.model, plan()); }

  nlohmann::json checkpoint_meta() const {
    return checkpoint::checkpoint_meta(cfg, plan(), step, cursor);
  }

  // Continues from the newest checkpoint in checkpoint.dir, which may have been saved by any
  // number of workers under any plan (sharded_checkpoint.h).
  bool resume() {
    if (cfg.checkpoint.dir.empty() || !cfg.checkpoint.resume) return false;
    auto path = latest_sharded_checkpoint(cfg.checkpoint.dir);
    if (!path) return false;
    load(*path);
    return true;
  }

  void load(const std::string& path) {
    store::CheckpointReader reader(path);
    const nlohmann::json& meta = reader.meta();
    check_resumable(cfg, meta, path);
    load_rank_state(reader, state_layout(), 0, state_buffers());
    step = meta.at("step").get<int64_t>();
    cursor = meta.at("cursor").get<int64_t>();
    spdlog::info("resumed from {} at step {} (cursor {} samples)", path, step, cursor);
  }

  void save() {
    if (cfg.checkpoint.dir.empty()) return;
    std::filesystem::create_directories(cfg.checkpoint.dir);
    store::CheckpointWriter writer(
        (std::filesystem::path(cfg.checkpoint.dir) / checkpoint_step_name(step)).string(), 0);
    std::vector<std::span<const float>> buffers;
    for (auto b : state_buffers()) buffers.emplace_back(b.data(), b.size());
    add_rank_state(writer, state_layout(), 0, buffers);
    writer.write_rank_file();
    publish_checkpoint(writer, 1, checkpoint_meta(), cfg.checkpoint.dir, cfg.checkpoint.keep);
    spdlog::debug("saved checkpoint {}", writer.dir());
  }

  // One optimizer step over one global batch; returns the mean loss.
  double train_step(double* grad_norm_out) {
    const int64_t G = cfg.training.global_batch, mb = cfg.training.micro_batch,
                  T = cfg.data.seq_len;
    loader->load(cursor, 0, G, inputs.data(), targets.data());
    int64_t valid = 0;
    for (int32_t t : targets) valid += t != model::Transformer::kIgnoreIndex;
    const float grad_scale = valid > 0 ? 1.0f / float(valid) : 0.0f;

    // Gradients are zero here: the model starts with zeroed gradients and every optimizer step
    // below zeroes them as it reads them (AdamWConfig::zero_grad), saving a pass over memory.
    model->refresh_compute_weights();  // mixed precision: the weights changed at the last step
    double loss_sum = 0;
    for (int64_t i = 0; i < G / mb; ++i) {
      auto r = model->forward_backward(inputs.data() + i * mb * T, targets.data() + i * mb * T,
                                       grad_scale);
      loss_sum += r.loss_sum;
    }

    float* grads = model->grads().data<float>();
    const int64_t n = model->num_params();
    double norm = std::sqrt(backend->sum_of_squares(grads, n));
    *grad_norm_out = norm;

    kernels::AdamWConfig opt = cfg.optimizer.adamw_step(
        schedule.at(step), step, kernels::clip_factor(norm, float(cfg.training.grad_clip)));
    if (observer) observer({grads, size_t(n)}, opt);
    float* params = model->params().data<float>();
    for (const auto& v : model->param_views()) {
      opt.weight_decay = v.weight_decay ? float(cfg.optimizer.weight_decay) : 0.0f;
      backend->adamw_update(params + v.offset, grads + v.offset, adam_m.data<float>() + v.offset,
                            adam_v.data<float>() + v.offset, v.numel, opt);
    }
    ++step;
    cursor += G;
    return valid > 0 ? loss_sum / double(valid) : 0.0;
  }

  double evaluate() {
    const int64_t mb = cfg.training.micro_batch, T = cfg.data.seq_len;
    const auto samples = eval_samples(loader->num_eval_samples(), cfg.training.eval_batches,
                                      cfg.training.eval_batch_size());
    std::vector<int32_t> in(size_t(mb * T)), tg(in.size());
    model->refresh_compute_weights();
    double loss_sum = 0;
    int64_t valid = 0;
    for (int64_t j = 0; j * mb < int64_t(samples.size()); ++j) {
      load_eval_batch(*loader, samples, j, mb, T, in.data(), tg.data());
      auto r = model->forward(in.data(), tg.data());
      loss_sum += r.loss_sum;
      valid += r.valid;
    }
    return valid > 0 ? loss_sum / double(valid) : NAN;
  }
};

ReferenceTrainer::ReferenceTrainer(TrainConfig config)
    : impl_(std::make_unique<Impl>(std::move(config))) {}
ReferenceTrainer::~ReferenceTrainer() = default;

void ReferenceTrainer::load_checkpoint(const std::string& dir) {
  impl_->load(dir);
}
void ReferenceTrainer::observe_gradients(GradientObserver observer) {
  impl_->observer = std::move(observer);
}
std::span<const float> ReferenceTrainer::adam_m() const {
  return {impl_->adam_m.data<float>(), size_t(impl_->adam_m.numel())};
}
std::span<const float> ReferenceTrainer::adam_v() const {
  return {impl_->adam_v.data<float>(), size_t(impl_->adam_v.numel())};
}

int64_t ReferenceTrainer::step() const {
  return impl_->step;
}
int64_t ReferenceTrainer::cursor() const {
  return impl_->cursor;
}
const model::Transformer& ReferenceTrainer::model() const {
  return *impl_->model;
}
double ReferenceTrainer::evaluate() {
  return impl_->evaluate();
}
double ReferenceTrainer::train_step() {
  double grad_norm = 0;
  return impl_->train_step(&grad_norm);
}

TrainSummary ReferenceTrainer::run() {
  auto& s = *impl_;
  const auto& cfg = s.cfg;
  const int64_t tokens_per_step = cfg.training.global_batch * cfg.data.seq_len;
  spdlog::info("training {} ({:.3g} parameters) on {} for {} steps, {} tokens per step, backend {}",
               cfg.model.name, double(s.model->num_params()), s.source->describe(),
               cfg.training.steps, tokens_per_step, s.backend->name());
  RunTracker tracker(s.step, cfg.training.steps, cfg.training.log_every, tokens_per_step, true);
  while (s.step < cfg.training.end_step()) {
    tracker.begin_step();
    double lr = s.schedule.at(s.step);
    double grad_norm = 0;
    double loss = s.train_step(&grad_norm);
    nlohmann::json record = tracker.end_step(s.step, loss, lr, grad_norm, s.cursor);
    bool last = s.step == cfg.training.end_step();
    if (cfg.training.eval_every > 0 && (s.step % cfg.training.eval_every == 0 || last)) {
      double eval_loss = s.evaluate();
      record["eval_loss"] = eval_loss;
      tracker.record_eval(s.step, eval_loss);
    }
    s.metrics.write(record);
    if (!cfg.checkpoint.dir.empty() &&
        ((cfg.checkpoint.every > 0 && s.step % cfg.checkpoint.every == 0) || last)) {
      s.save();
    }
  }
  const TrainSummary& summary = tracker.finish();
  if (summary.steps_run > 0) {
    std::string eval = std::isnan(summary.final_eval_loss)
                           ? ""
                           : fmt::format(", eval loss {:.4f}", summary.final_eval_loss);
    std::printf("done: %lld steps in %s, final loss %.4f%s, %s tokens/s\n",
                static_cast<long long>(summary.steps_run),
                format_duration(tracker.elapsed_seconds()).c_str(), summary.final_loss,
                eval.c_str(), format_rate(summary.tokens_per_second).c_str());
  }
  return summary;
}

}  // namespace tessel::runtime
