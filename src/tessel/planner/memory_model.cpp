#include "tessel/planner/memory_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/schedule/instruction.h"

namespace tessel::planner {

namespace {

double kv_dim_per_rank(const model::ModelConfig& m, int tp) {
  const double D = m.head_dim();
  return m.n_kv_head % tp == 0 ? double(m.n_kv_head / tp) * D : D;
}

int64_t block_params(const model::ModelConfig& m, int tp) {
  const int64_t h = m.n_embd, F = m.ffn_hidden, t = tp;
  if (m.family == model::Family::gpt2) {
    const int64_t b = m.bias ? 1 : 0;
    return 2 * (h + b * h)                  // ln_1, ln_2 (replicated)
           + 3 * h * h / t + b * 3 * h / t  // c_attn (column-parallel, bias split)
           + h * h / t + b * h              // attn.c_proj (row-parallel, bias replicated)
           + F * h / t + b * F / t          // c_fc
           + h * F / t + b * h;             // mlp.c_proj
  }
  const int64_t kv = int64_t(kv_dim_per_rank(m, tp));
  return 2 * h + 2 * h * h / t + 2 * kv * h + 3 * F * h / t;
}

int64_t embedding_params(const model::ModelConfig& m, int tp) {
  const int64_t vocab = int64_t(m.padded_vocab()) * m.n_embd / tp;
  return vocab + (m.family == model::Family::gpt2 ? int64_t(m.max_seq_len) * m.n_embd : 0);
}

int64_t head_params(const model::ModelConfig& m, int tp) {
  const int64_t norm = m.family == model::Family::gpt2 && m.bias ? 2 * m.n_embd : m.n_embd;
  return norm + (m.tie_embeddings ? 0 : int64_t(m.padded_vocab()) * m.n_embd / tp);
}

// Floats of one stage's activation buffers (transformer.h, "Memory"; memory_model.h), split by
// where they live and which precision they take.
struct Floats {
  double per_slot = 0;       // at the training precision
  double per_slot_fp32 = 0;  // logits, losses, loss statistics
  double recomputed = 0;
  double scratch = 0;
};

struct Shapes {
  double n, h, D, Hq, Hkv, F, qkv, probs;
  bool gpt2, kv_replicated;
};

Shapes shapes_of(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp,
                 const MemoryOptions& o) {
  Shapes x{};
  x.n = double(micro_batch) * seq;
  x.h = m.n_embd;
  x.D = m.head_dim();
  x.Hq = double(m.n_head / tp);
  x.kv_replicated = m.n_kv_head % tp != 0;
  x.Hkv = x.kv_replicated ? 1 : double(m.n_kv_head / tp);
  x.F = double(m.ffn_hidden / tp);
  x.qkv = (x.Hq + 2 * x.Hkv) * x.D;
  x.probs = o.flash_attention ? 0 : double(micro_batch) * x.Hq * double(seq) * seq;
  x.gpt2 = m.family == model::Family::gpt2;
  return x;
}

// The inputs of a block's linears (X: both norm outputs, the attention output, the MLP
// activation) and the rest of its activations but its output and the probabilities.
double block_linear_inputs(const Shapes& x) {
  return x.n * (2 * x.h + x.Hq * x.D + x.F);
}
double block_rest(const Shapes& x) {
  return x.gpt2 ? x.n * (x.h + x.qkv + x.F + 4) : x.n * (x.h + x.qkv + 2 * x.F + 2);
}

// A block's floats per slot, and the floats every block of the stage shares (`recomputed`).
struct BlockFloats {
  double per_slot = 0, recomputed = 0;
};

BlockFloats block_floats(const model::ModelConfig& m, const Shapes& x, model::Recompute r,
                         bool split) {
  const double out = x.n * x.h, inputs = block_linear_inputs(x), rest = block_rest(x);
  BlockFloats f;
  switch (r) {
    case model::Recompute::none:
      f.per_slot = out + inputs + rest + x.probs;
      break;
    case model::Recompute::selective:
      f.per_slot = out + inputs + rest;
      f.recomputed = x.probs;
      break;
    case model::Recompute::full:
      // A split backward's weight pass runs after other blocks' recomputations, so the inputs
      // of the linears stay per block and slot.
      f.per_slot = out + (split ? inputs : 0);
      f.recomputed = (split ? 0 : inputs) + rest + x.probs;
      break;
  }
  if (split) {
    // What the weight pass reads after the input pass returned: d(block output), d(residual
    // after attention), dqkv, the MLP output gradients, the norms' weight gradients.
    const double norms = x.gpt2 && m.bias ? 4 * x.h : 2 * x.h;
    f.per_slot += x.n * (2 * x.h + x.qkv + (x.gpt2 ? x.F : 2 * x.F)) + norms;
  }
  return f;
}

// The head's floats per slot: the final norm, its statistics, logits and losses (fp32), and its
// weight gradients under split backward.
void add_head(const model::ModelConfig& m, const Shapes& x, int tp, bool split, Floats& f) {
  f.per_slot += x.n * x.h + (x.gpt2 ? 2 : 1) * x.n;
  if (split) f.per_slot += x.gpt2 && m.bias ? 2 * x.h : x.h;
  f.per_slot_fp32 += x.n * double(m.padded_vocab() / tp) + x.n + (tp > 1 ? 3 * x.n : 0);
}

Floats stage_floats(const model::ModelConfig& m, int unit_begin, int unit_end, int64_t micro_batch,
                    int seq, int tp, model::Recompute recompute, bool split,
                    const MemoryOptions& o) {
  const int L = m.n_layer;
  TESSEL_CHECK(0 <= unit_begin && unit_begin < unit_end && unit_end <= L + 2, InvalidArgumentError,
               "stage units [{}, {}) are not a non-empty range of model '{}' ({} units)",
               unit_begin, unit_end, m.name, L + 2);
  const Shapes x = shapes_of(m, micro_batch, seq, tp, o);
  const int blocks = std::min(unit_end, L + 1) - std::max(unit_begin, 1);
  Floats f;
  f.per_slot = x.n * x.h;                                 // the stage input x0
  if (unit_begin == 0 && split) f.per_slot += x.n * x.h;  // d(x0), the embedding's weight pass
  if (unit_end == L + 2) add_head(m, x, tp, split, f);
  f.scratch = 3 * x.n * x.h;  // proj, dres, dln
  if (blocks > 0) {
    const BlockFloats b = block_floats(m, x, recompute, split);
    f.per_slot += blocks * b.per_slot;
    f.recomputed = b.recomputed;
    const double mlp = split ? x.F : (x.gpt2 ? 2 : 3) * x.F;
    f.scratch += x.n * (x.Hq * x.D + (split ? 0 : x.qkv) + mlp);
    if (x.kv_replicated) f.scratch += 2 * double(m.n_kv_head) * x.D * x.h;
  }
  return f;
}

}  // namespace

StageActivation stage_activation_bytes(const model::ModelConfig& m, int unit_begin, int unit_end,
                                       int64_t micro_batch, int seq, int tp, Precision precision,
                                       model::Recompute recompute, bool split_backward,
                                       const MemoryOptions& options) {
  const Floats f = stage_floats(m, unit_begin, unit_end, micro_batch, seq, tp, recompute,
                                split_backward, options);
  const double bytes = element_bytes(precision);
  StageActivation a;
  a.per_slot = f.per_slot * bytes + f.per_slot_fp32 * 4;
  a.recomputed = f.recomputed * bytes;
  a.scratch = f.scratch * bytes;
  a.token_ids = 4.0 * double(micro_batch) * seq;
  return a;
}

int64_t unit_params(const model::ModelConfig& m, int unit, int tp) {
  TESSEL_CHECK(0 <= unit && unit <= m.n_layer + 1, InvalidArgumentError,
               "unit {} is outside model '{}' ({} units)", unit, m.name, m.n_layer + 2);
  if (unit == 0) return embedding_params(m, tp);
  if (unit == m.n_layer + 1) return head_params(m, tp);
  return block_params(m, tp);
}

double unit_activation_bytes(const model::ModelConfig& m, int unit, int64_t micro_batch, int seq,
                             int tp, Precision precision, model::Recompute recompute,
                             bool split_backward, const MemoryOptions& options) {
  TESSEL_CHECK(0 <= unit && unit <= m.n_layer + 1, InvalidArgumentError,
               "unit {} is outside model '{}' ({} units)", unit, m.name, m.n_layer + 2);
  // The unit alone as a stage, less the stage input x0 every stage keeps.
  const StageActivation a = stage_activation_bytes(m, unit, unit + 1, micro_batch, seq, tp,
                                                   precision, recompute, split_backward, options);
  return a.per_slot - double(micro_batch) * seq * m.n_embd * element_bytes(precision);
}

std::vector<int64_t> in_flight_micro_batches(layout::ScheduleKind schedule, int pp, int v,
                                             int64_t micro_batches, int rank, int memory_cap) {
  TESSEL_CHECK(0 <= rank && rank < pp && v >= 1 && micro_batches >= 1, InvalidArgumentError,
               "in_flight_micro_batches: rank {} of pp {}, v {}, m {}", rank, pp, v, micro_batches);
  std::vector<int64_t> per_chunk(v, 0);
  switch (schedule) {
    case layout::ScheduleKind::gpipe:
      std::fill(per_chunk.begin(), per_chunk.end(), micro_batches);
      break;
    case layout::ScheduleKind::one_f_one_b:
      std::fill(per_chunk.begin(), per_chunk.end(), std::min<int64_t>(micro_batches, pp - rank));
      break;
    // ZB-H1 defers stage s's first s weight gradients, which holds their activations: every
    // stage up to min(p, m) (schedule/zero_bubble.h). ZB-V's budget is 2p chunk activations a
    // stage, at most p of either chunk.
    case layout::ScheduleKind::zb_h1:
    case layout::ScheduleKind::zb_v:
      std::fill(per_chunk.begin(), per_chunk.end(), std::min<int64_t>(micro_batches, pp));
      break;
    case layout::ScheduleKind::adaptive:
    case layout::ScheduleKind::interleaved_one_f_one_b: {
      const int64_t warmup = 2 * int64_t(pp - rank - 1) + int64_t(v - 1) * pp;
      // The dispatcher holds at most its cap, plus up to v - 1 for the oldest micro-batch
      // (schedule/dispatcher.h), spread over the chunks like interleaved 1F1B's.
      const int64_t alive =
          schedule == layout::ScheduleKind::adaptive
              ? std::min<int64_t>(int64_t(v) * micro_batches, int64_t(memory_cap) + v - 1)
              : std::min<int64_t>(int64_t(v) * micro_batches, warmup + 1);
      // Forward k runs chunk (k / pp) % v: pp micro-batches per chunk in turn. Whole rounds of
      // v * pp forwards give every chunk pp; the rest fill chunks from 0.
      const int64_t round = int64_t(v) * pp;
      for (int c = 0; c < v; ++c) {
        const int64_t rest = alive % round - int64_t(c) * pp;
        per_chunk[c] = alive / round * pp + std::clamp<int64_t>(rest, 0, pp);
      }
      break;
    }
  }
  return per_chunk;
}

std::string format_gib(double bytes) {
  return fmt::format("{:.1f} GiB", bytes / (1024.0 * 1024.0 * 1024.0));
}

int64_t receive_buffer_bound(const layout::Plan& plan, int rank) {
  const int p = plan.pp, v = plan.virtual_stages;
  if (p <= 1) return 0;
  const bool turn = plan.holds_adjacent_stages(rank);
  if (plan.schedule == layout::ScheduleKind::adaptive)
    return turn ? 2 * (int64_t(plan.dispatch_cap(rank)) + v - 1) : 0;
  int64_t alive = 0;
  for (int64_t a : in_flight_micro_batches(plan.schedule, p, v, plan.micro_batches, rank))
    alive += a;
  return int64_t(schedule::kReceiveLookahead) * v + 2 + (plan.jit_recompute ? alive : 0) +
         (turn ? 2 * alive : 0);
}

int64_t send_buffer_bound(const layout::Plan& plan, int rank) {
  if (plan.pp <= 1) return 0;
  int64_t alive = 0;
  for (int64_t a : in_flight_micro_batches(plan.schedule, plan.pp, plan.virtual_stages,
                                           plan.micro_batches, rank, plan.dispatch_cap(rank)))
    alive += a;
  return alive + 2 * plan.virtual_stages;
}

std::string MemoryEstimate::reason() const {
  if (ranks.empty() || fits()) return {};
  const RankMemory& r = peak();
  std::vector<std::pair<double, const char*>> parts = {{r.activations, "activations"},
                                                       {r.parameters, "parameters"},
                                                       {r.gradients, "gradients"},
                                                       {r.optimizer, "optimizer"},
                                                       {r.workspace, "workspace"}};
  std::stable_sort(parts.begin(), parts.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string list;
  for (const auto& [bytes, name] : parts) {
    list += fmt::format("{}{} {}", list.empty() ? "" : ", ", name, format_gib(bytes));
  }
  const std::string where = virtual_stages == 1 ? fmt::format("stage {}", r.pipeline_rank)
                                                : fmt::format("pipeline rank {}", r.pipeline_rank);
  return fmt::format("needs {} per device on {}, has {} ({} less {} reserved): {}",
                     format_gib(r.total()), where, format_gib(capacity), format_gib(device_bytes),
                     format_gib(device_bytes - capacity), list);
}

MemoryEstimate estimate_memory(const model::ModelConfig& m, const layout::Plan& plan, int seq,
                               Precision precision, const DeviceSpec& device,
                               const MemoryOptions& options) {
  const auto& lps = plan.layers_per_stage;
  const int S = plan.num_stages(), p = plan.pp, v = plan.virtual_stages, L = m.n_layer;
  int sum = 0, smallest = 1;
  for (int c : lps) sum += c, smallest = std::min(smallest, c);
  TESSEL_CHECK(int(lps.size()) == S && sum == L + 2 && smallest >= 1, ConfigError,
               "estimate_memory: layers_per_stage has {} entries summing to {}, the smallest {}; "
               "the plan needs {} stages of at least one unit summing to {} units",
               lps.size(), sum, smallest, S, L + 2);
  const int t = plan.tp;
  const int bytes = element_bytes(precision);
  const bool mixed = precision != Precision::fp32;
  const double optimizer_bytes = (mixed ? 12.0 : 8.0) / (plan.zero_stage >= 1 ? plan.dp : 1);

  const double p_block = double(block_params(m, t)), p_emb = double(embedding_params(m, t)),
               p_head = double(head_params(m, t));
  const double emb_copy = m.tie_embeddings ? double(int64_t(m.padded_vocab()) * m.n_embd / t) : 0;
  MemoryEstimate est;
  est.capacity = double(device.usable_bytes());
  est.device_bytes = double(device.memory_bytes);
  est.virtual_stages = v;
  est.ranks.resize(p);
  std::vector<double> params(p, 0), chunk_acts(size_t(p) * v, 0), workspace(p, 0);
  std::vector<char> has_emb(p, 0), has_head(p, 0);
  int begin = 0;
  for (int s = 0; s < S; ++s) {
    const int end = begin + lps[s];
    const int r = plan.pp_rank_of_stage(s), c = plan.chunk_of_stage(s);
    const bool emb = begin == 0, head = end == L + 2;
    const int blocks = std::min(end, L + 1) - std::max(begin, 1);
    params[r] += blocks * p_block + (emb ? p_emb : 0) + (head ? p_head : 0);
    // Each chunk is a model of its own (runtime/prepared_chunks.cpp) with its own scratch.
    const StageActivation a =
        stage_activation_bytes(m, begin, end, plan.micro_batch, seq, t, precision, plan.recompute,
                               plan.split_backward(), options);
    chunk_acts[size_t(r) * v + c] += a.per_slot + a.token_ids;
    workspace[r] += a.workspace();
    has_emb[r] |= emb;
    has_head[r] |= head;
    begin = end;
  }
  for (int r = 0; r < p; ++r) {
    if (has_head[r] && !has_emb[r]) params[r] += emb_copy;
    RankMemory& rm = est.ranks[r];
    rm.pipeline_rank = r;
    rm.parameters = params[r] * bytes;
    rm.gradients = params[r] * bytes;
    rm.optimizer = params[r] * optimizer_bytes;
    // Just-in-time recomputation keeps one micro-batch per chunk (runtime/pipeline_executor.h).
    const auto alive = plan.jit_recompute
                           ? std::vector<int64_t>(size_t(v), 1)
                           : in_flight_micro_batches(plan.schedule, p, v, plan.micro_batches, r,
                                                     plan.dispatch_cap(r));
    // A model has at least one activation slot, even for a chunk no micro-batch is alive in.
    for (int c = 0; c < v; ++c)
      rm.activations += double(std::max<int64_t>(alive[c], 1)) * chunk_acts[size_t(r) * v + c];
    // The runtime's stage-boundary messages are fp32 whatever the training precision.
    rm.workspace =
        workspace[r] + double(receive_buffer_bound(plan, r) + send_buffer_bound(plan, r)) *
                           double(plan.micro_batch) * seq * m.n_embd * 4.0;
    if (rm.total() > est.ranks[est.worst].total()) est.worst = r;
  }
  return est;
}

}  // namespace tessel::planner
