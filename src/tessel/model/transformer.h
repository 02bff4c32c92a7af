// Transformer: a GPT-2 or LLaMA decoder (or one pipeline stage of one) with forward and backward.
//
// One class serves both families; ModelConfig::family selects LayerNorm vs RMSNorm, GELU MLP vs
// SwiGLU, biases, learned positions vs RoPE, and the tied head. Every op runs through the
// kernels::Backend given at construction, so the same code drives the CPU kernels, the reference
// kernels and (later) a GPU.
//
// Memory (all from the backend's allocator, all allocated and touched at construction; forward
// and backward allocate nothing):
// - parameters: ONE contiguous float buffer in ModelSpec order (this stage's parameters only);
//   gradients: a second buffer of the same layout. param(name) / grad(name) are views into them.
// - activations, llm.c style: per block, what its backward needs (norm outputs and statistics,
//   QKV, attention output and probabilities, residual stream, MLP pre-/post-activation); plus
//   the final norm and the [B, T, Vp] logits, which backward overwrites with dlogits in place.
//   With activation_slots = S > 1 all of this (and the stage input buffer and token ids) exists S
//   times: slot s holds the saved activations of one micro-batch, so a pipeline schedule can run
//   forwards of several micro-batches before their backwards without recomputation.
// - ONE set of activation-gradient scratch buffers shared by all blocks during backward.
// - Activation recomputation (recompute.h, chosen at construction) keeps less per slot. In floats
//   (N = B T; with tensor parallelism Hq, Hkv, F are per rank), a block's activations are its
//   output O = N C (the next block's input), its attention probabilities P = B Hq T^2, and the
//   rest A = N (3C + (Hq + 2 Hkv) D + Hq D + 2F + 4) for gpt2, N (3C + (Hq + 2 Hkv) D + Hq D +
//   3F + 2) for llama (at tp = 1: N (7C + 2F + 4) and N (5C + 2 Hkv D + 3F + 2)). Per block and
//   slot the model keeps
//     none: O + A + P;   selective: O + A, and P once;   full: O, and A + P once
//   (once: one buffer shared by every block and slot). Each buffer is rounded up to 64 bytes.
//   On top of that every slot holds the stage input x0 (N C) and, on the head stage, the final
//   norm (N C + 2N for gpt2, N C + N for llama), the logits (N Vp / tp), the losses (N) and, with
//   tp > 1, the loss statistics (3N); the scratch is proj, dres, dln (3 N C) plus, with blocks,
//   datty (N Hq D), dqkv (N (Hq + 2 Hkv) D), 2F N (gpt2) or 3F N (llama), and 2 n_kv_head D C
//   for replicated kv heads.
// - Split backward (set_split_backward(true); zero-bubble schedules run backward_input_stage and
//   backward_weight_stage instead of backward_stage) also keeps, per block and slot, what the
//   weight pass reads after the input pass returned: the output gradients of the block's linears
//   -- d(block output) and d(residual after attention) (N C each), dqkv (N (Hq + 2 Hkv) D), and
//   d(c_fc) (N F, gpt2) or d(gate), d(up) (2 N F, llama) -- and the block's norms' weight
//   gradients (one buffer, one float per norm parameter: 4C for gpt2 with biases, else 2C):
//     G = N (2C + (Hq + 2 Hkv) D + F) + 4C (gpt2),  N (2C + (Hq + 2 Hkv) D + 2F) + 2C (llama).
//   Under full recomputation the inputs of the block's linears, X = N (2C + Hq D + F) (both norm
//   outputs, the attention output, the MLP activation), leave the shared buffer and are kept per
//   block and slot: full keeps O + X + G per block and slot, and A - X + P once. Per slot the head
//   stage adds the final norm's weight gradients (2C for gpt2 with biases, else C) and the first
//   stage d(x0) (N C, the embedding's weight pass input). The scratch then holds no dqkv and, of
//   the MLP gradients, only d(activation) (N F). Per block and slot at tp = 1: G = N (5C + F) + 4C
//   for gpt2, N (3C + 2 Hkv D + 2F) + 2C for llama.
//   activation_bytes() is exactly the sum of all of the above.
//
// Numerics follow the kernels: the loss is summed per valid token; forward_backward seeds
// dlogits with (softmax - onehot) * grad_scale, so passing 1 / (valid tokens in the global batch)
// to every micro-batch gives the gradient of the global mean loss. Gradients accumulate across
// forward_backward calls until zero_grad().
//
// Tensor parallelism (Megatron-LM). Given a TpGroup of size tp > 1, the model holds only its
// rank's shard of every parameter (tp_shard.h: column / row / vocab / per-head splits; norms,
// positions and row-parallel biases replicated) and inserts the Megatron f/g collectives:
// column-parallel linears (c_attn, q/k/v, c_fc, gate/up, and the head over the vocabulary) take a
// replicated input and all-reduce its gradient in backward; row-parallel linears (attention
// output, MLP output) all-reduce their output in forward, their bias added by rank 0 only. The
// token embedding is vocabulary-parallel (each rank looks up its vocabulary range, the sum over
// ranks is the embedding; positions added once, by rank 0), and the loss is the vocabulary-
// parallel cross-entropy (vocab_parallel_ce.h), so the full [N, Vp] logits never exist on one
// rank. With GQA, kv heads are split when tp divides n_kv_head and replicated otherwise (each rank
// holds the kv head its query heads use); a replicated kv head's gradient is the sum of the
// contributions of the ranks sharing it, formed by an all-reduce of a zero-padded [Hkv D, C]
// staging buffer in every backward. Everything between the collectives -- the residual stream,
// norms, the stage boundary buffers, the loss, every replicated parameter's gradient -- is
// bit-identical on all ranks of the group, given a TpGroup whose results are identical on every
// rank (its contract): replicated parameters stay in sync under identical optimizer updates.
// Per-rank views: param_views(), param(), grad() and logits() are the rank's local shards (logits
// [B, T, Vp / tp], columns [vocab_start, +Vp / tp) of the vocabulary); spec() still describes the
// whole (stage) model with global shapes. A group of size 1 (or none) is plain single-rank
// execution. All ranks of the group must make the same calls in the same order (every collective
// is unconditional) with the same tokens and targets.
//
// Host/device: tokens and targets are host arrays, copied to backend memory. Tensors returned by
// param/grad/logits/... are views of backend memory (host-readable on CPU backends only) that do
// not own it: they are valid while the model lives.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/kernels/backend.h"
#include "tessel/model/model_config.h"
#include "tessel/model/model_spec.h"
#include "tessel/model/recompute.h"
#include "tessel/model/stage_range.h"
#include "tessel/model/tp_group.h"
#include "tessel/tensor/tensor.h"

namespace tessel::model {

// Where one parameter lives in the flat parameter / gradient buffers (offsets in floats).
struct ParamView {
  std::string name;
  Shape shape;  // this rank's shard (the whole tensor without tensor parallelism)
  int64_t offset = 0;
  int64_t numel = 0;
  bool weight_decay = false;
  // Tensor parallelism: how many tp ranks hold a copy of each element of this shard (1 for split
  // tensors), and whether this rank's copy is the primary one -- the one to count once in a global
  // gradient norm or to write to a checkpoint (tp_shard.h).
  int tp_copies = 1;
  bool tp_primary = true;
};

class Transformer {
 public:
  static constexpr int kIgnoreIndex = -1;

  // Builds the model (or the stage `stage` of it) for micro-batches of B sequences of T tokens.
  // Throws ConfigError for an invalid config/stage or T outside [1, max_seq_len],
  // UnsupportedError when the backend lacks an op the family needs. Parameters and gradients
  // start at zero (call init() or write the parameters). The backend must outlive the
  // model. `tp`, when not null, is this rank's tensor-parallel group (see above); it must outlive
  // the model. Throws ConfigError when the model cannot be split tp ways (validate_tp).
  // `activation_slots` (>= 1, else ConfigError) is the number of micro-batches whose activations
  // can be held at once (see forward_stage / backward_stage).
  // `recompute` chooses which block activations are kept and which are recomputed in backward
  // (recompute.h); the results are bit-identical whichever it is.
  Transformer(const ModelConfig& config, kernels::Backend& backend, int B, int T,
              StageRange stage = {}, TpGroup* tp = nullptr, int activation_slots = 1,
              Recompute recompute = Recompute::none);
  ~Transformer() = default;
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return config_; }
  // This stage's parameters (the whole model's for the default stage).
  const ModelSpec& spec() const { return spec_; }
  const StageRange& stage() const { return stage_; }
  kernels::Backend& backend() const { return backend_; }
  int batch_size() const { return B_; }
  int seq_len() const { return T_; }
  int activation_slots() const { return int(slots_.size()); }
  Recompute recompute() const { return recompute_; }
  // The tensor-parallel group (null without tensor parallelism), this rank in it and its size.
  TpGroup* tp_group() const { return tp_; }
  // Moves the model to another tensor-parallel group with this rank's place in a group of the
  // same size (a new generation's communicators, after a live switch of plans that kept this
  // shard). Throws InvalidArgumentError when the size or rank differ.
  void rebind_tp_group(TpGroup* tp);
  // Frees the gradients and activations (the memory that is not training state), keeping the
  // parameters: afterwards only params(), param_views() and num_params() may be used. A live
  // switch calls it on chunks it will not keep, so the successor's buffers can reuse the memory.
  void release_training_buffers();
  bool training_buffers_released() const { return released_; }
  // Re-sizes the activation memory for micro-batches of B sequences held in `activation_slots`
  // slots, keeping the parameters and gradients: a live switch that changes only the
  // micro-batching keeps the model instead of building (and touching) a new one. Every slot's
  // saved activations are dropped. Throws ConfigError for B or activation_slots below 1, and
  // InvalidArgumentError after release_training_buffers().
  void reshape(int B, int activation_slots);
  // The same, also changing the recompute mode (one re-allocation for both), and the split
  // backward.
  void reshape(int B, int activation_slots, Recompute recompute);
  void reshape(int B, int activation_slots, Recompute recompute, bool split_backward);
  // Changes the recompute mode only: reshape(batch_size(), activation_slots(), recompute).
  void set_recompute(Recompute recompute);
  // Builds the activation memory for split backward (backward_input_stage and
  // backward_weight_stage; see there) or back for backward_stage only: reshape(batch_size(),
  // activation_slots(), recompute(), split). Every slot's saved activations are dropped. A model
  // starts without it.
  void set_split_backward(bool split);
  bool split_backward() const { return split_; }
  // Mixed precision (issue 21): the linear layers multiply bf16 operands with float accumulation
  // (kernels/linear_bf16.h) -- torch.autocast's arithmetic -- reading a bf16 copy of the float
  // weights that refresh_compute_weights() makes. Parameters, gradients, activations and every
  // other op stay float, so the training state is the float model's. The caller refreshes the
  // copy whenever the parameters changed before the next pass (each optimizer step, a load, an
  // evaluation): the runtime does it at the start of every step and evaluation. A pass before the
  // first refresh throws InvalidArgumentError. Off by default; the copy costs 2 bytes a parameter.
  void set_bf16_matmuls(bool on);
  bool bf16_matmuls() const { return params16_ != nullptr; }
  void refresh_compute_weights();
  int tp_rank() const { return tp_ != nullptr ? tp_->rank() : 0; }
  int tp_size() const { return tp_ != nullptr ? tp_->size() : 1; }

  int64_t num_params() const { return num_params_; }
  // Flat [num_params] views of all parameters / gradients.
  Tensor params() const;
  Tensor grads() const;
  // One parameter / its gradient; throws InvalidArgumentError for a name this stage lacks.
  Tensor param(std::string_view name) const;
  Tensor grad(std::string_view name) const;
  const std::vector<ParamView>& param_views() const { return views_; }

  // Deterministic initialisation (see init.h): equal to the same parameters of any other
  // stage or shard layout initialised with the same seed (a tp shard is bit-identical to the
  // same slice of the unsharded parameter).
  void init(uint64_t seed);
  void zero_grad();

  // Whole-model entry points (throw InvalidArgumentError on a partial stage).
  // tokens [B, T] in [0, vocab_size); targets [B, T] in [0, vocab_size) or kIgnoreIndex, or null
  // for logits only (the result is then {0, 0}). Throws InvalidArgumentError for ids out of range.
  kernels::CrossEntropyResult forward(const int32_t* tokens, const int32_t* targets);
  // Forward, then backward accumulating into the gradients. targets must not be null.
  kernels::CrossEntropyResult forward_backward(const int32_t* tokens, const int32_t* targets,
                                               float grad_scale);
  // [B, T, Vp] logits (only the first vocab_size columns are real classes); with tensor
  // parallelism this rank's [B, T, Vp / tp] columns. Valid after forward(); after
  // forward_backward() the buffer holds dlogits instead.
  Tensor logits(int slot = 0) const;

  // Pipeline-stage entry points. forward_stage reads tokens (first stage; null otherwise) or
  // input_hidden() (later stages: the previous stage's output must be written there first).
  // On the head stage it computes the loss when targets is not null; with grad_scale it also
  // seeds dlogits for backward_stage (grad_scale requires targets). Other stages ignore
  // targets and grad_scale and return {0, 0}. `slot` in [0, activation_slots()) picks the
  // activation slot (input_hidden(slot) is read, the slot's saved activations overwritten);
  // throws InvalidArgumentError for a slot out of range.
  kernels::CrossEntropyResult forward_stage(const int32_t* tokens, const int32_t* targets,
                                            std::optional<float> grad_scale = std::nullopt,
                                            int slot = 0);
  // Backward of the stage after forward_stage: the head stage starts from its dlogits, other
  // stages from output_grad(), which the caller fills with d(output_hidden) first. Accumulates
  // parameter gradients and leaves d(input_hidden) in input_grad() (not on the first stage,
  // which ends in the embedding). Throws InvalidArgumentError without a preceding forward on
  // the same slot (or for a slot out of range). Slots are independent: forwards and backwards
  // of different slots may interleave in any order.
  // `grads_ready`, when set, is called as parts of the backward finish with an offset `from`
  // (decreasing from call to call, ending at 0): the gradient elements [from, num_params()) are
  // complete for this backward -- after the head, after each block, after the embedding. The
  // parameter buffer is in forward order and backward runs in reverse, so a caller can start
  // reducing the tail of the gradients while the rest of the backward still runs.
  // With split backward (set_split_backward) it runs backward_input_stage, then
  // backward_weight_stage (the layer hook is then called twice per block and head).
  using GradsReady = std::function<void(int64_t from)>;
  void backward_stage(int slot = 0, const GradsReady& grads_ready = {});

  // Split backward for zero-bubble schedules (needs set_split_backward(true), else
  // InvalidArgumentError). backward_stage(slot) == backward_input_stage(slot) followed, at any
  // later time, by backward_weight_stage(slot): the same gradients bit for bit (memcmp), given
  // the weight passes run in the order the backward_stage calls would (gradients accumulate, and
  // float addition is not associative).
  // - backward_input_stage (Bi) takes the place of backward_stage in the slot's life (after its
  //   forward_stage, output_grad filled first on a non-head stage) and leaves in input_grad()
  //   exactly what backward_stage leaves; it does not touch the parameter gradients. It keeps in
  //   the slot what the weight pass reads (the output gradients of every linear, the norms'
  //   weight gradients, d(x0) on the first stage; see Memory above). With tensor parallelism it
  //   makes the input-gradient all-reduces (and, under full recomputation, the recomputed
  //   forward's).
  // - backward_weight_stage (Bw) then accumulates the slot's parameter gradients, reading only the
  //   slot's memory: other slots' forwards and Bi / Bw may run in between, and output_grad /
  //   input_grad are neither read nor written (read a Bi's input_grad before or after any Bw).
  //   `grads_ready` is reported from here as by backward_stage. With tensor parallelism it makes
  //   the replicated-kv-head gradient all-reduce.
  // The slot is free for its next forward_stage only after its Bw: forward_stage on a slot whose
  // Bw is pending throws InvalidArgumentError (reshape / set_* drop a pending Bw, e.g. after an
  // abandoned step). Bi without a forward, Bw without a Bi, and a second Bw throw
  // InvalidArgumentError. The layer hook is called before each block's (and the head's) Bi and
  // Bw; after it throws the slot is free (its forward must run again) and the gradients hold
  // partial sums, as for backward_stage.
  void backward_input_stage(int slot = 0);
  void backward_weight_stage(int slot = 0, const GradsReady& grads_ready = {});
  // True between a slot's backward_input_stage and its backward_weight_stage.
  bool weight_pass_pending(int slot) const;

  // [B, T, C] stage-boundary buffers of a slot. input_grad() and output_grad() are the same
  // memory, and it is SHARED by all slots (gradient scratch): the residual-stream gradient runs
  // backward through it, so fill output_grad right before, and read input_grad right after, the
  // backward_stage (or backward_input_stage) concerned. The slot argument of the gradient
  // accessors is only checked.
  Tensor input_hidden(int slot = 0) const;
  Tensor output_hidden(int slot = 0) const;
  Tensor output_grad(int slot = 0) const;
  Tensor input_grad(int slot = 0) const;

  // Called before each block's forward and backward and before the head's (the layers of a
  // pass, where it may stop); once per block and pass whatever the recompute mode (a block's
  // recomputation belongs to its backward and is not announced separately); a split backward's
  // input and weight passes are passes of their own. It may throw to abandon
  // the pass: an elastic worker stops computing a step whose world is being replaced
  // (runtime/rank_trainer.h) instead of finishing work that will be redone. After such a throw the
  // slot holds no saved activations (its forward must run again) and the gradients hold partial
  // sums (zero_grad() before the next step).
  using LayerHook = std::function<void()>;
  void set_layer_hook(LayerHook hook) { layer_hook_ = std::move(hook); }

  // Bytes of activation and scratch memory held (excluding parameters and gradients).
  size_t activation_bytes() const { return size_t(act_floats_) * sizeof(float); }

 private:
  // Saved activations of one block, [N = B*T rows]. Pointers the family does not use are null.
  // With recomputation some of them point into a buffer shared by all blocks and slots.
  struct LayerActs {
    float* ln1 = nullptr;  // [N, C] norm1 output, and its statistics [N] (mean: LayerNorm only)
    float* ln1_mean = nullptr;
    float* ln1_rstd = nullptr;
    float* qkv = nullptr;    // gpt2 [N, 3C] fused; llama q [N, Hq D], k, v [N, Hkv D] back to back
    float* atty = nullptr;   // [N, C] attention output (heads concatenated)
    float* probs = nullptr;  // [B, Hq, T, T]
    float* res2 = nullptr;   // [N, C] residual stream after attention
    float* ln2 = nullptr;
    float* ln2_mean = nullptr;
    float* ln2_rstd = nullptr;
    float* fc = nullptr;    // [N, F] gpt2 c_fc output / llama gate output
    float* up = nullptr;    // [N, F] llama up output
    float* act = nullptr;   // [N, F] gelu / swiglu output
    float* res3 = nullptr;  // [N, C] block output
  };
  // Backend memory owned by the model, freed through the backend (also when construction
  // fails half way).
  struct BackendFree {
    kernels::Backend* backend;
    void operator()(void* ptr) const { backend->deallocate(ptr); }
  };
  using Owned = std::unique_ptr<void, BackendFree>;
  void* allocate(size_t bytes, std::vector<Owned>& owner);
  // Allocates, carves and touches the activations, token ids and targets for B_ and slots_.
  void build_activations();
  int64_t plan_activations(float* base);
  void check_ids(const int32_t* ids, bool targets) const;
  float* p(int64_t off) const { return off < 0 ? nullptr : params_ + off; }
  float* g(int64_t off) const { return off < 0 ? nullptr : grads_ + off; }
  const float* stage_output() const;  // of the selected slot
  // Points acts_ / the per-slot fields of a_ / tokens_ at slot s (checked).
  void select_slot(int s);
  void check_slot(int s) const;
  // A backward runs both halves (backward_stage without split backward) or one of them.
  enum class Pass { both, input, weight };
  // Where a block's backward keeps the gradients its weight-gradient kernels read: the shared
  // scratch and the parameter gradients themselves (Pass::both), or the slot's LayerGrads.
  struct BlockGrads {
    float* dout = nullptr;  // d(block output): the MLP output linear's dY
    float* dmid = nullptr;  // d(residual after attention): the attention output linear's dY
    float* d0 = nullptr;    // gpt2 d(c_fc output) / llama d(gate output)
    float* d1 = nullptr;    // llama d(up output)
    float* dqkv = nullptr;
    float* norm[4] = {};  // d norm1 weight, bias, norm2 weight, bias (null when absent)
  };
  BlockGrads block_grads(int l, Pass pass) const;
  // Bw: adds a norm's weight (or bias) gradient that Bi left in the slot (null: none) to the
  // gradient at `off`.
  void add_norm_grad(int64_t off, const float* partial);
  // An exact device-to-device copy of n floats.
  void copy_floats(float* dst, const float* src, int64_t n);
  // The linear layers, in the float or the bf16 arithmetic (set_bf16_matmuls).
  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                      int IC, int OC);
  void linear_backward_input(float* dinp, const float* dout, const float* weight, int N, int IC,
                             int OC);
  void linear_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp,
                              int N, int IC, int OC);
  const bf16* compute_weight(const float* weight) const;
  void check_backward_ready(const char* what);
  void block_forward(int l, const float* x);
  void block_backward(int l, const float* x, Pass pass);
  void gpt2_block_forward(int l, const float* x);
  void gpt2_block_backward(int l, const float* x, Pass pass);
  void llama_block_forward(int l, const float* x);
  void llama_block_backward(int l, const float* x, Pass pass);
  void head_backward(Pass pass);
  void stage_backward(Pass pass, const GradsReady& grads_ready);
  kernels::CrossEntropyResult vocab_parallel_loss(float* dlogits, float grad_scale);
  // The Megatron all-reduce (no-op without tensor parallelism).
  void tp_sum(float* data, int64_t n);

  ModelConfig config_;
  kernels::Backend& backend_;
  int B_, T_;
  Recompute recompute_ = Recompute::none;
  bool split_ = false;     // split backward
  TpGroup* tp_ = nullptr;  // null unless tensor-parallel with size > 1
  // This rank's share of the split dimensions (the whole model's without tensor parallelism).
  struct Local {
    int Hq = 0;        // query heads
    int Hkv = 0;       // kv heads held
    int kv_begin = 0;  // first global kv head held
    bool kv_replicated = false;
    int F = 0;            // MLP hidden features
    int Vp = 0;           // vocabulary rows
    int vocab_start = 0;  // first vocabulary row
  } local_;
  StageRange stage_;
  ModelSpec spec_;
  std::vector<ParamView> views_;
  int64_t num_params_ = 0;
  float* params_ = nullptr;
  float* grads_ = nullptr;

  // Parameter offsets (-1: absent). layer_off_[l - layer_begin][LayerParam].
  std::vector<std::vector<int64_t>> layer_off_;
  int64_t wte_off_ = -1, wpe_off_ = -1, lnf_w_off_ = -1, lnf_b_off_ = -1, head_off_ = -1;

  float* act_base_ = nullptr;
  int64_t act_floats_ = 0;
  std::vector<LayerActs>* acts_ = nullptr;  // the selected slot's
  struct Globals {
    float* x0 = nullptr;  // stage input: embedding output or the previous stage's output
    float* lnf = nullptr;
    float* lnf_mean = nullptr;
    float* lnf_rstd = nullptr;
    float* logits = nullptr;   // [N, Vp]; dlogits in place
    float* losses = nullptr;   // [N]
    float* ce_max = nullptr;   // [N] vocabulary-parallel loss statistics (tp only)
    float* ce_sums = nullptr;  // [2N]
    float* proj = nullptr;     // [N, C] projection output before the residual add
    // backward scratch, shared by all blocks
    float* dres = nullptr;   // [N, C] residual-stream gradient
    float* dln = nullptr;    // [N, C] gradient of a norm output
    float* datty = nullptr;  // [N, C] gradient of the attention output
    float* dqkv = nullptr;   // [N, (Hq + 2 Hkv) D]
    float* df0 = nullptr;    // [N, F] each
    float* df1 = nullptr;
    float* df2 = nullptr;
    float* kv_stage = nullptr;  // [2, Hkv D, C] replicated kv heads' gradients (tp only)
    // split backward, per slot
    float* demb = nullptr;  // [N, C] d(x0), the embedding's weight pass input (first stage)
    float* dlnf = nullptr;  // [C] or [2C] the final norm's weight (and bias) gradient (head)
  } a_;
  int32_t* tokens_ = nullptr;  // [N] in backend memory, the selected slot's
  int32_t* targets_ = nullptr;
  // Split backward: what a block's Bi keeps for its Bw (BlockGrads' fields).
  struct LayerGrads {
    float* dout = nullptr;   // [N, C]
    float* dmid = nullptr;   // [N, C]
    float* d0 = nullptr;     // [N, F]
    float* d1 = nullptr;     // [N, F] llama
    float* dqkv = nullptr;   // [N, (Hq + 2 Hkv) D]
    float* dnorm = nullptr;  // [C] per norm parameter of the block, in LayerParam order
  };
  // One activation slot: its per-layer activations, its copy of the per-slot fields of Globals
  // (x0, lnf*, logits, losses, ce_*, demb, dlnf; the scratch fields are shared) and its token ids.
  struct Slot {
    std::vector<LayerActs> acts;
    std::vector<LayerGrads> grads;  // split backward only
    Globals g;
    int32_t* tokens = nullptr;
    bool forward_ready = false;   // forward_stage ran since the last backward (input) pass
    bool dlogits_ready = false;   // ... and seeded dlogits (head stage)
    bool weight_pending = false;  // backward_input_stage ran, backward_weight_stage has not
  };
  std::vector<Slot> slots_;
  int cur_ = 0;                    // selected slot
  std::vector<Owned> owned_;       // parameters and gradients
  std::vector<Owned> act_owned_;   // activations, token ids, targets (reshape() replaces them)
  std::vector<Owned> bf16_owned_;  // the weights' bf16 copy (set_bf16_matmuls)
  bf16* params16_ = nullptr;
  bool params16_fresh_ = false;
  bool released_ = false;  // release_training_buffers()
  LayerHook layer_hook_;
  std::vector<float> copy_staging_;  // copy_floats() on a device backend
};

}  // namespace tessel::model
