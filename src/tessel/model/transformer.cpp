#include "tessel/model/transformer.h"

#include <vector>

#include "tessel/core/check.h"
#include "tessel/model/init.h"
#include "tessel/model/tp_shard.h"
#include "tessel/tensor/box_copy.h"

namespace tessel::model {

using kernels::CrossEntropyResult;
using kernels::Op;

namespace {

// Hands out consecutive 64-byte aligned float ranges of one block. With a null base it only
// counts, so the same planning code sizes the block and then carves it.
struct Carver {
  float* base;
  int64_t used = 0;
  float* take(int64_t n) {
    float* ptr = base ? base + used : nullptr;
    used += (n + 15) / 16 * 16;
    return ptr;
  }
};

}  // namespace

Transformer::Transformer(const ModelConfig& config, kernels::Backend& backend, int B, int T,
                         StageRange stage, TpGroup* tp, int activation_slots, Recompute recompute)
    : config_(config), backend_(backend), B_(B), T_(T), recompute_(recompute) {
  config_.validate();
  TESSEL_CHECK(activation_slots >= 1, ConfigError,
               "activation_slots is {}; a model needs at least one activation slot",
               activation_slots);
  slots_.resize(size_t(activation_slots));
  stage_ = stage.resolved(config_);
  if (tp != nullptr) {
    TESSEL_CHECK(tp->size() >= 1 && tp->rank() >= 0 && tp->rank() < tp->size(),
                 InvalidArgumentError, "tensor-parallel group has rank {} of size {}", tp->rank(),
                 tp->size());
    if (tp->size() > 1) tp_ = tp;
  }
  validate_tp(config_, tp_size());
  {
    const TpHeads h = tp_heads(config_, tp_rank(), tp_size());
    const TpVocabRange vr = tp_vocab_range(config_, tp_rank(), tp_size());
    local_ =
        Local{h.q_heads, h.kv_heads, h.kv_begin, h.kv_replicated, config_.ffn_hidden / tp_size(),
              vr.rows,   vr.start};
  }
  TESSEL_CHECK(B > 0, ConfigError, "micro-batch size B is {}; it must be positive", B);
  TESSEL_CHECK(T > 0 && T <= config_.max_seq_len, ConfigError,
               "sequence length T = {} must be in [1, max_seq_len = {}] for model '{}'", T,
               config_.max_seq_len, config_.name);
  const bool gpt2 = config_.family == Family::gpt2;
  std::vector<Op> needed = {Op::embedding, Op::linear, Op::attention, Op::residual,
                            Op::cross_entropy};
  if (gpt2) {
    needed.insert(needed.end(), {Op::layernorm, Op::gelu});
  } else {
    needed.insert(needed.end(), {Op::rmsnorm, Op::rope, Op::swiglu});
  }
  if (tp_ != nullptr && stage_.has_head) needed.push_back(Op::vocab_parallel_ce);
  for (Op op : needed) {
    TESSEL_CHECK(backend_.supports(op), UnsupportedError,
                 "backend '{}' does not support op '{}', which the {} family needs; use the cpu "
                 "backend",
                 backend_.name(), kernels::op_name(op), family_name(config_.family));
  }

  // Parameters: this stage's subset of the spec, packed in canonical order; with tensor
  // parallelism only this rank's shard of each.
  spec_ = ModelSpec::from(config_).for_stage(stage_);
  for (const ParamSpec& ps : spec_) {
    const Shape local = tp_local_shape(ps, config_, tp_rank(), tp_size());
    views_.push_back(ParamView{ps.name, local, num_params_, local.numel(), ps.weight_decay,
                               tp_copies(ps, config_, tp_size()),
                               tp_is_primary(ps, config_, tp_rank(), tp_size())});
    num_params_ += local.numel();
  }
  std::vector<int64_t> offsets;
  for (const ParamView& v : views_) offsets.push_back(v.offset);
  {
    ParamOffsets o = param_offsets(spec_, stage_.layer_begin, stage_.layer_end, offsets);
    layer_off_ = std::move(o.layer);
    wte_off_ = o.wte, wpe_off_ = o.wpe, lnf_w_off_ = o.lnf_w, lnf_b_off_ = o.lnf_b;
    head_off_ = o.head;
  }

  const size_t param_bytes = size_t(std::max<int64_t>(num_params_, 1)) * sizeof(float);
  params_ = static_cast<float*>(allocate(param_bytes, owned_));
  grads_ = static_cast<float*>(allocate(param_bytes, owned_));
  backend_.memset_zero(params_, param_bytes);
  backend_.memset_zero(grads_, param_bytes);

  build_activations();
}

void Transformer::build_activations() {
  act_floats_ = plan_activations(nullptr);
  act_base_ = static_cast<float*>(allocate(size_t(act_floats_) * sizeof(float), act_owned_));
  plan_activations(act_base_);
  // Touch every page now so that the first training step does not pay the page faults.
  backend_.memset_zero(act_base_, size_t(act_floats_) * sizeof(float));
  const size_t id_bytes = size_t(B_) * size_t(T_) * sizeof(int32_t);
  for (Slot& sl : slots_) {
    sl.tokens = static_cast<int32_t*>(allocate(id_bytes, act_owned_));
    backend_.memset_zero(sl.tokens, id_bytes);
  }
  // Targets are read by the forward's loss only, so one buffer serves every slot.
  targets_ = static_cast<int32_t*>(allocate(id_bytes, act_owned_));
  backend_.memset_zero(targets_, id_bytes);
  copy_staging_.clear();
  if (split_ && backend_.device() != kernels::DeviceKind::cpu) {
    copy_staging_.resize(size_t(B_) * size_t(T_) * size_t(config_.n_embd));
  }
  select_slot(0);
}

void Transformer::reshape(int B, int activation_slots) {
  reshape(B, activation_slots, recompute_, split_);
}

void Transformer::reshape(int B, int activation_slots, Recompute recompute) {
  reshape(B, activation_slots, recompute, split_);
}

void Transformer::set_recompute(Recompute recompute) {
  reshape(B_, activation_slots(), recompute, split_);
}

void Transformer::set_split_backward(bool split) {
  reshape(B_, activation_slots(), recompute_, split);
}

void Transformer::reshape(int B, int activation_slots, Recompute recompute, bool split_backward) {
  TESSEL_CHECK(!released_, InvalidArgumentError,
               "reshape of a model whose training buffers were released");
  TESSEL_CHECK(B > 0, ConfigError, "micro-batch size B is {}; it must be positive", B);
  TESSEL_CHECK(activation_slots >= 1, ConfigError,
               "activation_slots is {}; a model needs at least one activation slot",
               activation_slots);
  if (B == B_ && activation_slots == this->activation_slots() && recompute == recompute_ &&
      split_backward == split_) {
    for (Slot& sl : slots_) sl.forward_ready = sl.dlogits_ready = sl.weight_pending = false;
    return;
  }
  // The old activations go back to the allocator before the new ones are taken from it.
  act_owned_.clear();
  act_base_ = nullptr;
  targets_ = nullptr;
  B_ = B;
  recompute_ = recompute;
  split_ = split_backward;
  slots_.assign(size_t(activation_slots), Slot{});
  build_activations();
}

void Transformer::check_slot(int s) const {
  TESSEL_CHECK(s >= 0 && s < activation_slots(), InvalidArgumentError,
               "activation slot {} is out of range: the model was built with {} slot(s)", s,
               activation_slots());
}

void Transformer::select_slot(int s) {
  check_slot(s);
  cur_ = s;
  Slot& sl = slots_[size_t(s)];
  acts_ = &sl.acts;
  a_ = sl.g;
  tokens_ = sl.tokens;
}

void Transformer::set_bf16_matmuls(bool on) {
  TESSEL_CHECK(!released_, InvalidArgumentError,
               "set_bf16_matmuls: the model's training buffers were released");
  if (on == bf16_matmuls()) return;
  bf16_owned_.clear();
  params16_ = nullptr;
  params16_fresh_ = false;
  if (on)
    params16_ = static_cast<bf16*>(
        allocate(size_t(std::max<int64_t>(num_params_, 1)) * sizeof(bf16), bf16_owned_));
}

void Transformer::refresh_compute_weights() {
  if (params16_ == nullptr) return;
  backend_.to_bf16(params16_, params_, num_params_);
  params16_fresh_ = true;
}

const bf16* Transformer::compute_weight(const float* weight) const {
  TESSEL_CHECK(params16_fresh_, InvalidArgumentError,
               "a bf16 pass before refresh_compute_weights() made the weights' bf16 copy");
  TESSEL_CHECK(weight >= params_ && weight < params_ + num_params_, InvalidArgumentError,
               "internal: a linear layer's weight outside the model's parameters");
  return params16_ + (weight - params_);
}

void Transformer::linear_forward(float* out, const float* inp, const float* weight,
                                 const float* bias, int N, int IC, int OC) {
  if (params16_ != nullptr)
    backend_.linear_forward_bf16(out, inp, compute_weight(weight), bias, N, IC, OC);
  else
    backend_.linear_forward(out, inp, weight, bias, N, IC, OC);
}

void Transformer::linear_backward_input(float* dinp, const float* dout, const float* weight, int N,
                                        int IC, int OC) {
  if (params16_ != nullptr)
    backend_.linear_backward_input_bf16(dinp, dout, compute_weight(weight), N, IC, OC);
  else
    backend_.linear_backward_input(dinp, dout, weight, N, IC, OC);
}

void Transformer::linear_backward_weight(float* dweight, float* dbias, const float* dout,
                                         const float* inp, int N, int IC, int OC) {
  if (params16_ != nullptr)
    backend_.linear_backward_weight_bf16(dweight, dbias, dout, inp, N, IC, OC);
  else
    backend_.linear_backward_weight(dweight, dbias, dout, inp, N, IC, OC);
}

void Transformer::release_training_buffers() {
  for (auto& p : owned_)
    if (p.get() != params_) p.reset();
  act_owned_.clear();
  bf16_owned_.clear();
  params16_ = nullptr;
  params16_fresh_ = false;
  grads_ = nullptr;
  act_base_ = nullptr;
  targets_ = nullptr;
  for (Slot& sl : slots_) sl.tokens = nullptr;
  released_ = true;
}

void* Transformer::allocate(size_t bytes, std::vector<Owned>& owner) {
  owner.reserve(owner.size() + 1);  // so that push_back cannot throw after the allocation
  void* ptr = backend_.allocate(bytes);
  owner.emplace_back(ptr, BackendFree{&backend_});
  return ptr;
}

int64_t Transformer::plan_activations(float* base) {
  Carver c{base};
  const int64_t N = int64_t(B_) * T_, C = config_.n_embd, F = local_.F;
  const int64_t D = config_.head_dim(), Hq = local_.Hq, Hkv = local_.Hkv;
  const int64_t qkv = (Hq + 2 * Hkv) * D;
  const bool gpt2 = config_.family == Family::gpt2;
  const bool blocks = stage_.num_layers() > 0;
  // Scratch shared by all slots: the projection output and the backward's gradients. With split
  // backward the gradients the weight pass reads live in the slots instead (LayerGrads); only
  // d(activation) stays here.
  Globals shared{};
  shared.proj = c.take(N * C);
  shared.dres = c.take(N * C);
  shared.dln = c.take(N * C);
  if (blocks) {
    shared.datty = c.take(N * Hq * D);
    if (!split_) shared.dqkv = c.take(N * qkv);
    if (!split_) shared.df0 = c.take(N * F);
    if (!split_ || gpt2) shared.df1 = c.take(N * F);  // gpt2's d(activation)
    if (!gpt2) shared.df2 = c.take(N * F);            // llama's
    if (local_.kv_replicated) shared.kv_stage = c.take(2 * int64_t(config_.n_kv_head) * D * C);
  }
  // A block's activations but its output (res3, the next block's input), in two parts: the
  // inputs of its linears (what a split backward's weight pass reads) and the rest, with or
  // without the attention probabilities.
  auto take_inputs = [&](LayerActs& la) {
    la.ln1 = c.take(N * C);
    la.atty = c.take(N * Hq * D);
    la.ln2 = c.take(N * C);
    la.act = c.take(N * F);
  };
  auto take_rest = [&](LayerActs& la, bool probs) {
    if (gpt2) la.ln1_mean = c.take(N);
    la.ln1_rstd = c.take(N);
    la.qkv = c.take(N * qkv);
    if (probs) la.probs = c.take(int64_t(B_) * Hq * T_ * T_);
    la.res2 = c.take(N * C);
    if (gpt2) la.ln2_mean = c.take(N);
    la.ln2_rstd = c.take(N);
    la.fc = c.take(N * F);
    if (!gpt2) la.up = c.take(N * F);
  };
  // What recomputation refills in backward exists once, shared by all blocks and slots: the
  // whole block but its output (full) or the attention probabilities (selective). A split
  // backward's weight pass runs after other blocks' recomputations, so under full recomputation
  // the inputs of the linears stay per block and slot.
  const bool full = recompute_ == Recompute::full;
  LayerActs recomputed{};
  if (blocks && full) {
    if (!split_) take_inputs(recomputed);
    take_rest(recomputed, true);
  }
  if (blocks && recompute_ == Recompute::selective) {
    recomputed.probs = c.take(int64_t(B_) * Hq * T_ * T_);
  }
  // Floats of the norms' parameters of a block and of the final norm.
  int64_t block_norm = 0;
  if (blocks) {
    for (LayerParam k : {LayerParam::norm1_weight, LayerParam::norm1_bias, LayerParam::norm2_weight,
                         LayerParam::norm2_bias}) {
      if (layer_off_[0][size_t(k)] >= 0) block_norm += C;
    }
  }
  const int64_t final_norm = lnf_b_off_ >= 0 ? 2 * C : C;
  for (Slot& sl : slots_) {
    Globals& g = sl.g;
    g = shared;
    g.x0 = c.take(N * C);
    sl.acts.assign(size_t(stage_.num_layers()), recomputed);
    for (LayerActs& la : sl.acts) {
      if (!full || split_) take_inputs(la);
      if (!full) take_rest(la, recompute_ == Recompute::none);
      la.res3 = c.take(N * C);
    }
    if (split_) {
      sl.grads.assign(size_t(stage_.num_layers()), LayerGrads{});
      for (LayerGrads& lg : sl.grads) {
        lg.dout = c.take(N * C);
        lg.dmid = c.take(N * C);
        lg.d0 = c.take(N * F);
        if (!gpt2) lg.d1 = c.take(N * F);
        lg.dqkv = c.take(N * qkv);
        lg.dnorm = c.take(block_norm);
      }
      if (stage_.has_embedding) g.demb = c.take(N * C);
      if (stage_.has_head) g.dlnf = c.take(final_norm);
    }
    if (stage_.has_head) {
      g.lnf = c.take(N * C);
      if (gpt2) g.lnf_mean = c.take(N);
      g.lnf_rstd = c.take(N);
      g.logits = c.take(N * local_.Vp);
      g.losses = c.take(N);
      if (tp_ != nullptr) {
        g.ce_max = c.take(N);
        g.ce_sums = c.take(2 * N);
      }
    }
  }
  return c.used;
}

// ---- parameters -------------------------------------------------------------------------------

Tensor Transformer::params() const {
  return Tensor::wrap(params_, Shape{num_params_});
}
Tensor Transformer::grads() const {
  return Tensor::wrap(grads_, Shape{num_params_});
}

Tensor Transformer::param(std::string_view name) const {
  const ParamView& v = views_[size_t(spec_.index_of(spec_.at(name).name))];
  return Tensor::wrap(params_ + v.offset, v.shape);
}

Tensor Transformer::grad(std::string_view name) const {
  const ParamView& v = views_[size_t(spec_.index_of(spec_.at(name).name))];
  return Tensor::wrap(grads_ + v.offset, v.shape);
}

void Transformer::init(uint64_t seed) {
  const bool host = backend_.device() == kernels::DeviceKind::cpu;
  std::vector<float> staging, piece;
  for (size_t i = 0; i < spec_.size(); ++i) {
    const ParamSpec& ps = spec_[i];
    const ParamView& view = views_[i];
    float* dst = params_ + view.offset;
    // Each piece of the shard is generated as its box of the GLOBAL tensor, so a shard equals the
    // same slice of the unsharded parameter bit for bit.
    const std::vector<ShardPiece> pieces = tp_shard_pieces(ps, config_, tp_rank(), tp_size());
    float* local = dst;
    if (!host) {
      staging.resize(size_t(view.numel));
      local = staging.data();
    }
    if (pieces.size() == 1 && pieces[0].local == Box::of(view.shape)) {
      init_box(ps, seed, pieces[0].global, local);
    } else {
      for (const ShardPiece& pc : pieces) {
        piece.resize(size_t(pc.global.volume()));
        init_box(ps, seed, pc.global, piece.data());
        unpack_box(piece.data(), pc.local, local, view.shape, sizeof(float));
      }
    }
    if (!host) backend_.copy_from_host(dst, staging.data(), staging.size() * sizeof(float));
  }
}

void Transformer::zero_grad() {
  backend_.memset_zero(grads_, size_t(num_params_) * sizeof(float));
}

// ---- stage boundary views -----------------------------------------------------------------------

Tensor Transformer::logits(int slot) const {
  TESSEL_CHECK(stage_.has_head, InvalidArgumentError, "this pipeline stage has no head/logits");
  check_slot(slot);
  return Tensor::wrap(slots_[size_t(slot)].g.logits, Shape{B_, T_, local_.Vp});
}

const float* Transformer::stage_output() const {
  return acts_->empty() ? a_.x0 : acts_->back().res3;
}

Tensor Transformer::input_hidden(int slot) const {
  check_slot(slot);
  return Tensor::wrap(slots_[size_t(slot)].g.x0, Shape{B_, T_, config_.n_embd});
}
Tensor Transformer::output_hidden(int slot) const {
  check_slot(slot);
  const Slot& sl = slots_[size_t(slot)];
  float* out = sl.acts.empty() ? sl.g.x0 : sl.acts.back().res3;
  return Tensor::wrap(out, Shape{B_, T_, config_.n_embd});
}
Tensor Transformer::output_grad(int slot) const {
  check_slot(slot);
  return Tensor::wrap(a_.dres, Shape{B_, T_, config_.n_embd});
}
Tensor Transformer::input_grad(int slot) const {
  return output_grad(slot);
}

// ---- forward ------------------------------------------------------------------------------------

void Transformer::check_ids(const int32_t* ids, bool targets) const {
  const int64_t n = int64_t(B_) * T_;
  const int V = config_.vocab_size;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if ((id >= 0 && id < V) || (targets && id == kIgnoreIndex)) continue;
    TESSEL_THROW(InvalidArgumentError,
                 "{} id {} at position {} (batch {}, time {}) is outside the vocabulary [0, {}){}",
                 targets ? "target" : "token", id, i, i / T_, i % T_, V,
                 targets ? " and is not the ignore index -1" : "");
  }
}

CrossEntropyResult Transformer::forward_stage(const int32_t* tokens, const int32_t* targets,
                                              std::optional<float> grad_scale, int slot) {
  const int N = B_ * T_, C = config_.n_embd, Vp = local_.Vp;
  const bool gpt2 = config_.family == Family::gpt2;
  select_slot(slot);
  TESSEL_CHECK(!slots_[size_t(cur_)].weight_pending, InvalidArgumentError,
               "forward_stage() on activation slot {}, whose backward_weight_stage() has not run: "
               "the slot holds what that weight pass reads and is free again after it",
               slot);
  slots_[size_t(cur_)].forward_ready = slots_[size_t(cur_)].dlogits_ready = false;
  // Validate every input before running anything.
  const bool loss = stage_.has_head && targets != nullptr;
  if (stage_.has_embedding) {
    TESSEL_CHECK(tokens != nullptr, InvalidArgumentError,
                 "the first stage needs tokens; got a null pointer");
    check_ids(tokens, false);
  }
  TESSEL_CHECK(!stage_.has_head || targets != nullptr || !grad_scale, InvalidArgumentError,
               "a forward for backward needs targets; got a null pointer");
  if (loss) check_ids(targets, true);

  if (stage_.has_embedding) {
    backend_.copy_from_host(tokens_, tokens, size_t(N) * sizeof(int32_t));
    // Vocabulary-parallel: each rank looks up the tokens of its vocabulary rows (zero rows for
    // the others) and the sum over ranks is the embedding; rank 0 alone adds the positions so
    // that the sum counts them once.
    const float* wpe = tp_rank() == 0 ? p(wpe_off_) : nullptr;
    backend_.embedding_forward(a_.x0, tokens_, p(wte_off_), wpe, B_, T_, C, local_.vocab_start, Vp);
    tp_sum(a_.x0, int64_t(N) * C);
  }
  const float* x = a_.x0;
  for (int l = 0; l < stage_.num_layers(); ++l) {
    block_forward(l, x);
    x = (*acts_)[size_t(l)].res3;
  }
  CrossEntropyResult result;
  if (stage_.has_head) {
    if (layer_hook_) layer_hook_();
    if (gpt2) {
      backend_.layernorm_forward(a_.lnf, a_.lnf_mean, a_.lnf_rstd, x, p(lnf_w_off_), p(lnf_b_off_),
                                 N, C, config_.norm_eps);
    } else {
      backend_.rmsnorm_forward(a_.lnf, a_.lnf_rstd, x, p(lnf_w_off_), N, C, config_.norm_eps);
    }
    linear_forward(a_.logits, a_.lnf, p(head_off_), nullptr, N, C, Vp);
    if (loss) {
      backend_.copy_from_host(targets_, targets, size_t(N) * sizeof(int32_t));
      // With a grad_scale, dlogits overwrite the logits in place: backward needs no [N, Vp]
      // buffer of its own.
      float* dlogits = grad_scale ? a_.logits : nullptr;
      if (tp_ != nullptr) {
        result = vocab_parallel_loss(dlogits, grad_scale.value_or(0.0f));
      } else {
        result =
            backend_.cross_entropy(dlogits, a_.losses, a_.logits, targets_, N, config_.vocab_size,
                                   Vp, kIgnoreIndex, grad_scale.value_or(0.0f));
      }
      slots_[size_t(cur_)].dlogits_ready = grad_scale.has_value();
    }
  }
  slots_[size_t(cur_)].forward_ready = true;
  return result;
}

// The softmax over the whole vocabulary from this rank's logit columns: a max and a sum
// all-reduce between the local steps (vocab_parallel_ce.h). Every rank gets the same loss.
CrossEntropyResult Transformer::vocab_parallel_loss(float* dlogits, float grad_scale) {
  const int N = B_ * T_, V = config_.vocab_size;
  backend_.vp_ce_local_max(a_.ce_max, a_.logits, targets_, N, V, local_.vocab_start, local_.Vp,
                           kIgnoreIndex);
  tp_->all_reduce_max(a_.ce_max, size_t(N));
  backend_.vp_ce_local_sums(a_.ce_sums, a_.logits, a_.ce_max, targets_, N, V, local_.vocab_start,
                            local_.Vp, kIgnoreIndex);
  tp_->all_reduce_sum(a_.ce_sums, 2 * size_t(N));
  return backend_.vp_ce_finish(dlogits, a_.losses, a_.logits, a_.ce_max, a_.ce_sums, targets_, N, V,
                               local_.vocab_start, local_.Vp, kIgnoreIndex, grad_scale);
}

void Transformer::tp_sum(float* data, int64_t n) {
  if (tp_ != nullptr) tp_->all_reduce_sum(data, size_t(n));
}

void Transformer::block_forward(int l, const float* x) {
  if (layer_hook_) layer_hook_();
  if (config_.family == Family::gpt2) {
    gpt2_block_forward(l, x);
  } else {
    llama_block_forward(l, x);
  }
}

void Transformer::block_backward(int l, const float* x, Pass pass) {
  if (layer_hook_) layer_hook_();
  const bool gpt2 = config_.family == Family::gpt2;
  // Full recomputation: the block's activations were not kept (their buffers are shared by all
  // blocks and slots); the forward again from the saved input refills them with the same kernels
  // on the same inputs, hence the same bits, collectives included (every tp rank runs the same
  // backward, so every rank recomputes in the same order). It rewrites the block's saved output
  // (and, with split backward, the inputs of its linears, kept per slot) with identical values.
  // A weight pass reads only what is kept per slot, so it recomputes nothing.
  if (recompute_ == Recompute::full && pass != Pass::weight) {
    if (gpt2) {
      gpt2_block_forward(l, x);
    } else {
      llama_block_forward(l, x);
    }
  }
  if (gpt2) {
    gpt2_block_backward(l, x, pass);
  } else {
    llama_block_backward(l, x, pass);
  }
}

CrossEntropyResult Transformer::forward(const int32_t* tokens, const int32_t* targets) {
  TESSEL_CHECK(stage_.has_embedding && stage_.has_head, InvalidArgumentError,
               "forward() runs a whole model; this is the stage of layers [{}, {}): use "
               "forward_stage()",
               stage_.layer_begin, stage_.layer_end);
  return forward_stage(tokens, targets);
}

CrossEntropyResult Transformer::forward_backward(const int32_t* tokens, const int32_t* targets,
                                                 float grad_scale) {
  TESSEL_CHECK(stage_.has_embedding && stage_.has_head, InvalidArgumentError,
               "forward_backward() runs a whole model; this is the stage of layers [{}, {}): use "
               "forward_stage() and backward_stage()",
               stage_.layer_begin, stage_.layer_end);
  TESSEL_CHECK(targets != nullptr, InvalidArgumentError,
               "forward_backward needs targets; got a null pointer");
  CrossEntropyResult r = forward_stage(tokens, targets, grad_scale);
  backward_stage();
  return r;
}

// ---- backward -----------------------------------------------------------------------------------

// The halves of a backward (Pass) interleave as backward_stage runs them, so that Pass::both is
// exactly the fused backward; a weight-gradient kernel reads the same operands in either case.
void Transformer::head_backward(Pass pass) {
  if (layer_hook_) layer_hook_();
  const int N = B_ * T_, C = config_.n_embd, Vp = local_.Vp;
  const size_t nc_bytes = size_t(N) * size_t(C) * sizeof(float);
  const bool input = pass != Pass::weight, weight = pass != Pass::input;
  // The final norm's weight gradients: into the gradients, or (split) kept in the slot.
  float* dnorm_w = pass == Pass::both ? g(lnf_w_off_) : a_.dlnf;
  float* dnorm_b = lnf_b_off_ < 0 ? nullptr : pass == Pass::both ? g(lnf_b_off_) : a_.dlnf + C;
  if (input) {
    if (pass == Pass::input) {
      backend_.memset_zero(a_.dlnf, size_t(lnf_b_off_ < 0 ? C : 2 * C) * sizeof(float));
    }
    backend_.memset_zero(a_.dln, nc_bytes);
    // The head is column-parallel over the vocabulary: its input gradient is summed over ranks.
    linear_backward_input(a_.dln, a_.logits, p(head_off_), N, C, Vp);
    tp_sum(a_.dln, int64_t(N) * C);
  }
  // dlogits stay in the slot's logits buffer until the slot's next forward.
  if (weight) linear_backward_weight(g(head_off_), nullptr, a_.logits, a_.lnf, N, C, Vp);
  if (input) {
    backend_.memset_zero(a_.dres, nc_bytes);
    if (config_.family == Family::gpt2) {
      backend_.layernorm_backward(a_.dres, dnorm_w, dnorm_b, a_.dln, stage_output(), p(lnf_w_off_),
                                  a_.lnf_mean, a_.lnf_rstd, N, C);
    } else {
      backend_.rmsnorm_backward(a_.dres, dnorm_w, a_.dln, stage_output(), p(lnf_w_off_),
                                a_.lnf_rstd, N, C);
    }
  }
  if (pass == Pass::weight) {
    add_norm_grad(lnf_w_off_, a_.dlnf);
    if (lnf_b_off_ >= 0) add_norm_grad(lnf_b_off_, a_.dlnf + C);
  }
}

// A norm kernel adds its weight gradient, one complete sum per element, to what dweight holds:
// the gradient itself (backward_stage: g + s) or a zeroed buffer of the slot (Bi: 0 + s, which
// is s), which Bw adds to the gradient (g + s again). The two differ only when s is -0 and g is
// -0, and g never is: it starts at +0 (zero_grad) and a sum is -0 only when both terms are.
void Transformer::add_norm_grad(int64_t off, const float* partial) {
  if (off < 0) return;
  backend_.residual_forward(g(off), g(off), partial, config_.n_embd);
}

void Transformer::copy_floats(float* dst, const float* src, int64_t n) {
  const size_t bytes = size_t(n) * sizeof(float);
  if (backend_.device() == kernels::DeviceKind::cpu) {
    // Backend memory is host memory.
    backend_.copy_from_host(dst, src, bytes);
    return;
  }
  // A device backend has no device-to-device copy yet: through the host (copy_staging_ is sized
  // for the largest copy, [N, C]).
  TESSEL_CHECK(size_t(n) <= copy_staging_.size(), Error,
               "internal: a copy of {} floats exceeds the staging buffer of {}", n,
               copy_staging_.size());
  backend_.copy_to_host(copy_staging_.data(), src, bytes);
  backend_.copy_from_host(dst, copy_staging_.data(), bytes);
}

Transformer::BlockGrads Transformer::block_grads(int l, Pass pass) const {
  const std::vector<int64_t>& o = layer_off_[size_t(l)];
  constexpr LayerParam kNorms[4] = {LayerParam::norm1_weight, LayerParam::norm1_bias,
                                    LayerParam::norm2_weight, LayerParam::norm2_bias};
  BlockGrads b;
  if (pass == Pass::both) {
    b.dout = b.dmid = a_.dres;
    b.d0 = a_.df0;
    b.d1 = a_.df1;
    b.dqkv = a_.dqkv;
    for (int i = 0; i < 4; ++i) b.norm[i] = g(o[size_t(kNorms[i])]);
    return b;
  }
  const LayerGrads& lg = slots_[size_t(cur_)].grads[size_t(l)];
  b.dout = lg.dout;
  b.dmid = lg.dmid;
  b.d0 = lg.d0;
  b.d1 = lg.d1;
  b.dqkv = lg.dqkv;
  int64_t at = 0;
  for (int i = 0; i < 4; ++i) {
    if (o[size_t(kNorms[i])] < 0) continue;
    b.norm[i] = lg.dnorm + at;
    at += config_.n_embd;
  }
  return b;
}

void Transformer::rebind_tp_group(TpGroup* tp) {
  const int size = tp != nullptr ? tp->size() : 1, rank = tp != nullptr ? tp->rank() : 0;
  TESSEL_CHECK(size == tp_size() && rank == tp_rank(), InvalidArgumentError,
               "rebind_tp_group: the model is rank {} of {} tensor-parallel ranks, the new group "
               "makes it rank {} of {}",
               tp_rank(), tp_size(), rank, size);
  tp_ = size > 1 ? tp : nullptr;
}

void Transformer::check_backward_ready(const char* what) {
  Slot& sl = slots_[size_t(cur_)];
  TESSEL_CHECK(sl.forward_ready, InvalidArgumentError,
               "{}() needs a forward_stage() first (one backward per forward)", what);
  TESSEL_CHECK(!stage_.has_head || sl.dlogits_ready, InvalidArgumentError,
               "the head stage's backward needs forward_stage() with targets and a grad_scale");
  sl.forward_ready = sl.dlogits_ready = false;
}

void Transformer::backward_stage(int slot, const GradsReady& grads_ready) {
  if (split_) {
    backward_input_stage(slot);
    backward_weight_stage(slot, grads_ready);
    return;
  }
  select_slot(slot);
  check_backward_ready("backward_stage");
  stage_backward(Pass::both, grads_ready);
}

void Transformer::backward_input_stage(int slot) {
  TESSEL_CHECK(split_, InvalidArgumentError,
               "backward_input_stage() needs a model built for split backward: call "
               "set_split_backward(true) first");
  select_slot(slot);
  check_backward_ready("backward_input_stage");
  stage_backward(Pass::input, {});
  slots_[size_t(cur_)].weight_pending = true;
}

void Transformer::backward_weight_stage(int slot, const GradsReady& grads_ready) {
  TESSEL_CHECK(split_, InvalidArgumentError,
               "backward_weight_stage() needs a model built for split backward: call "
               "set_split_backward(true) first");
  select_slot(slot);
  Slot& sl = slots_[size_t(cur_)];
  TESSEL_CHECK(sl.weight_pending, InvalidArgumentError,
               "backward_weight_stage() on activation slot {} needs its backward_input_stage() "
               "first (one weight pass per input pass)",
               slot);
  sl.weight_pending = false;
  stage_backward(Pass::weight, grads_ready);
}

bool Transformer::weight_pass_pending(int slot) const {
  check_slot(slot);
  return slots_[size_t(slot)].weight_pending;
}

void Transformer::stage_backward(Pass pass, const GradsReady& grads_ready) {
  // The first parameter of block l (parameters are in forward order, so block l's are
  // [block_begin(l), block_begin(l + 1))).
  auto block_begin = [&](int l) {
    int64_t lo = num_params_;
    for (int64_t off : layer_off_[size_t(l)])
      if (off >= 0) lo = std::min(lo, off);
    return lo;
  };
  // Gradients are complete only after the weight half.
  const GradsReady* ready = pass != Pass::input && grads_ready ? &grads_ready : nullptr;
  if (stage_.has_head) {
    head_backward(pass);
    // The final norm and an untied head are the last parameters; a tied head's gradient goes
    // into the token embedding at offset 0, which is only reported at the end.
    if (ready) (*ready)(lnf_w_off_);
  }
  // dres now holds d(stage output); each block's input half turns it into d(block input) in
  // place (a weight half reads the slot's copies instead).
  for (int l = stage_.num_layers() - 1; l >= 0; --l) {
    block_backward(l, l == 0 ? a_.x0 : (*acts_)[size_t(l - 1)].res3, pass);
    if (ready && l > 0) (*ready)(block_begin(l));
  }
  if (stage_.has_embedding) {
    // Split: d(x0) is kept for the weight pass (dres is scratch the next backward overwrites).
    if (pass == Pass::input) copy_floats(a_.demb, a_.dres, int64_t(B_) * T_ * config_.n_embd);
    // d(x0) is the same on every rank, so every rank's position gradient is the full one.
    if (pass != Pass::input) {
      backend_.embedding_backward(g(wte_off_), g(wpe_off_), pass == Pass::both ? a_.dres : a_.demb,
                                  tokens_, B_, T_, config_.n_embd, local_.vocab_start, local_.Vp);
    }
  }
  if (ready) (*ready)(0);
}

// ---- GPT-2 block --------------------------------------------------------------------------------
// x += attn.c_proj(attention(c_attn(ln_1(x)))); x += mlp.c_proj(gelu(c_fc(ln_2(x))))
// With tensor parallelism (local sizes: H heads of width D, CH = H D, F features): c_attn and
// c_fc are column-parallel, attention runs on the rank's heads, attn.c_proj and mlp.c_proj are
// row-parallel (output summed over ranks, bias added by rank 0).

void Transformer::gpt2_block_forward(int l, const float* x) {
  const int N = B_ * T_, C = config_.n_embd, F = local_.F, H = local_.Hq;
  const int D = config_.head_dim(), CH = H * D;
  const std::vector<int64_t>& o = layer_off_[size_t(l)];
  auto w = [&](LayerParam k) { return p(o[size_t(k)]); };
  // A row-parallel bias enters the sum over ranks once.
  auto row_bias = [&](LayerParam k) { return tp_rank() == 0 ? w(k) : nullptr; };
  LayerActs& a = (*acts_)[size_t(l)];
  using LP = LayerParam;
  backend_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w(LP::norm1_weight),
                             w(LP::norm1_bias), N, C, config_.norm_eps);
  linear_forward(a.qkv, a.ln1, w(LP::qkv_weight), w(LP::qkv_bias), N, C, 3 * CH);
  // q, k and v are read straight out of the fused [N, 3 CH] buffer.
  backend_.attention_forward(a.atty, a.probs, a.qkv, a.qkv + CH, a.qkv + 2 * CH, B_, T_, H, H, D,
                             3 * CH, 3 * CH);
  linear_forward(a_.proj, a.atty, w(LP::attn_out_weight), row_bias(LP::attn_out_bias), N, CH, C);
  tp_sum(a_.proj, int64_t(N) * C);
  backend_.residual_forward(a.res2, x, a_.proj, int64_t(N) * C);
  backend_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w(LP::norm2_weight),
                             w(LP::norm2_bias), N, C, config_.norm_eps);
  linear_forward(a.fc, a.ln2, w(LP::mlp_in_weight), w(LP::mlp_in_bias), N, C, F);
  backend_.gelu_forward(a.act, a.fc, int64_t(N) * F);
  linear_forward(a_.proj, a.act, w(LP::mlp_out_weight), row_bias(LP::mlp_out_bias), N, F, C);
  tp_sum(a_.proj, int64_t(N) * C);
  backend_.residual_forward(a.res3, a.res2, a_.proj, int64_t(N) * C);
}

// On entry dres = d(block output). The residual adds pass the gradient through unchanged, so
// the branch gradients are accumulated into dres directly (the norms' dinp), leaving
// d(block input) there. dres is the same on every tp rank; the input gradients of the
// column-parallel linears are partial per rank and summed before each norm's backward.
// Split backward: the input pass copies d(block output) and d(res2) out of dres and writes the
// other output gradients straight into the slot (block_grads), where the weight pass reads them.
void Transformer::gpt2_block_backward(int l, const float* x, Pass pass) {
  const int N = B_ * T_, C = config_.n_embd, F = local_.F, H = local_.Hq;
  const int D = config_.head_dim(), CH = H * D;
  const std::vector<int64_t>& o = layer_off_[size_t(l)];
  auto w = [&](LayerParam k) { return p(o[size_t(k)]); };
  auto dw = [&](LayerParam k) { return g(o[size_t(k)]); };
  const LayerActs& a = (*acts_)[size_t(l)];
  using LP = LayerParam;
  const size_t nc = size_t(N) * size_t(C) * sizeof(float);
  const size_t nf = size_t(N) * size_t(F) * sizeof(float);
  const bool input = pass != Pass::weight, weight = pass != Pass::input;
  const BlockGrads bg = block_grads(l, pass);
  float* dact = a_.df1;
  float* dfc = bg.d0;
  float* dqkv = bg.dqkv;

  // MLP. A row-parallel bias's gradient is computed on every rank (dres is replicated).
  if (input) {
    if (pass == Pass::input) {
      copy_floats(bg.dout, a_.dres, int64_t(N) * C);
      const LayerGrads& lg = slots_[size_t(cur_)].grads[size_t(l)];
      backend_.memset_zero(lg.dnorm, size_t(bg.norm[1] ? 4 : 2) * size_t(C) * sizeof(float));
    }
    backend_.memset_zero(dact, nf);
    linear_backward_input(dact, a_.dres, w(LP::mlp_out_weight), N, F, C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::mlp_out_weight), dw(LP::mlp_out_bias), bg.dout, a.act, N, F, C);
  }
  if (input) {
    backend_.memset_zero(dfc, nf);
    backend_.gelu_backward(dfc, a.fc, dact, int64_t(N) * F);
    backend_.memset_zero(a_.dln, nc);
    linear_backward_input(a_.dln, dfc, w(LP::mlp_in_weight), N, C, F);
    tp_sum(a_.dln, int64_t(N) * C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::mlp_in_weight), dw(LP::mlp_in_bias), dfc, a.ln2, N, C, F);
  }
  if (input) {
    backend_.layernorm_backward(a_.dres, bg.norm[2], bg.norm[3], a_.dln, a.res2,
                                w(LP::norm2_weight), a.ln2_mean, a.ln2_rstd, N, C);
    if (pass == Pass::input) copy_floats(bg.dmid, a_.dres, int64_t(N) * C);
    // attention. Selective recomputation: the probabilities (one buffer shared by all blocks and
    // slots) come again from the saved q and k by the forward's kernel; its output goes to datty,
    // overwritten right after.
    if (recompute_ == Recompute::selective) {
      backend_.attention_forward(a_.datty, a.probs, a.qkv, a.qkv + CH, a.qkv + 2 * CH, B_, T_, H, H,
                                 D, 3 * CH, 3 * CH);
    }
    backend_.memset_zero(a_.datty, size_t(N) * size_t(CH) * sizeof(float));
    linear_backward_input(a_.datty, a_.dres, w(LP::attn_out_weight), N, CH, C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::attn_out_weight), dw(LP::attn_out_bias), bg.dmid, a.atty, N, CH,
                           C);
  }
  if (input) {
    backend_.memset_zero(dqkv, size_t(N) * 3 * size_t(CH) * sizeof(float));
    backend_.attention_backward(dqkv, dqkv + CH, dqkv + 2 * CH, a_.datty, a.probs, a.qkv,
                                a.qkv + CH, a.qkv + 2 * CH, B_, T_, H, H, D, 3 * CH, 3 * CH);
    backend_.memset_zero(a_.dln, nc);
    linear_backward_input(a_.dln, dqkv, w(LP::qkv_weight), N, C, 3 * CH);
    tp_sum(a_.dln, int64_t(N) * C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::qkv_weight), dw(LP::qkv_bias), dqkv, a.ln1, N, C, 3 * CH);
  }
  if (input) {
    backend_.layernorm_backward(a_.dres, bg.norm[0], bg.norm[1], a_.dln, x, w(LP::norm1_weight),
                                a.ln1_mean, a.ln1_rstd, N, C);
  }
  if (pass == Pass::weight) {
    add_norm_grad(o[size_t(LP::norm1_weight)], bg.norm[0]);
    add_norm_grad(o[size_t(LP::norm1_bias)], bg.norm[1]);
    add_norm_grad(o[size_t(LP::norm2_weight)], bg.norm[2]);
    add_norm_grad(o[size_t(LP::norm2_bias)], bg.norm[3]);
  }
}

// ---- LLaMA block --------------------------------------------------------------------------------
// h = rmsnorm(x); x += o_proj(attention(rope(q(h)), rope(k(h)), v(h)));
// h = rmsnorm2(x); x += down(silu(gate(h)) * up(h))
// With tensor parallelism (local sizes): q, k, v, gate and up are column-parallel, o_proj and
// down row-parallel. RoPE depends only on position and dimension, never on the head index, so
// it runs unchanged on a rank's heads.

void Transformer::llama_block_forward(int l, const float* x) {
  const int N = B_ * T_, C = config_.n_embd, F = local_.F;
  const int Hq = local_.Hq, Hkv = local_.Hkv, D = config_.head_dim();
  const int QD = Hq * D, KD = Hkv * D;
  const float theta = config_.rope_theta;
  const std::vector<int64_t>& o = layer_off_[size_t(l)];
  auto w = [&](LayerParam k) { return p(o[size_t(k)]); };
  LayerActs& a = (*acts_)[size_t(l)];
  using LP = LayerParam;
  float* q = a.qkv;
  float* k = q + int64_t(N) * QD;
  float* v = k + int64_t(N) * KD;
  backend_.rmsnorm_forward(a.ln1, a.ln1_rstd, x, w(LP::norm1_weight), N, C, config_.norm_eps);
  linear_forward(q, a.ln1, w(LP::q_weight), nullptr, N, C, QD);
  linear_forward(k, a.ln1, w(LP::k_weight), nullptr, N, C, KD);
  linear_forward(v, a.ln1, w(LP::v_weight), nullptr, N, C, KD);
  // Rotated in place: backward needs the rotated q and k (attention's inputs), not the raw ones.
  backend_.rope_forward(q, B_, T_, Hq, D, QD, theta);
  backend_.rope_forward(k, B_, T_, Hkv, D, KD, theta);
  // The rank's Hq query heads use its Hkv kv heads in groups of Hq / Hkv, as globally: with split
  // kv heads both are contiguous blocks of the global heads; with a replicated kv head all of the
  // rank's query heads belong to that head's group.
  backend_.attention_forward(a.atty, a.probs, q, k, v, B_, T_, Hq, Hkv, D, QD, KD);
  linear_forward(a_.proj, a.atty, w(LP::attn_out_weight), nullptr, N, QD, C);
  tp_sum(a_.proj, int64_t(N) * C);
  backend_.residual_forward(a.res2, x, a_.proj, int64_t(N) * C);
  backend_.rmsnorm_forward(a.ln2, a.ln2_rstd, a.res2, w(LP::norm2_weight), N, C, config_.norm_eps);
  linear_forward(a.fc, a.ln2, w(LP::mlp_in_weight), nullptr, N, C, F);
  linear_forward(a.up, a.ln2, w(LP::mlp_up_weight), nullptr, N, C, F);
  backend_.swiglu_forward(a.act, a.fc, a.up, int64_t(N) * F);
  linear_forward(a_.proj, a.act, w(LP::mlp_out_weight), nullptr, N, F, C);
  tp_sum(a_.proj, int64_t(N) * C);
  backend_.residual_forward(a.res3, a.res2, a_.proj, int64_t(N) * C);
}

void Transformer::llama_block_backward(int l, const float* x, Pass pass) {
  const int N = B_ * T_, C = config_.n_embd, F = local_.F;
  const int Hq = local_.Hq, Hkv = local_.Hkv, D = config_.head_dim();
  const int QD = Hq * D, KD = Hkv * D;
  const float theta = config_.rope_theta;
  const std::vector<int64_t>& o = layer_off_[size_t(l)];
  auto w = [&](LayerParam k) { return p(o[size_t(k)]); };
  auto dw = [&](LayerParam k) { return g(o[size_t(k)]); };
  const LayerActs& a = (*acts_)[size_t(l)];
  using LP = LayerParam;
  const size_t nc = size_t(N) * size_t(C) * sizeof(float);
  const size_t nf = size_t(N) * size_t(F) * sizeof(float);
  const bool input = pass != Pass::weight, weight = pass != Pass::input;
  const BlockGrads bg = block_grads(l, pass);
  const float* q = a.qkv;
  const float* k = q + int64_t(N) * QD;
  const float* v = k + int64_t(N) * KD;
  float* dq = bg.dqkv;
  float* dk = dq + int64_t(N) * QD;
  float* dv = dk + int64_t(N) * KD;
  float* dact = a_.df2;
  float* dgate = bg.d0;
  float* dup = bg.d1;

  // MLP (split backward as in gpt2_block_backward)
  if (input) {
    if (pass == Pass::input) {
      copy_floats(bg.dout, a_.dres, int64_t(N) * C);
      const LayerGrads& lg = slots_[size_t(cur_)].grads[size_t(l)];
      backend_.memset_zero(lg.dnorm, 2 * size_t(C) * sizeof(float));
    }
    backend_.memset_zero(dact, nf);
    linear_backward_input(dact, a_.dres, w(LP::mlp_out_weight), N, F, C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::mlp_out_weight), nullptr, bg.dout, a.act, N, F, C);
  }
  if (input) {
    backend_.memset_zero(dgate, nf);
    backend_.memset_zero(dup, nf);
    backend_.swiglu_backward(dgate, dup, dact, a.fc, a.up, int64_t(N) * F);
    backend_.memset_zero(a_.dln, nc);
    linear_backward_input(a_.dln, dgate, w(LP::mlp_in_weight), N, C, F);
    linear_backward_input(a_.dln, dup, w(LP::mlp_up_weight), N, C, F);
    tp_sum(a_.dln, int64_t(N) * C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::mlp_in_weight), nullptr, dgate, a.ln2, N, C, F);
    linear_backward_weight(dw(LP::mlp_up_weight), nullptr, dup, a.ln2, N, C, F);
  }
  if (input) {
    backend_.rmsnorm_backward(a_.dres, bg.norm[2], a_.dln, a.res2, w(LP::norm2_weight), a.ln2_rstd,
                              N, C);
    if (pass == Pass::input) copy_floats(bg.dmid, a_.dres, int64_t(N) * C);
    // attention (selective recomputation as in gpt2_block_backward)
    if (recompute_ == Recompute::selective) {
      backend_.attention_forward(a_.datty, a.probs, q, k, v, B_, T_, Hq, Hkv, D, QD, KD);
    }
    backend_.memset_zero(a_.datty, size_t(N) * size_t(QD) * sizeof(float));
    linear_backward_input(a_.datty, a_.dres, w(LP::attn_out_weight), N, QD, C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::attn_out_weight), nullptr, bg.dmid, a.atty, N, QD, C);
  }
  if (input) {
    backend_.memset_zero(dq, size_t(N) * size_t(QD + 2 * KD) * sizeof(float));
    backend_.attention_backward(dq, dk, dv, a_.datty, a.probs, q, k, v, B_, T_, Hq, Hkv, D, QD, KD);
    backend_.rope_backward(dq, B_, T_, Hq, D, QD, theta);
    backend_.rope_backward(dk, B_, T_, Hkv, D, KD, theta);
    // dk and dv hold this rank's query heads' share of its kv heads' gradients; that is all of it
    // when kv heads are split, and a part when a kv head is replicated -- in both cases the input
    // gradient through k and v is then a per-rank partial sum like the one through q.
    backend_.memset_zero(a_.dln, nc);
    linear_backward_input(a_.dln, dq, w(LP::q_weight), N, C, QD);
    linear_backward_input(a_.dln, dk, w(LP::k_weight), N, C, KD);
    linear_backward_input(a_.dln, dv, w(LP::v_weight), N, C, KD);
    tp_sum(a_.dln, int64_t(N) * C);
  }
  if (weight) {
    linear_backward_weight(dw(LP::q_weight), nullptr, dq, a.ln1, N, C, QD);
    if (local_.kv_replicated) {
      // A replicated kv head's weight gradient is the sum of the shares of the ranks holding it.
      // Each rank writes its share into its head's rows of a zeroed [Hkv D, C] staging buffer
      // (one for k, one for v) and one all-reduce over the whole group sums every head's shares
      // (rows of heads a rank does not hold stay zero there). Every holder then adds the same
      // full gradient, so the copies stay identical. Staged per backward, not accumulated:
      // summing the accumulated gradient buffer itself would count earlier micro-batches tp
      // times.
      const int64_t head_rows = int64_t(config_.n_kv_head) * D * C;
      float* stage_k = a_.kv_stage;
      float* stage_v = a_.kv_stage + head_rows;
      const int64_t mine = int64_t(local_.kv_begin) * D * C;
      backend_.memset_zero(a_.kv_stage, 2 * size_t(head_rows) * sizeof(float));
      linear_backward_weight(stage_k + mine, nullptr, dk, a.ln1, N, C, KD);
      linear_backward_weight(stage_v + mine, nullptr, dv, a.ln1, N, C, KD);
      tp_sum(a_.kv_stage, 2 * head_rows);
      backend_.residual_forward(dw(LP::k_weight), dw(LP::k_weight), stage_k + mine,
                                int64_t(KD) * C);
      backend_.residual_forward(dw(LP::v_weight), dw(LP::v_weight), stage_v + mine,
                                int64_t(KD) * C);
    } else {
      linear_backward_weight(dw(LP::k_weight), nullptr, dk, a.ln1, N, C, KD);
      linear_backward_weight(dw(LP::v_weight), nullptr, dv, a.ln1, N, C, KD);
    }
  }
  if (input) {
    backend_.rmsnorm_backward(a_.dres, bg.norm[0], a_.dln, x, w(LP::norm1_weight), a.ln1_rstd, N,
                              C);
  }
  if (pass == Pass::weight) {
    add_norm_grad(o[size_t(LP::norm1_weight)], bg.norm[0]);
    add_norm_grad(o[size_t(LP::norm2_weight)], bg.norm[2]);
  }
}

}  // namespace tessel::model
