#include "tessel/planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "tessel/core/check.h"

namespace tessel::planner {

PassTimes& PassTimes::operator+=(const PassTimes& o) {
  forward += o.forward;
  backward_input += o.backward_input;
  backward_weight += o.backward_weight;
  recompute += o.recompute;
  return *this;
}

PassTimes PassTimes::scaled(double f) const {
  return PassTimes{forward * f, backward_input * f, backward_weight * f, recompute * f};
}

namespace {

// Key/value width of one tp rank: its share of the kv heads, or the one kv head its query heads
// use when tp is a multiple of n_kv_head (replicated k/v, see Plan::validate).
double kv_dim_per_rank(const model::ModelConfig& m, int tp) {
  const double D = m.head_dim();
  return m.n_kv_head % tp == 0 ? double(m.n_kv_head / tp) * D : D;
}

}  // namespace

ForwardFlops block_forward_flops(const model::ModelConfig& m, int64_t micro_batch, int seq,
                                 int tp) {
  const double n = double(micro_batch) * seq, h = m.n_embd, F = m.ffn_hidden, t = tp;
  ForwardFlops f;
  if (m.family == model::Family::gpt2) {
    f.gemm = 2 * n * (3 * h * h + h * h + h * F + F * h) / t;
    f.gemm_calls = 4;
  } else {
    f.gemm = 2 * n * (2 * h * h / t + 2 * h * kv_dim_per_rank(m, tp) + 3 * h * F / t);
    f.gemm_calls = 7;
  }
  f.attention = 2 * (2 * n * seq * h / t);
  f.attention_calls = 2;
  return f;
}

BlockGemms block_gemms(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp) {
  const double n = double(micro_batch) * seq, h = m.n_embd, F = m.ffn_hidden, t = tp;
  BlockGemms g;
  if (m.family == model::Family::gpt2) {
    g.linear = {{n, 3 * h / t, h}, {n, h, h / t}, {n, F / t, h}, {n, h, F / t}};
  } else {
    const double kv = kv_dim_per_rank(m, tp);
    g.linear = {{n, h / t, h}, {n, kv, h},    {n, kv, h},   {n, h, h / t},
                {n, F / t, h}, {n, F / t, h}, {n, h, F / t}};
  }
  const double heads = double(micro_batch) * m.n_head / t, d = m.head_dim();
  g.attention = {{double(seq), double(seq), d, heads}, {double(seq), d, double(seq), heads}};
  return g;
}

ForwardFlops head_forward_flops(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp) {
  ForwardFlops f;
  f.gemm = 2.0 * double(micro_batch) * seq * m.n_embd * double(m.padded_vocab()) / tp;
  f.gemm_calls = 1;
  return f;
}

double model_flops_per_sample(const model::ModelConfig& m, int seq) {
  return 3 * (m.n_layer * block_forward_flops(m, 1, seq, 1).total() +
              head_forward_flops(m, 1, seq, 1).total());
}

ProfilePoint ComputeProfile::at(int64_t micro_batch) const {
  TESSEL_CHECK(!points.empty(), InvalidArgumentError, "compute profile has no points");
  auto field = [](ProfilePoint& p, int unit) -> PassTimes& {
    return unit == 0 ? p.block : unit == 1 ? p.embedding : p.head;
  };
  ProfilePoint out;
  out.micro_batch = micro_batch;
  const double b = double(micro_batch);
  if (points.size() == 1 || micro_batch <= points.front().micro_batch) {
    const ProfilePoint& p = points.front();
    const double f = b / double(p.micro_batch);
    out.block = p.block.scaled(f);
    out.embedding = p.embedding.scaled(f);
    out.head = p.head.scaled(f);
    return out;
  }
  size_t hi = 1;
  while (hi + 1 < points.size() && points[hi].micro_batch < micro_batch) ++hi;
  ProfilePoint p0 = points[hi - 1], p1 = points[hi];
  const double w = (b - double(p0.micro_batch)) / double(p1.micro_batch - p0.micro_batch);
  for (int unit = 0; unit < 3; ++unit) {
    const PassTimes& a = field(p0, unit);
    const PassTimes& c = field(p1, unit);
    auto lerp = [w](double x, double y) { return std::max(0.0, x + (y - x) * w); };
    field(out, unit) =
        PassTimes{lerp(a.forward, c.forward), lerp(a.backward_input, c.backward_input),
                  lerp(a.backward_weight, c.backward_weight), lerp(a.recompute, c.recompute)};
  }
  return out;
}

namespace {

double number(const nlohmann::json& doc, const char* key, const std::string& where) {
  TESSEL_CHECK(doc.is_object() && doc.contains(key), CorruptDataError,
               "profile: {} has no '{}' field", where, key);
  const auto& v = doc.at(key);
  TESSEL_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0,
               CorruptDataError, "profile: {}.{} is {}; it must be a non-negative number", where,
               key, v.dump());
  return v.get<double>();
}

// Backward time split into input and weight gradients: measured when both parts are given, else
// in the analytic ratio `input_share`.
PassTimes passes(const nlohmann::json& p, const std::string& where, const char* fwd,
                 const char* bwd, const char* bwd_in, const char* bwd_w, double input_share,
                 bool recompute) {
  PassTimes t;
  t.forward = number(p, fwd, where);
  if (bwd_in && p.contains(bwd_in) && p.contains(bwd_w)) {
    t.backward_input = number(p, bwd_in, where);
    t.backward_weight = number(p, bwd_w, where);
  } else {
    const double b = number(p, bwd, where);
    t.backward_input = b * input_share;
    t.backward_weight = b - t.backward_input;
  }
  t.recompute = recompute ? t.forward : 0;
  return t;
}

}  // namespace

ComputeProfile compute_profile_from_json(const nlohmann::json& profile,
                                         const model::ModelConfig& model) {
  TESSEL_CHECK(profile.is_object() && profile.contains("layer_times"), CorruptDataError,
               "profile has no 'layer_times' section (per-layer times by micro-batch size)");
  const auto& lt = profile.at("layer_times");
  ComputeProfile c;
  c.seq = int(number(lt, "seq", "layer_times"));
  c.tp = lt.contains("tp") ? int(number(lt, "tp", "layer_times")) : 1;
  TESSEL_CHECK(c.seq >= 1 && c.tp >= 1, CorruptDataError,
               "profile: layer_times.seq ({}) and tp ({}) must be >= 1", c.seq, c.tp);
  TESSEL_CHECK(lt.contains("points") && lt.at("points").is_array() && !lt.at("points").empty(),
               CorruptDataError, "profile: layer_times.points must be a non-empty array");
  const ForwardFlops bf = block_forward_flops(model, 1, c.seq, c.tp);
  // dX: the GEMMs once and attention twice; dW: the GEMMs once.
  const double block_input_share = (bf.gemm + 2 * bf.attention) / (2 * bf.gemm + 2 * bf.attention);
  size_t i = 0;
  for (const auto& p : lt.at("points")) {
    const std::string where = fmt::format("layer_times.points[{}]", i++);
    ProfilePoint pt;
    const double mb = number(p, "micro_batch", where);
    TESSEL_CHECK(mb >= 1 && mb == std::floor(mb), CorruptDataError,
                 "profile: {}.micro_batch is {}; it must be a whole number >= 1", where, mb);
    pt.micro_batch = int64_t(mb);
    pt.block = passes(p, where, "forward_s", "backward_s", "backward_input_s", "backward_weight_s",
                      block_input_share, true);
    // The embedding's backward is its weight gradient; the head's splits evenly (dX and dW are
    // the same GEMM size).
    pt.embedding = passes(p, where, "embedding_forward_s", "embedding_backward_s", nullptr, nullptr,
                          0.0, false);
    pt.head = passes(p, where, "head_forward_s", "head_backward_s", nullptr, nullptr, 0.5, false);
    c.points.push_back(pt);
  }
  std::sort(c.points.begin(), c.points.end(),
            [](const auto& a, const auto& b) { return a.micro_batch < b.micro_batch; });
  for (size_t k = 1; k < c.points.size(); ++k) {
    TESSEL_CHECK(c.points[k].micro_batch != c.points[k - 1].micro_batch, CorruptDataError,
                 "profile: layer_times has two points for micro_batch {}", c.points[k].micro_batch);
  }
  return c;
}

CostModel::CostModel(model::ModelConfig model, ClusterSpec cluster, CostOptions options,
                     std::optional<ComputeProfile> profile)
    : model_(std::move(model)),
      cluster_(std::move(cluster)),
      options_(options),
      profile_(std::move(profile)) {
  peak_ = cluster_.device.peak(options_.precision);
  TESSEL_CHECK(peak_ > 0, ConfigError,
               "cluster '{}': device '{}' has no {} peak rate; choose another precision or set "
               "device.peak_tflops.{}",
               cluster_.name, cluster_.device.name, precision_name(options_.precision),
               precision_name(options_.precision));
  act_bytes_ = element_bytes(options_.precision);
}

double CostModel::stream(double elements, int bytes_per_element) const {
  const double bw = cluster_.device.memory_bandwidth;
  return bw > 0 ? elements * bytes_per_element / bw : 0;
}

PassTimes CostModel::block_compute(int64_t micro_batch, int seq, int tp) const {
  // Each GEMM call by its shape (the device's shape model), or on its FLOPs (the curve).
  auto gemm = [&](const GemmShape& g) {
    return cluster_.device.gemm_seconds(g, options_.precision);
  };
  const BlockGemms g = block_gemms(model_, micro_batch, seq, tp);
  const double n = double(micro_batch) * seq, h = model_.n_embd;
  const double act_passes = model_.family == model::Family::gpt2 ? 2 : 3;
  const double elementwise = 10 * n * h + act_passes * n * model_.ffn_hidden / tp +
                             2 * n * seq * double(model_.n_head) / tp;
  PassTimes t;
  // dX: each linear layer's input gradient and both of attention's operands; dW: the weights'.
  for (const GemmShape& s : g.linear) {
    t.forward += gemm(s);
    t.backward_input += gemm(input_gradient_gemm(s));
    t.backward_weight += gemm(weight_gradient_gemm(s));
  }
  for (const GemmShape& s : g.attention) {
    t.forward += gemm(s);
    t.backward_input += gemm(input_gradient_gemm(s)) + gemm(weight_gradient_gemm(s));
  }
  t.forward += stream(elementwise, act_bytes_);
  t.backward_input += stream(2 * elementwise, act_bytes_);
  t.recompute = t.forward;
  return t;
}

PassTimes CostModel::embedding_compute(int64_t micro_batch, int seq, int tp) const {
  const double nh = double(micro_batch) * seq * model_.n_embd;
  const double positions = model_.family == model::Family::gpt2 ? 1 : 0;
  PassTimes t;
  t.forward = stream((1 + positions) * nh, act_bytes_);
  t.backward_weight = stream(2 * (1 + positions) * nh, act_bytes_);
  return t;
}

PassTimes CostModel::head_compute(int64_t micro_batch, int seq, int tp) const {
  const double n = double(micro_batch) * seq;
  const double logits = 2 * n * double(model_.padded_vocab()) / tp;
  const double norm = 2 * n * model_.n_embd;
  // The vocabulary projection of this rank's share of the (padded) vocabulary.
  const GemmShape head{n, double(model_.padded_vocab()) / tp, double(model_.n_embd)};
  const auto& d = cluster_.device;
  PassTimes t;
  t.forward =
      d.gemm_seconds(head, options_.precision) + stream(norm, act_bytes_) + stream(logits, 4);
  t.backward_input = d.gemm_seconds(input_gradient_gemm(head), options_.precision) +
                     stream(norm, act_bytes_) + stream(logits, 4);
  t.backward_weight = d.gemm_seconds(weight_gradient_gemm(head), options_.precision);
  return t;
}

PassTimes CostModel::from_profile(int which, int64_t micro_batch, int seq, int tp) const {
  const ComputeProfile& p = *profile_;
  const ProfilePoint pt = p.at(micro_batch);
  PassTimes measured = which == 0 ? pt.block : which == 1 ? pt.embedding : pt.head;
  if (seq == p.seq && tp == p.tp) return measured;
  auto analytic = [&](int s, int t) {
    return which == 0   ? block_compute(micro_batch, s, t)
           : which == 1 ? embedding_compute(micro_batch, s, t)
                        : head_compute(micro_batch, s, t);
  };
  const PassTimes want = analytic(seq, tp), had = analytic(p.seq, p.tp);
  auto ratio = [](double w, double h) { return h > 0 ? w / h : 1.0; };
  measured.forward *= ratio(want.forward, had.forward);
  measured.backward_input *= ratio(want.backward_input, had.backward_input);
  measured.backward_weight *= ratio(want.backward_weight, had.backward_weight);
  measured.recompute *= ratio(want.recompute, had.recompute);
  return measured;
}

PassTimes CostModel::block(int64_t micro_batch, int seq, int tp) const {
  PassTimes t =
      profile_ ? from_profile(0, micro_batch, seq, tp) : block_compute(micro_batch, seq, tp);
  if (tp > 1) {
    const double ar = tp_all_reduce(micro_batch, seq, tp);
    t.forward += 2 * ar;
    t.backward_input += 2 * ar;
    t.recompute += 2 * ar;
  }
  return t;
}

PassTimes CostModel::embedding(int64_t micro_batch, int seq, int tp) const {
  PassTimes t =
      profile_ ? from_profile(1, micro_batch, seq, tp) : embedding_compute(micro_batch, seq, tp);
  if (tp > 1) t.forward += tp_all_reduce(micro_batch, seq, tp);
  return t;
}

PassTimes CostModel::head(int64_t micro_batch, int seq, int tp) const {
  PassTimes t =
      profile_ ? from_profile(2, micro_batch, seq, tp) : head_compute(micro_batch, seq, tp);
  if (tp > 1) {
    // Vocabulary-parallel cross-entropy: max, sum of exponentials and target logit per token.
    t.forward += 3 * all_reduce_time(4.0 * double(micro_batch) * seq, tp, tp_link(tp));
    t.backward_input += tp_all_reduce(micro_batch, seq, tp);
  }
  return t;
}

PassTimes CostModel::unit(int u, int64_t micro_batch, int seq, int tp) const {
  TESSEL_CHECK(0 <= u && u <= model_.n_layer + 1, InvalidArgumentError,
               "unit {} is outside model '{}' ({} units)", u, model_.name, model_.n_layer + 2);
  if (u == 0) return embedding(micro_batch, seq, tp);
  if (u == model_.n_layer + 1) return head(micro_batch, seq, tp);
  return block(micro_batch, seq, tp);
}

GroupLink GroupLink::across(const LinkSpec& inter, double bandwidth, int ranks, int per_host) {
  GroupLink l{bandwidth, inter.coll_latency(), true, {}};
  l.hosts = per_host >= 1 && ranks % per_host == 0 ? ranks / per_host : ranks;
  l.nccl = inter.nccl;
  return l;
}

namespace {

// NCCL's model's time where the link has one and the group spans its hosts evenly.
std::optional<double> nccl_time(Collective c, double bytes, int ranks, const GroupLink& link) {
  if (!link.nccl.defined() || link.hosts <= 1 || ranks % link.hosts != 0) return std::nullopt;
  return nccl_collective(c, bytes, ranks, link.hosts, link.bandwidth, link.nccl).seconds;
}

}  // namespace

double CostModel::all_reduce_time(double bytes, int ranks, const GroupLink& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  if (auto t = nccl_time(Collective::all_reduce, bytes, ranks, link)) return *t;
  const double wire = 2.0 * (ranks - 1) / ranks * bytes;
  if (!link.bus_curve.empty()) return wire / bus_bandwidth(link.bus_curve, bytes);
  return wire / link.bandwidth + link.latency;
}

double CostModel::reduce_scatter_time(double bytes, int ranks, const GroupLink& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  if (auto t = nccl_time(Collective::reduce_scatter, bytes, ranks, link)) return *t;
  // Half a ring all-reduce's passes, at the all-reduce's bus bandwidth for the message (the
  // curves measured are all-reduce's).
  const double wire = double(ranks - 1) / ranks * bytes;
  if (!link.bus_curve.empty()) return wire / bus_bandwidth(link.bus_curve, bytes);
  return wire / link.bandwidth + link.latency;
}

double CostModel::all_gather_time(double bytes, int ranks, const GroupLink& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  if (auto t = nccl_time(Collective::all_gather, bytes, ranks, link)) return *t;
  return reduce_scatter_time(bytes, ranks, link);
}

GroupLink CostModel::tp_link(int tp) const {
  const auto& c = cluster_;
  if (tp <= c.devices_per_host)
    return GroupLink{c.intra_host.coll_bandwidth(), c.intra_host.coll_latency(), false,
                     c.intra_host.bus_curve};
  return GroupLink::across(
      c.inter_host,
      std::min(c.intra_host.coll_bandwidth(), c.devices_per_host * c.inter_host.coll_bandwidth()),
      tp, c.devices_per_host);
}

GroupLink CostModel::dp_link(int dp, int tp) const {
  const auto& c = cluster_;
  const int per_host = c.devices_per_host;
  const int64_t block = int64_t(dp) * tp;  // the ranks of one pipeline rank, consecutive
  if (c.hosts == 1 || (block <= per_host && per_host % block == 0))
    return GroupLink{c.intra_host.coll_bandwidth(), c.intra_host.coll_latency(), false,
                     c.intra_host.bus_curve};
  // Hosts hold per_host / tp members each when the block is host-aligned; otherwise assume the
  // worst, one member per host.
  const int k = (block % per_host == 0 && per_host % tp == 0) ? per_host / tp : 1;
  return GroupLink::across(
      c.inter_host, std::min(c.intra_host.coll_bandwidth(), k * c.inter_host.coll_bandwidth()), dp,
      k);
}

GroupLink CostModel::pp_link(int world) const {
  const auto& c = cluster_;
  if (world <= c.devices_per_host)
    return GroupLink{c.intra_host.bandwidth, c.intra_host.latency, false, {}};
  return GroupLink{c.inter_host.bandwidth, c.inter_host.latency, true, {}};
}

double CostModel::tp_all_reduce(int64_t micro_batch, int seq, int tp) const {
  const double bytes = double(micro_batch) * seq * model_.n_embd * act_bytes_;
  return all_reduce_time(bytes, tp, tp_link(tp));
}

double CostModel::p2p(int64_t micro_batch, int seq, int world) const {
  const GroupLink l = pp_link(world);
  return double(micro_batch) * seq * model_.n_embd * act_bytes_ / l.bandwidth + l.latency;
}

CostModel::DpSync CostModel::dp_sync(double params, int dp, int tp, int zero_stage) const {
  DpSync s;
  if (dp <= 1 || params <= 0) return s;
  const GroupLink l = dp_link(dp, tp);
  const double bytes = params * act_bytes_;  // gradients and parameters in the training precision
  if (zero_stage == 0) {
    s.overlappable = all_reduce_time(bytes, dp, l);
  } else {
    s.overlappable = reduce_scatter_time(bytes, dp, l);
    s.exposed = all_gather_time(bytes, dp, l);
  }
  return s;
}

double CostModel::dp_exposed(const DpSync& sync, double window) const {
  const double hidden = std::min(options_.dp_overlap * sync.overlappable, std::max(0.0, window));
  return sync.exposed + sync.overlappable - hidden;
}

double CostModel::optimizer_step(double params) const {
  return adam_step_time(params, act_bytes_, cluster_.device.memory_bandwidth);
}

double CostModel::adam_step_time(double params, int act_bytes, double memory_bandwidth) {
  // Adam reads the gradient, the master weight and m, v, writes the three back and the
  // training-precision copy (mixed precision): 28 bytes plus the gradient per parameter.
  return memory_bandwidth > 0 ? params * (28 + act_bytes) / memory_bandwidth : 0;
}

double CostModel::tied_embedding_sync(int tp, int pp, int world) const {
  if (!model_.tie_embeddings || pp <= 1) return 0;
  const double bytes = double(model_.padded_vocab()) * model_.n_embd / tp * act_bytes_;
  return all_reduce_time(bytes, 2, pp_link(world));
}

}  // namespace tessel::planner
