#include "tessel/runtime/stage.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "tessel/core/check.h"
#include "tessel/layout/zero_split.h"

namespace tessel::runtime {

using layout::StateKind;

std::span<float> Chunk::state(StateKind kind) {
  switch (kind) {
    case StateKind::param:
      return {model->params().data<float>(), size_t(model->num_params())};
    case StateKind::adam_m:
      return {adam_m.data<float>(), size_t(own_n)};
    case StateKind::adam_v:
      return {adam_v.data<float>(), size_t(own_n)};
    default:
      TESSEL_THROW(UnsupportedError, "a stage holds no {} state", layout::state_kind_name(kind));
  }
}

Stage::Stage(const config::TrainConfig& cfg, std::shared_ptr<const layout::StateLayout> layout,
             int rank, int micro_batch, kernels::Backend& backend, model::TpGroup* tp,
             const std::vector<int>& slots, bool init_params, StageSources sources)
    : layout_(std::move(layout)), rank_(rank), micro_batch_(micro_batch) {
  const layout::Plan& plan = layout_->plan();
  const layout::Coord coord = plan.coord_of(rank);
  const auto& buffers = layout_->buffers(rank);
  const auto ranges = plan.stage_ranges(cfg.model);
  const std::string wte =
      model::global_param_name(cfg.model.family, model::GlobalParam::token_embedding);
  // The donor's chunk whose `kind` buffer the switch keeps in place as chunk c's, or -1.
  auto kept = [&](int c, StateKind kind) {
    if (sources.donor == nullptr || sources.transfer == nullptr) return -1;
    const int b = sources.transfer->kept_from(rank, layout_->buffer_id(rank, c, kind));
    if (b < 0) return -1;
    const auto& old = sources.donor->layout().buffers(sources.donor->rank())[size_t(b)];
    return old.kind == kind ? old.chunk : -1;
  };
  for (int c = 0; c < plan.virtual_stages; ++c) {
    Chunk ch;
    ch.vs = plan.stage_of(coord.pp, c);
    ch.range = ranges[size_t(ch.vs)];
    const int peak = slots[size_t(c)];
    if (const int d = kept(c, StateKind::param); d >= 0) {
      auto& old = sources.donor->chunks_[size_t(d)].model;
      if (old && !old->training_buffers_released()) {
        old->rebind_tp_group(tp);
        // Only the activations depend on the micro-batching: the parameters stay in place.
        old->reshape(micro_batch, peak, plan.recompute, plan.split_backward());
        // A step that failed half-way (a recovery) left partial sums in the gradients.
        old->zero_grad();
        ch.model = std::move(old);
        taken_.push_back({c, d, StateKind::param});
      }
    }
    if (!ch.model && sources.prepared != nullptr && sources.prepared->models[size_t(c)]) {
      ch.model = std::move(sources.prepared->models[size_t(c)]);
      ch.model->rebind_tp_group(tp);
    }
    if (!ch.model) {
      ch.model = std::make_unique<model::Transformer>(cfg.model, backend, micro_batch,
                                                      int(cfg.data.seq_len), ch.range, tp, peak,
                                                      plan.recompute);
      if (plan.split_backward()) ch.model->set_split_backward(true);
    }
    ch.model->set_bf16_matmuls(cfg.training.bf16());
    ch.slots = peak;
    ch.slot_of.assign(size_t(plan.micro_batches), -1);
    for (int i = peak - 1; i >= 0; --i) ch.free_slots.push_back(i);
    if (init_params) ch.model->init(cfg.training.seed);
    const int64_t n = ch.model->num_params();
    const auto& params = buffers[size_t(layout_->buffer_id(rank, c, StateKind::param))];
    TESSEL_CHECK(params.numel == n, Error,
                 "internal: chunk {} of rank {} has {} parameters, its layout {}", c, rank, n,
                 params.numel);
    // The moments cover what the layout says this rank steps (ZeRO-1: its owned range).
    const auto& moments = buffers[size_t(layout_->buffer_id(rank, c, StateKind::adam_m))];
    ch.own_lo = moments.chunk_begin;
    ch.own_n = moments.numel;
    if (plan.zero_stage == 1) ch.dp_counts = layout::zero_split(n, plan.dp, coord.dp).counts;
    // Allocated with one element at least (an empty ZeRO-1 share still needs a pointer).
    const int64_t n_adam = std::max<int64_t>(ch.own_n, 1);
    auto adam = [&](StateKind kind, Tensor Chunk::*member,
                    std::vector<Tensor> PreparedChunks::*ready) {
      if (const int d = kept(c, kind); d >= 0) {
        Tensor& t = sources.donor->chunks_[size_t(d)].*member;
        if (t.defined() && t.numel() == n_adam) {
          taken_.push_back({c, d, kind});
          return std::move(t);
        }
      }
      if (sources.prepared != nullptr) {
        Tensor& t = (sources.prepared->*ready)[size_t(c)];
        if (t.defined() && t.numel() == n_adam) return std::move(t);
      }
      return Tensor::zeros({n_adam});
    };
    ch.adam_m = adam(StateKind::adam_m, &Chunk::adam_m, &PreparedChunks::adam_m);
    ch.adam_v = adam(StateKind::adam_v, &Chunk::adam_v, &PreparedChunks::adam_v);
    if (cfg.model.tie_embeddings && plan.pp > 1 && (ch.range.has_embedding || ch.range.has_head)) {
      const auto& views = ch.model->param_views();
      for (size_t i = 0; i < views.size(); ++i)
        if (views[i].name == wte) ch.tied_view = int(i);
      ch.tied_copy = !ch.range.has_embedding;
    }
    chunks_.push_back(std::move(ch));
  }
}

std::vector<std::span<float>> Stage::state_buffers() {
  std::vector<std::span<float>> out;
  for (const auto& info : layout_->buffers(rank_))
    out.push_back(chunks_[size_t(info.chunk)].state(info.kind));
  return out;
}

void Stage::give_back(Stage& donor, model::TpGroup* donor_tp) {
  for (const auto& t : taken_) {
    auto& mine = chunks_[size_t(t.chunk)];
    auto& theirs = donor.chunks_[size_t(t.donor_chunk)];
    if (t.kind == StateKind::param) {
      theirs.model = std::move(mine.model);
      theirs.model->rebind_tp_group(donor_tp);
      const layout::Plan& theirs_plan = donor.layout_->plan();
      theirs.model->reshape(donor.micro_batch_, theirs.slots, theirs_plan.recompute,
                            theirs_plan.split_backward());
    } else if (t.kind == StateKind::adam_m) {
      theirs.adam_m = std::move(mine.adam_m);
    } else {
      theirs.adam_v = std::move(mine.adam_v);
    }
  }
  taken_.clear();
}

void Stage::release_unkept(const std::vector<bool>& kept) {
  for (size_t c = 0; c < chunks_.size(); ++c) {
    auto& m = chunks_[c].model;
    if ((c < kept.size() && kept[c]) || !m || m->training_buffers_released()) continue;
    m->release_training_buffers();
  }
}

void Stage::dump_params(const std::string& dir, int tp_rank, int tp_size) const {
  auto path = fmt::format("{}/rank{}.params", dir, rank_);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  TESSEL_CHECK(f != nullptr, IoError, "cannot write {} (output.rank_params)", path);
  bool ok = true;
  for (const auto& ch : chunks_) {
    const float* params = ch.model->params().data<float>();
    for (const auto& v : ch.model->param_views()) {
      auto head = fmt::format("{} {} {} {}\n", v.name, v.numel, tp_rank, tp_size);
      ok = ok && std::fwrite(head.data(), 1, head.size(), f) == head.size();
      ok = ok &&
           std::fwrite(params + v.offset, sizeof(float), size_t(v.numel), f) == size_t(v.numel);
    }
  }
  ok = std::fclose(f) == 0 && ok;
  TESSEL_CHECK(ok, IoError, "writing {} failed (output.rank_params)", path);
}

}  // namespace tessel::runtime
