#include "tessel/planner/memory_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "tessel/core/check.h"

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

double block_activation_bytes(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp,
                              int bytes, bool recompute, const MemoryOptions& o) {
  const double n = double(micro_batch) * seq, h = m.n_embd, t = tp;
  if (recompute) return n * h * bytes;
  const double mlp = (m.family == model::Family::gpt2 ? 2 : 3) * n * m.ffn_hidden / t;
  const double attn = n * (2 * h / t + 2 * kv_dim_per_rank(m, tp));
  const double probs = o.flash_attention ? 0 : double(m.n_head) / t * seq * n;
  return (4 * n * h + attn + probs + mlp) * bytes;
}

// What a split backward (zero-bubble schedules) keeps per block and micro-batch between its
// input-gradient and weight-gradient passes (model/transformer.h): d(block output), d(residual
// after attention), dqkv, the MLP output gradients and the norms' weight gradients; under full
// recompute also the inputs of the block's linears, which the re-run forward would otherwise
// overwrite.
double split_backward_bytes(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp,
                            int bytes, bool recompute) {
  const double n = double(micro_batch) * seq, h = m.n_embd, t = tp, F = m.ffn_hidden / t;
  const bool gpt2 = m.family == model::Family::gpt2;
  const double qkv = h / t + 2 * kv_dim_per_rank(m, tp);
  double floats = n * (2 * h + qkv + (gpt2 ? F : 2 * F)) + (gpt2 ? 4 : 2) * h;
  if (recompute) floats += n * (2 * h + h / t + F);
  return floats * bytes;
}

double head_activation_bytes(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp,
                             int bytes) {
  const double n = double(micro_batch) * seq;
  return 2 * n * m.n_embd * bytes + 4 * n * double(m.padded_vocab()) / tp;
}

}  // namespace

int64_t unit_params(const model::ModelConfig& m, int unit, int tp) {
  TESSEL_CHECK(0 <= unit && unit <= m.n_layer + 1, InvalidArgumentError,
               "unit {} is outside model '{}' ({} units)", unit, m.name, m.n_layer + 2);
  if (unit == 0) return embedding_params(m, tp);
  if (unit == m.n_layer + 1) return head_params(m, tp);
  return block_params(m, tp);
}

double unit_activation_bytes(const model::ModelConfig& m, int unit, int64_t micro_batch, int seq,
                             int tp, Precision precision, bool recompute,
                             const MemoryOptions& options) {
  TESSEL_CHECK(0 <= unit && unit <= m.n_layer + 1, InvalidArgumentError,
               "unit {} is outside model '{}' ({} units)", unit, m.name, m.n_layer + 2);
  const int bytes = element_bytes(precision);
  if (unit == 0) return 4.0 * double(micro_batch) * seq;  // token ids
  if (unit == m.n_layer + 1) return head_activation_bytes(m, micro_batch, seq, tp, bytes);
  return block_activation_bytes(m, micro_batch, seq, tp, bytes, recompute, options);
}

std::vector<int64_t> in_flight_micro_batches(layout::ScheduleKind schedule, int pp, int v,
                                             int64_t micro_batches, int rank) {
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
    case layout::ScheduleKind::interleaved_one_f_one_b: {
      const int64_t warmup = 2 * int64_t(pp - rank - 1) + int64_t(v - 1) * pp;
      const int64_t alive = std::min<int64_t>(int64_t(v) * micro_batches, warmup + 1);
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
  int sum = 0;
  for (int c : lps) sum += c;
  TESSEL_CHECK(int(lps.size()) == S && sum == L + 2, ConfigError,
               "estimate_memory: layers_per_stage has {} entries summing to {}; the plan needs {} "
               "stages summing to {} units",
               lps.size(), sum, S, L + 2);
  const int t = plan.tp;
  const int bytes = element_bytes(precision);
  const bool mixed = precision != Precision::fp32;
  const double optimizer_bytes = (mixed ? 12.0 : 8.0) / (plan.zero_stage >= 1 ? plan.dp : 1);

  const double p_block = double(block_params(m, t)), p_emb = double(embedding_params(m, t)),
               p_head = double(head_params(m, t));
  const double emb_copy = m.tie_embeddings ? double(int64_t(m.padded_vocab()) * m.n_embd / t) : 0;
  const bool full = plan.recompute == model::Recompute::full;
  const double a_block =
      block_activation_bytes(m, plan.micro_batch, seq, t, bytes, full, options) +
      (plan.split_backward() ? split_backward_bytes(m, plan.micro_batch, seq, t, bytes, full) : 0);
  const double a_block_full =
      block_activation_bytes(m, plan.micro_batch, seq, t, bytes, false, options);
  const double a_head = head_activation_bytes(m, plan.micro_batch, seq, t, bytes);
  const double a_emb = 4.0 * double(plan.micro_batch) * seq;

  MemoryEstimate est;
  est.capacity = double(device.usable_bytes());
  est.device_bytes = double(device.memory_bytes);
  est.virtual_stages = v;
  est.ranks.resize(p);
  std::vector<double> params(p, 0), chunk_acts(size_t(p) * v, 0), transient(p, 0);
  std::vector<char> has_emb(p, 0), has_head(p, 0);
  int begin = 0;
  for (int s = 0; s < S; ++s) {
    const int end = begin + lps[s];
    const int r = plan.pp_rank_of_stage(s), c = plan.chunk_of_stage(s);
    const bool emb = begin == 0, head = end == L + 2;
    const int blocks = std::min(end, L + 1) - std::max(begin, 1);
    params[r] += blocks * p_block + (emb ? p_emb : 0) + (head ? p_head : 0);
    chunk_acts[size_t(r) * v + c] += blocks * a_block + (emb ? a_emb : 0) + (head ? a_head : 0);
    double biggest =
        blocks > 0 ? a_block_full * (plan.recompute == model::Recompute::full ? 2 : 1) : 0;
    if (head) biggest = std::max(biggest, a_head);
    transient[r] = std::max(transient[r], biggest);
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
    const auto alive = in_flight_micro_batches(plan.schedule, p, v, plan.micro_batches, r);
    for (int c = 0; c < v; ++c) rm.activations += double(alive[c]) * chunk_acts[size_t(r) * v + c];
    rm.workspace = transient[r];
    if (rm.total() > est.ranks[est.worst].total()) est.worst = r;
  }
  return est;
}

}  // namespace tessel::planner
