// The op harness's cross_entropy and vocabulary-parallel cross-entropy cases (op_harness_cases.h),
// with their bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/cross_entropy.h"
#include "tessel/kernels/cross_entropy_test_data.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/kernels/vocab_parallel_ce.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"

namespace tessel::kernels::harness::cases {
namespace {

using testing::gamma64;
using testing::kFastExpError;
constexpr int kIgnore = test_data::kIgnore;

// ---- cross_entropy ------------------------------------------------------------------------------

enum class CeMode { dlogits, loss_only, in_place };

struct CeCfg {
  int N, V, Vp;
  float gs;
  CeMode mode;
  bool grad;
};

Tensors ce_inputs(const CeCfg& c, uint64_t seed) {
  Tensors in;
  // Padding columns hold 50: they would dominate a softmax that wrongly included them.
  in.set("logits", test_data::make_logits(c.N, c.V, c.Vp, seed, c.grad ? 1.0f : 2.0f));
  in.set_ints("targets", test_data::make_targets(c.N, c.V, seed + 1));  // every third ignored
  return in;
}

Outputs ce_run(Backend& b, const Tensors& in, const CeCfg& c, bool with_dlogits) {
  const size_t N = size_t(c.N);
  FBuf logits(b, in.f("logits"));
  IBuf targets(b, in.i("targets"));
  FBuf losses(b, std::vector<float>(N, -5.0f));            // overwritten
  FBuf dl(b, std::vector<float>(N * size_t(c.Vp), 7.0f));  // overwritten
  float* d = !with_dlogits ? nullptr : c.mode == CeMode::in_place ? logits.get() : dl.get();
  const CrossEntropyResult res =
      b.cross_entropy(d, losses.get(), logits.get(), targets.get(), c.N, c.V, c.Vp, kIgnore, c.gs);
  Outputs o{out_of("losses", losses.host()),
            {"loss_sum", {res.loss_sum}},
            {"valid", {double(res.valid)}}};
  if (with_dlogits)
    o.push_back(out_of("dlogits", c.mode == CeMode::in_place ? logits.host() : dl.host()));
  return o;
}

// Both sides against the exact loss and gradient of the float logits [N, Vp] (the first V columns
// real), testing::cross_entropy_row_bound (the backend with fast_exp, the reference with libm,
// both summing in double, with `float_sum_roundings` float roundings of the sum; kernel_bounds.h
// derives it); the losses each rounded to float (u of each), the sums of the rows' double losses
// in row order (gamma64(N) each). Ignored rows and padding columns are exact zeros.
struct CeBounds {
  Output dlogits;
  std::vector<double> losses;
  double loss_sum = 0;
};

CeBounds ce_rows_bounds(const std::vector<float>& logits, const std::vector<int32_t>& targets,
                        int N, int V, int Vp, float gs, int float_sum_roundings) {
  CeBounds b{{"dlogits", std::vector<double>(size_t(N) * Vp, 0.0)},
             std::vector<double>(size_t(N), 0.0)};
  double sum_bound = 0, magnitude = 0;
  for (int n = 0; n < N; ++n) {
    if (targets[n] == kIgnore) continue;
    const float* x = logits.data() + size_t(n) * Vp;
    const int r = float_sum_roundings;
    const auto fast = testing::cross_entropy_row_bound(x, V, targets[n], gs, true, r);
    const auto libm = testing::cross_entropy_row_bound(x, V, targets[n], gs, false, r);
    for (int v = 0; v < V; ++v)
      b.dlogits.values[size_t(n) * Vp + v] = fast.dlogit_error[v] + libm.dlogit_error[v];
    const double both = fast.loss_error + libm.loss_error;
    b.losses[n] = both + u * (2 * std::fabs(fast.loss) + both);
    sum_bound += both;
    magnitude += std::fabs(fast.loss) + both;
  }
  b.loss_sum = sum_bound + 2 * gamma64(N) * magnitude;
  return b;
}

// cross_entropy (cross_entropy_test.cpp): ce_rows_bounds with no float sums; the count exact.
Outputs ce_bounds(const Tensors& in, const CeCfg& c) {
  CeBounds b = ce_rows_bounds(in.f("logits"), in.i("targets"), c.N, c.V, c.Vp, c.gs, 0);
  return {std::move(b.dlogits),
          {"losses", std::move(b.losses)},
          {"loss_sum", {b.loss_sum}},
          zeros("valid", 1)};
}

// The loss is grad_scale times a sum of rows' logsumexp(x) - x_target: along logit v of a valid
// row, d^3/dx_v^3 logsumexp = p (1 - p)(1 - 2p), at most 1 / (6 sqrt 3) in size; 0 for padding
// columns and ignored rows.
double ce_third_derivative(const std::vector<int32_t>& targets, int V, int Vp, float gs, size_t i) {
  const size_t n = i / size_t(Vp), v = i % size_t(Vp);
  if (targets[n] == kIgnore || v >= size_t(V)) return 0.0;
  return std::fabs(gs) / (6 * std::sqrt(3.0));
}

// The gradient mode of a cross-entropy case whose forward gives the loss sum: its dlogits are the
// gradient of grad_scale * loss_sum (weighted by `weights`) with respect to the [N, Vp] logits
// `param`.
GradSpec ce_gradient(const PassFns& forward, const char* param, Output weights, int N, int V,
                     int Vp, float gs) {
  GradSpec g = gradient(
      forward, {{param, "dlogits"}}, [](Tensors&) {},
      [](const Tensors&, std::string_view, size_t) {
        return Deps{{"loss_sum", 0}};
      },
      [V, Vp, gs](const Tensors& in, std::string_view, size_t i, double) {
        return ce_third_derivative(in.i("targets"), V, Vp, gs, i);
      });
  g.weights = [weights](const Tensors&) { return Outputs{weights}; };
  g.samples = N * Vp;
  return g;
}

}  // namespace

void add_cross_entropy(std::vector<OpCase>& out) {
  // Padded Vp > V, ignored rows (every third), V = 1, GPT-2's vocabulary, N = 0, in place and
  // without dlogits.
  const CeCfg cfgs[] = {{1, 1, 1, 1.0f, CeMode::dlogits, false},
                        {7, 3, 8, 0.37f, CeMode::dlogits, false},
                        {33, 67, 67, 1.0f, CeMode::dlogits, false},
                        {5, 1000, 1003, 0.37f, CeMode::dlogits, false},
                        {3, 50257, 50304, 1.0f, CeMode::dlogits, false},
                        {9, 517, 520, 0.5f, CeMode::in_place, false},
                        {9, 517, 520, 0.5f, CeMode::loss_only, false},
                        {0, 5, 8, 1.0f, CeMode::dlogits, false},
                        {4, 6, 8, 0.25f, CeMode::dlogits, true}};
  for (const CeCfg& c : cfgs) {
    const bool with_dlogits = c.mode != CeMode::loss_only;
    Label label("cross_entropy", with_dlogits ? "fwd_bwd" : "fwd");
    label.dim("N", c.N).dim("V", c.V).dim("Vp", c.Vp).dim("gs", int64_t(std::lround(c.gs * 100)));
    if (c.mode == CeMode::in_place) label.flag("in_place");
    auto run = [c](bool dlogits) {
      return PassFns{
          [c, dlogits](Backend& b, const Tensors& in) { return ce_run(b, in, c, dlogits); },
          [c](const Tensors& in, const Outputs&) { return ce_bounds(in, c); }};
    };
    OpCase oc = make_case(Op::cross_entropy, with_dlogits ? Pass::backward : Pass::forward, label,
                          c.N == 0, inputs_of(c, ce_inputs), run(with_dlogits));
    if (c.grad)
      oc.grad = ce_gradient(run(false), "logits", {"loss_sum", {c.gs}}, c.N, c.V, c.Vp, c.gs);
    out.push_back(std::move(oc));
  }
  // The contract: a target outside [0, V) that is not the ignore index throws (5..7 are padding
  // columns, not classes).
  for (int32_t bad : {5, -1}) {
    const CeCfg c{2, 5, 8, 1.0f, CeMode::dlogits, false};
    Label label("cross_entropy", "rejects_target");
    label.flag(bad < 0 ? "negative" : "padding");
    OpCase oc = make_case(Op::cross_entropy, Pass::backward, label);
    oc.expect_invalid_argument = true;
    oc.make_inputs = [c, bad](uint64_t seed) {
      Tensors in = ce_inputs(c, seed);
      in.set_ints("targets", {0, bad});
      return in;
    };
    oc.run = [c](Backend& b, const Tensors& in) { return ce_run(b, in, c, true); };
    out.push_back(std::move(oc));
  }
}

// ---- vocabulary-parallel cross-entropy ----------------------------------------------------------

namespace {

struct VpCfg {
  int N, V, Vp, tp;
  float gs;
  bool grad;
  int rows() const { return Vp / tp; }
  int real(int rank) const { return std::clamp(V - rank * rows(), 0, rows()); }
};

std::vector<float> shard_of(const std::vector<float>& full, const VpCfg& v, int rank) {
  const size_t rows = size_t(v.rows());
  std::vector<float> s(size_t(v.N) * rows);
  for (size_t n = 0; n < size_t(v.N); ++n)
    for (size_t j = 0; j < rows; ++j) s[n * rows + j] = full[n * v.Vp + rank * rows + j];
  return s;
}

// The full [N, Vp] logits and the targets (one of them the last real class, so that the shard
// holding the vocabulary's end owns a target); the reduced statistics as the all-reduces give
// them to step 2 and step 3: row_max the maximum of the real columns (-inf for ignored rows),
// sums the reference's shard sums added in float in rank order.
Tensors vp_inputs(const VpCfg& v, uint64_t seed, int rank) {
  Tensors in;
  auto full = test_data::make_logits(v.N, v.V, v.Vp, seed, v.grad ? 1.0f : 2.0f);
  auto targets = test_data::make_targets(v.N, v.V, seed + 1);
  if (v.N > 0) targets[0] = v.V - 1;
  std::vector<float> row_max(size_t(v.N), -INFINITY), sums(2 * size_t(v.N), 0.0f);
  for (int n = 0; n < v.N; ++n) {
    if (targets[n] == kIgnore) continue;
    for (int j = 0; j < v.V; ++j) row_max[n] = std::fmax(row_max[n], full[size_t(n) * v.Vp + j]);
  }
  for (int r = 0; r < v.tp; ++r) {
    std::vector<float> part(2 * size_t(v.N));
    ref::vp_ce_local_sums(part.data(), shard_of(full, v, r).data(), row_max.data(), targets.data(),
                          v.N, v.V, r * v.rows(), v.rows(), kIgnore);
    for (size_t i = 0; i < sums.size(); ++i) sums[i] += part[i];
  }
  in.set("logits", shard_of(full, v, rank));
  in.set("full", std::move(full));
  in.set_ints("targets", std::move(targets));
  in.set("row_max", std::move(row_max));
  in.set("sums", std::move(sums));
  return in;
}

enum class VpStep { local_max, local_sums, finish };

Outputs vp_step_run(Backend& b, const Tensors& in, const VpCfg& v, int rank, VpStep step) {
  const size_t N = size_t(v.N);
  const int vs = rank * v.rows(), rows = v.rows();
  FBuf logits(b, in.f("logits")), row_max(b, in.f("row_max")), sums(b, in.f("sums"));
  IBuf targets(b, in.i("targets"));
  if (step == VpStep::local_max) {
    FBuf out(b, nans(N));
    b.vp_ce_local_max(out.get(), logits.get(), targets.get(), v.N, v.V, vs, rows, kIgnore);
    return {out_of("row_max", out.host())};
  }
  if (step == VpStep::local_sums) {
    FBuf out(b, nans(2 * N));
    b.vp_ce_local_sums(out.get(), logits.get(), row_max.get(), targets.get(), v.N, v.V, vs, rows,
                       kIgnore);
    return {out_of("sums", out.host())};
  }
  FBuf dl(b, std::vector<float>(N * size_t(rows), 7.0f)), losses(b, std::vector<float>(N, -5.0f));
  const CrossEntropyResult res =
      b.vp_ce_finish(dl.get(), losses.get(), logits.get(), row_max.get(), sums.get(), targets.get(),
                     v.N, v.V, vs, rows, kIgnore, v.gs);
  return {out_of("dlogits", dl.host()),
          out_of("losses", losses.host()),
          {"loss_sum", {res.loss_sum}},
          {"valid", {double(res.valid)}}};
}

// Step 1: a maximum is exact (bound 0), -inf where the shard has no real column or the row is
// ignored.
//
// Step 2, a valid row: each side sums e_v = exp(x_v - mx) over the shard's k real columns in double
// and rounds to float. The backend's e_v: fast_exp at fl(x_v - mx) (exp_error of the argument's
// u |x_v - mx| and kFastExpError); the reference's: libm in double at the exact difference (2^-52).
// A side's double sum is within sum_v e_v rho_v + gamma64(k) sum_v e_v (1 + rho_v) of
// S = sum_v e_v; with the roundings to float, |c - r| <= B' + u |c| + u |r|, so
//   |c - r| <= (B' + 2u |r|) / (1 - u),  B' = sum_v e_v (rho_fast + rho_libm)
//                                               + gamma64(k) sum_v e_v (2 + rho_fast + rho_libm).
// The target logit (second half) is a copy: bound 0.
Outputs vp_sums_bounds(const Tensors& in, const Outputs& ref, const VpCfg& v, int rank) {
  const int rows = v.rows(), real = v.real(rank);
  const auto& x = in.f("logits");
  const auto& mx = in.f("row_max");
  const auto& targets = in.i("targets");
  const auto& r = find(ref, "sums");
  Output s{"sums", std::vector<double>(2 * size_t(v.N), 0.0)};
  for (int n = 0; n < v.N; ++n) {
    if (targets[n] == kIgnore) continue;
    double F = 0, G = 0;
    for (int j = 0; j < real; ++j) {
      const double a = double(x[size_t(n) * rows + j]) - mx[n];
      if (a < -87) throw std::domain_error("vp_ce bound: an exp underflows");
      const double e = std::exp(a);
      const double rf = testing::exp_error(u * std::fabs(a), kFastExpError), rl = 0x1p-52;
      F += e * (rf + rl);
      G += e * (2 + rf + rl);
    }
    s.values[n] = (F + gamma64(real) * G + 2 * u * std::fabs(r[n])) / (1 - u);
  }
  return {s};
}

// Step 3, a valid row, from the reduced S = sums[n], mx = row_max[n] and target logit tl:
//   loss: each side log(S) + mx - tl in double (log within 1 ulp, two roundings):
//     E = 2^-52 |log S| + gamma64(2) (|log S| (1 + 2^-52) + |mx| + |tl|) from the exact value,
//     then rounded to float: (2E + 2u |r|) / (1 - u) as in step 2; the loss sums add each side's
//     row errors and gamma64(N) of the rows' sizes (|r| (1 + 2u) + 2E) each.
//   dlogits, with q_v = exp(x_v - mx) / S exact: the backend's fl(fast_exp(fl(x_v - mx))
//     fl32(gs / S)) (the division in double, to float, the product: rho_fast and three
//     roundings), minus gs at the target (one more); the reference's fl32((e_v / S - [target]) gs)
//     with exp within 2^-52 and three double roundings, then to float (cross_entropy_row_bound's
//     two cases, with S given).
// Ignored rows and padding columns: exact zeros.
Outputs vp_finish_bounds(const Tensors& in, const Outputs& ref, const VpCfg& v, int rank) {
  const int rows = v.rows(), real = v.real(rank), vs = rank * rows;
  const auto& x = in.f("logits");
  const auto& mx = in.f("row_max");
  const auto& sums = in.f("sums");
  const auto& targets = in.i("targets");
  const auto& r = find(ref, "losses");
  const double gs = std::fabs(double(v.gs));
  Output dl{"dlogits", std::vector<double>(size_t(v.N) * rows, 0.0)};
  Output losses{"losses", std::vector<double>(size_t(v.N), 0.0)};
  double sum_bound = 0, magnitude = 0;
  for (int n = 0; n < v.N; ++n) {
    if (targets[n] == kIgnore) continue;
    const double S = sums[n], m = mx[n], tl = sums[size_t(v.N) + n], log_s = std::log(S);
    const double E = 0x1p-52 * std::fabs(log_s) +
                     gamma64(2) * (std::fabs(log_s) * (1 + 0x1p-52) + std::fabs(m) + std::fabs(tl));
    losses.values[n] = (2 * E + 2 * u * std::fabs(r[n])) / (1 - u);
    sum_bound += 2 * E;
    magnitude += std::fabs(r[n]) * (1 + 2 * u) + 2 * E;
    const int local_target = targets[n] - vs;
    for (int j = 0; j < real; ++j) {
      const double a = double(x[size_t(n) * rows + j]) - m;
      if (a < -87) throw std::domain_error("vp_ce bound: an exp underflows");
      const double q = std::exp(a) / S;
      const double rf = testing::exp_error(u * std::fabs(a), kFastExpError);
      const bool is_target = j == local_target;
      const double grad = gs * std::fabs(q - (is_target ? 1.0 : 0.0));
      double fast = gs * q * ((1 + rf) * (1 + u64) * (1 + u) * (1 + u) - 1);
      if (is_target) fast += u * (grad + fast);
      double libm = gs * q * ((1 + 0x1p-52) * (1 + u64) - 1) + gamma64(2) * (grad + gs * q);
      libm += u * (grad + libm);
      dl.values[size_t(n) * rows + j] = fast + libm;
    }
  }
  return {dl, losses, {"loss_sum", {sum_bound + 2 * gamma64(v.N) * magnitude}}, zeros("valid", 1)};
}

// All three steps on tp column shards through the backend, the all-reduces done here in rank
// order (as LocalTpGroup does): every rank's losses, loss sum and count, and the shards' dlogits
// put back together.
Outputs vp_pipeline(Backend& b, const Tensors& in, const VpCfg& v, bool with_dlogits) {
  const size_t N = size_t(v.N), rows = size_t(v.rows());
  const auto& full = in.f("full");
  IBuf targets(b, in.i("targets"));
  std::vector<std::unique_ptr<FBuf>> shards;
  for (int r = 0; r < v.tp; ++r) shards.push_back(std::make_unique<FBuf>(b, shard_of(full, v, r)));
  std::vector<float> gmax(N, -INFINITY), gsums(2 * N, 0.0f);
  FBuf row_max(b, nans(N)), sums(b, nans(2 * N));
  for (int r = 0; r < v.tp; ++r) {
    b.vp_ce_local_max(row_max.get(), shards[r]->get(), targets.get(), v.N, v.V, r * v.rows(),
                      v.rows(), kIgnore);
    const auto part = row_max.host();
    for (size_t n = 0; n < N; ++n) gmax[n] = std::fmax(gmax[n], part[n]);
  }
  row_max.upload(gmax);
  for (int r = 0; r < v.tp; ++r) {
    b.vp_ce_local_sums(sums.get(), shards[r]->get(), row_max.get(), targets.get(), v.N, v.V,
                       r * v.rows(), v.rows(), kIgnore);
    const auto part = sums.host();
    for (size_t i = 0; i < 2 * N; ++i) gsums[i] += part[i];
  }
  sums.upload(gsums);
  Output dl{"dlogits", std::vector<double>(N * v.Vp)}, losses{"losses", {}};
  Output loss_sum{"loss_sum", {}}, valid{"valid", {}};
  for (int r = 0; r < v.tp; ++r) {
    FBuf d(b, std::vector<float>(N * rows, 7.0f)), l(b, std::vector<float>(N, -5.0f));
    const CrossEntropyResult res =
        b.vp_ce_finish(with_dlogits ? d.get() : nullptr, l.get(), shards[r]->get(), row_max.get(),
                       sums.get(), targets.get(), v.N, v.V, r * v.rows(), v.rows(), kIgnore, v.gs);
    const auto part = d.host();
    for (size_t n = 0; n < N; ++n)
      for (size_t j = 0; j < rows; ++j) dl.values[n * v.Vp + r * rows + j] = part[n * rows + j];
    for (float x : l.host()) losses.values.push_back(x);
    loss_sum.values.push_back(res.loss_sum);
    valid.values.push_back(double(res.valid));
  }
  Outputs o{losses, loss_sum, valid};
  if (with_dlogits) o.push_back(dl);
  return o;
}

// The three steps against the exact values (vocab_parallel_ce_test.cpp): ce_rows_bounds with the
// shard sums' tp float roundings; every rank's losses and loss sum alike.
Outputs vp_pipeline_bounds(const Tensors& in, const VpCfg& v) {
  CeBounds b = ce_rows_bounds(in.f("full"), in.i("targets"), v.N, v.V, v.Vp, v.gs, v.tp);
  Output losses{"losses", {}}, loss_sum{"loss_sum", {}};
  for (int r = 0; r < v.tp; ++r) {
    losses.values.insert(losses.values.end(), b.losses.begin(), b.losses.end());
    loss_sum.values.push_back(b.loss_sum);
  }
  return {std::move(b.dlogits), losses, loss_sum, zeros("valid", size_t(v.tp))};
}

}  // namespace

void add_vocab_parallel_ce(std::vector<OpCase>& out) {
  // Vp = 12 split 2 and 3 ways (V = 10: the last shard holds padding; V = 1: two shards of only
  // padding), 384 split 3 ways with V = 257 (the last shard holds one real column), 16 split 4 ways
  // with V = 5 (two padding-only shards), 1032 four ways, GPT-2's vocabulary, N = 0.
  const VpCfg cfgs[] = {{1, 1, 12, 3, 1.0f, false},       {6, 10, 12, 2, 0.37f, false},
                        {9, 257, 384, 3, 1.0f, false},    {4, 5, 16, 4, 1.0f, false},
                        {4, 1000, 1032, 4, 0.37f, false}, {3, 50257, 50304, 2, 1.0f, false},
                        {0, 5, 8, 2, 1.0f, false},        {4, 6, 8, 2, 0.25f, true}};
  for (const VpCfg& v : cfgs) {
    auto label_of = [&](const char* what) {
      Label label("vocab_parallel_ce", what);
      label.dim("N", v.N).dim("V", v.V).dim("Vp", v.Vp).dim("tp", v.tp);
      return label;
    };
    // The three steps one at a time, on every rank's shard (not for GPT-2's vocabulary: the
    // pipeline covers it).
    if (v.Vp < 50000 && !v.grad) {
      for (int rank = 0; rank < v.tp; ++rank) {
        for (VpStep step : {VpStep::local_max, VpStep::local_sums, VpStep::finish}) {
          const char* what = step == VpStep::local_max    ? "local_max"
                             : step == VpStep::local_sums ? "local_sums"
                                                          : "finish";
          Label label = label_of(what);
          label.dim("rank", rank);
          OpCase c = make_case(Op::vocab_parallel_ce,
                               step == VpStep::finish ? Pass::backward : Pass::forward, label);
          c.empty = v.N == 0;
          c.make_inputs = [v, rank](uint64_t seed) { return vp_inputs(v, seed, rank); };
          c.run = [v, rank, step](Backend& b, const Tensors& in) {
            return vp_step_run(b, in, v, rank, step);
          };
          c.bounds = [v, rank, step](const Tensors& in, const Outputs& ref) {
            if (step == VpStep::local_max) return Outputs{zeros("row_max", size_t(v.N))};
            if (step == VpStep::local_sums) return vp_sums_bounds(in, ref, v, rank);
            return vp_finish_bounds(in, ref, v, rank);
          };
          out.push_back(std::move(c));
        }
      }
    }
    Label label = label_of("pipeline");
    label.dim("gs", int64_t(std::lround(v.gs * 100)));
    auto pipeline = [v](bool dlogits) {
      return PassFns{
          [v, dlogits](Backend& b, const Tensors& in) { return vp_pipeline(b, in, v, dlogits); },
          [v](const Tensors& in, const Outputs&) { return vp_pipeline_bounds(in, v); }};
    };
    OpCase c = make_case(
        Op::vocab_parallel_ce, Pass::backward, label, v.N == 0,
        [v](uint64_t seed) { return vp_inputs(v, seed, 0); }, pipeline(true));
    if (v.grad) {
      // The shards' dlogits are the gradient of grad_scale * loss_sum (rank 0's; all agree) of
      // the sharded computation, with respect to the full logits.
      Output weights{"loss_sum", std::vector<double>(size_t(v.tp), 0.0)};
      weights.values[0] = v.gs;
      c.grad = ce_gradient(pipeline(false), "full", weights, v.N, v.V, v.Vp, v.gs);
    }
    out.push_back(std::move(c));
  }
  // The contract: step 1 rejects a target outside [0, V) that is not the ignore index, on a shard
  // that does not hold the bad id's column too.
  {
    const VpCfg v{2, 5, 8, 2, 1.0f, false};
    OpCase c = make_case(Op::vocab_parallel_ce, Pass::forward,
                         Label("vocab_parallel_ce", "local_max_rejects_target"));
    c.expect_invalid_argument = true;
    c.make_inputs = [v](uint64_t seed) {
      Tensors in = vp_inputs(v, seed, 0);
      in.set_ints("targets", {0, 7});
      return in;
    };
    c.run = [v](Backend& b, const Tensors& in) {
      return vp_step_run(b, in, v, 0, VpStep::local_max);
    };
    out.push_back(std::move(c));
  }
}
}  // namespace tessel::kernels::harness::cases
