// The op harness's layernorm and rmsnorm cases (op_harness_cases.h). Their bounds are those of the
// per-op tests, derived in testing/norm_bounds.cpp; the gradient mode's truncation bounds here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/layernorm.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/kernels/rmsnorm.h"
#include "tessel/testing/norm_bounds.h"

namespace tessel::kernels::harness::cases {
namespace {

constexpr float kEps = 1e-5f;

struct NormCfg {
  int N, C;
  bool bias;  // layernorm only (add_norm clears it for rmsnorm)
  bool grad;
};

// The gradient mode's truncation bound for a normalisation along one input of a row. With the
// row's other inputs fixed, the loss is L(t) = A(t) r(t) + const, A(t) = A0 + A1 t (the
// dout-and-weight-weighted sum of the centred or raw inputs) and r = v^(-1/2) with
// v(t) = v0 + v1 t + v2 t^2 (the row's variance or mean square plus eps; v2 >= 0, v >= eps).
// A'' = v''' = 0, so
//   L''' = A r''' + 3 A1 r'',   r'' = 3/4 v^(-5/2) v'^2 - 1/2 v^(-3/2) v'',
//   r''' = -15/8 v^(-7/2) v'^3 + 9/4 v^(-5/2) v' v'',
// bounded over |t| <= h by v >= vmin (the quadratic's least value there, and >= eps) and
// |v'| <= |v1| + 2 v2 h.
double norm_third_derivative(double A0, double A1, double v0, double v1, double v2, double h,
                             double eps) {
  auto v = [&](double t) { return v0 + v1 * t + v2 * t * t; };
  double vmin = std::min(v(-h), v(h));
  if (v2 > 0 && std::fabs(v1) <= 2 * v2 * h) vmin = std::min(vmin, v0 - v1 * v1 / (4 * v2));
  vmin = std::max(vmin, eps);
  const double dv = std::fabs(v1) + 2 * v2 * h, ddv = 2 * v2;
  const double r2 = 0.75 * std::pow(vmin, -2.5) * dv * dv + 0.5 * std::pow(vmin, -1.5) * ddv;
  const double r3 =
      1.875 * std::pow(vmin, -3.5) * dv * dv * dv + 2.25 * std::pow(vmin, -2.5) * dv * ddv;
  return (std::fabs(A0) + std::fabs(A1) * h) * r3 + 3 * std::fabs(A1) * r2;
}

// The outputs of a row-wise normalisation that depend on one input: the row for an input, the
// column for a weight or bias.
Deps norm_dependents(const NormCfg& d, std::string_view param, size_t i) {
  Deps deps;
  const size_t C = size_t(d.C);
  if (param == "inp") {
    const size_t row = i / C;
    for (size_t c = 0; c < C; ++c) deps.emplace_back("out", row * C + c);
  } else {
    for (size_t n = 0; n < size_t(d.N); ++n) deps.emplace_back("out", n * C + i);
  }
  return deps;
}

// The inputs of both normalisations (layernorm adds a bias and its gradient, seeds + 2 and + 6).
Tensors norm_inputs(const NormCfg& d, uint64_t seed) {
  const size_t NC = size_t(d.N) * d.C, C = size_t(d.C);
  Tensors in;
  in.set("inp", normal(NC, seed));
  in.set("weight", normal(C, seed + 1));
  in.set("dout", normal(NC, seed + 3));
  in.set("dinp", normal(NC, seed + 4));
  in.set("dweight", normal(C, seed + 5));
  return in;
}

// ---- layernorm ----------------------------------------------------------------------------------

void layernorm_stats(Tensors& in, const NormCfg& d) {
  const size_t NC = size_t(d.N) * d.C;
  std::vector<float> out(NC), mean(size_t(d.N)), rstd(size_t(d.N));
  ref::layernorm_forward(out.data(), mean.data(), rstd.data(), in.f("inp").data(),
                         in.f("weight").data(), d.bias ? in.f("bias").data() : nullptr, d.N, d.C,
                         kEps);
  in.set("mean", std::move(mean));
  in.set("rstd", std::move(rstd));
}

Tensors layernorm_inputs(const NormCfg& d, uint64_t seed) {
  Tensors in = norm_inputs(d, seed);
  // Rows with a common offset, so that a one-pass E[x^2] - E[x]^2 variance would show.
  auto& inp = in.f("inp");
  for (size_t i = 0; i < inp.size(); ++i) inp[i] += 3.0f + float(i % 5);
  in.set("bias", normal(size_t(d.C), seed + 2));
  in.set("dbias", normal(size_t(d.C), seed + 6));
  layernorm_stats(in, d);
  return in;
}

Outputs layernorm_fwd(Backend& b, const Tensors& in, const NormCfg& d) {
  const size_t NC = size_t(d.N) * d.C, N = size_t(d.N);
  FBuf inp(b, in.f("inp")), weight(b, in.f("weight")), bias(b, in.f("bias"));
  FBuf out(b, nans(NC)), mean(b, nans(N)), rstd(b, nans(N));
  b.layernorm_forward(out.get(), mean.get(), rstd.get(), inp.get(), weight.get(),
                      d.bias ? bias.get() : nullptr, d.N, d.C, kEps);
  return {out_of("out", out.host()), out_of("mean", mean.host()), out_of("rstd", rstd.host())};
}

Outputs layernorm_bwd(Backend& b, const Tensors& in, const NormCfg& d) {
  FBuf dout(b, in.f("dout")), inp(b, in.f("inp")), weight(b, in.f("weight"));
  FBuf mean(b, in.f("mean")), rstd(b, in.f("rstd"));
  FBuf dinp(b, in.f("dinp")), dweight(b, in.f("dweight")), dbias(b, in.f("dbias"));
  b.layernorm_backward(dinp.get(), dweight.get(), d.bias ? dbias.get() : nullptr, dout.get(),
                       inp.get(), weight.get(), mean.get(), rstd.get(), d.N, d.C);
  Outputs o{out_of("dinp", dinp.host()), out_of("dweight", dweight.host())};
  if (d.bias) o.push_back(out_of("dbias", dbias.host()));
  return o;
}

Outputs layernorm_fwd_bounds(const Tensors& in, const Outputs&, const NormCfg& d) {
  const std::span<const float> bias = d.bias ? in.f("bias") : std::span<const float>();
  auto b = testing::layernorm_forward_bounds(in.f("inp"), in.f("weight"), bias, d.N, d.C, kEps);
  return {{"out", std::move(b.out)}, {"mean", std::move(b.mean)}, {"rstd", std::move(b.rstd)}};
}

// Both sides are given the same mean and rstd (the reference forward's).
Outputs layernorm_bwd_bounds(const Tensors& in, const Outputs&, const NormCfg& d) {
  auto b = testing::layernorm_backward_bounds(in.f("inp"), in.f("weight"), in.f("dout"),
                                              in.f("mean"), in.f("rstd"), in.f("dinp"),
                                              in.f("dweight"), in.f("dbias"), d.N, d.C);
  return {{"dinp", std::move(b.dinp)},
          {"dweight", std::move(b.dweight)},
          {"dbias", std::move(b.dbias)}};
}

// Along input c of row n: d_j(t) = x_j - mean(t) + [j = c] t with mean(t) = mean + t / C, so
// A(t) = sum_j dout_j w_j d_j(t) has A1 = dout_c w_c - sum_j dout_j w_j / C, and
// v(t) = sum_j d_j(t)^2 / C + eps has v1 = 2 d_c / C (the d_j sum to 0) and v2 = (1 - 1/C) / C.
double layernorm_third_derivative(const Tensors& in, const NormCfg& d, std::string_view param,
                                  size_t i, double h) {
  if (param != "inp") return 0.0;  // affine in weight and bias
  const int C = d.C;
  const size_t row = i / size_t(C), c = i % size_t(C);
  const float* x = in.f("inp").data() + row * C;
  const float* dout = in.f("dout").data() + row * C;
  const auto& w = in.f("weight");
  double m = 0;
  for (int j = 0; j < C; ++j) m += x[j];
  m /= C;
  double ss = 0, A0 = 0, cw_sum = 0;
  for (int j = 0; j < C; ++j) {
    ss += (x[j] - m) * (x[j] - m);
    A0 += double(dout[j]) * w[j] * (x[j] - m);
    cw_sum += double(dout[j]) * w[j];
  }
  const double A1 = double(dout[c]) * w[c] - cw_sum / C;
  return norm_third_derivative(A0, A1, ss / C + kEps, 2 * (x[c] - m) / C, (1 - 1.0 / C) / C, h,
                               kEps);
}

// ---- rmsnorm ------------------------------------------------------------------------------------

void rmsnorm_stats(Tensors& in, const NormCfg& d) {
  std::vector<float> out(size_t(d.N) * d.C), rstd(size_t(d.N));
  ref::rmsnorm_forward(out.data(), rstd.data(), in.f("inp").data(), in.f("weight").data(), d.N, d.C,
                       kEps);
  in.set("rstd", std::move(rstd));
}

Tensors rmsnorm_inputs(const NormCfg& d, uint64_t seed) {
  Tensors in = norm_inputs(d, seed);
  rmsnorm_stats(in, d);
  return in;
}

Outputs rmsnorm_fwd(Backend& b, const Tensors& in, const NormCfg& d) {
  FBuf inp(b, in.f("inp")), weight(b, in.f("weight"));
  FBuf out(b, nans(size_t(d.N) * d.C)), rstd(b, nans(size_t(d.N)));
  b.rmsnorm_forward(out.get(), rstd.get(), inp.get(), weight.get(), d.N, d.C, kEps);
  return {out_of("out", out.host()), out_of("rstd", rstd.host())};
}

Outputs rmsnorm_bwd(Backend& b, const Tensors& in, const NormCfg& d) {
  FBuf dout(b, in.f("dout")), inp(b, in.f("inp")), weight(b, in.f("weight"));
  FBuf rstd(b, in.f("rstd")), dinp(b, in.f("dinp")), dweight(b, in.f("dweight"));
  b.rmsnorm_backward(dinp.get(), dweight.get(), dout.get(), inp.get(), weight.get(), rstd.get(),
                     d.N, d.C);
  return {out_of("dinp", dinp.host()), out_of("dweight", dweight.host())};
}

Outputs rmsnorm_fwd_bounds(const Tensors& in, const Outputs&, const NormCfg& d) {
  auto b = testing::rmsnorm_forward_bounds(in.f("inp"), in.f("weight"), d.N, d.C, kEps);
  return {{"out", std::move(b.out)}, {"rstd", std::move(b.rstd)}};
}

// Both sides are given the same rstd (the reference forward's).
Outputs rmsnorm_bwd_bounds(const Tensors& in, const Outputs&, const NormCfg& d) {
  auto b = testing::rmsnorm_backward_bounds(in.f("inp"), in.f("weight"), in.f("dout"), in.f("rstd"),
                                            in.f("dinp"), in.f("dweight"), d.N, d.C);
  return {{"dinp", std::move(b.dinp)}, {"dweight", std::move(b.dweight)}};
}

// Along input c of row n: A(t) = sum_j dout_j w_j x_j(t) has A1 = dout_c w_c, and
// v(t) = sum_j x_j(t)^2 / C + eps has v1 = 2 x_c / C and v2 = 1 / C.
double rmsnorm_third_derivative(const Tensors& in, const NormCfg& d, std::string_view param,
                                size_t i, double h) {
  if (param != "inp") return 0.0;  // affine in weight
  const int C = d.C;
  const size_t row = i / size_t(C), c = i % size_t(C);
  const float* x = in.f("inp").data() + row * C;
  const float* dout = in.f("dout").data() + row * C;
  const auto& w = in.f("weight");
  double ss = 0, A0 = 0;
  for (int j = 0; j < C; ++j) {
    ss += double(x[j]) * x[j];
    A0 += double(dout[j]) * w[j] * x[j];
  }
  return norm_third_derivative(A0, double(dout[c]) * w[c], ss / C + kEps, 2.0 * x[c] / C, 1.0 / C,
                               h, kEps);
}

// ---- both ---------------------------------------------------------------------------------------

// A normalisation's functions: the two families differ only in these.
struct NormOps {
  Op op;
  Tensors (*inputs)(const NormCfg&, uint64_t);
  Outputs (*fwd)(Backend&, const Tensors&, const NormCfg&);
  Outputs (*bwd)(Backend&, const Tensors&, const NormCfg&);
  Outputs (*fwd_bounds)(const Tensors&, const Outputs&, const NormCfg&);
  Outputs (*bwd_bounds)(const Tensors&, const Outputs&, const NormCfg&);
  void (*stats)(Tensors&, const NormCfg&);  // the backward's saved statistics from the inputs
  double (*third_derivative)(const Tensors&, const NormCfg&, std::string_view, size_t, double);
};

void add_norm(std::vector<OpCase>& out, const NormOps& ops) {
  // 64 x 768 crosses the cpu kernels' parallel threshold; C = 1 has zero variance.
  const NormCfg cfgs[] = {{1, 1, true, false},   {7, 3, true, false},    {33, 67, false, false},
                          {5, 129, true, false}, {64, 768, true, false}, {0, 7, true, false},
                          {3, 5, true, true},    {2, 1, false, true}};
  const bool layernorm = ops.op == Op::layernorm;
  for (NormCfg d : cfgs) {
    d.bias = d.bias && layernorm;
    Label label(op_name(ops.op), "");
    label.dim("N", d.N).dim("C", d.C);
    if (layernorm) label.flag(d.bias ? "bias" : "nobias");
    const PassFns fwd = pass_fns(d, ops.fwd, ops.fwd_bounds);
    std::optional<GradSpec> grad;
    if (d.grad) {
      Params params = {{"inp", "dinp"}, {"weight", "dweight"}};
      if (d.bias) params.push_back({"bias", "dbias"});
      grad = gradient(
          fwd, params,
          [d, stats = ops.stats](Tensors& in) {
            stats(in, d);
            zero(in, {"dinp", "dweight", "dbias"});
          },
          [d](const Tensors&, std::string_view param, size_t i) {
            return norm_dependents(d, param, i);
          },
          [d, third = ops.third_derivative](const Tensors& in, std::string_view param, size_t i,
                                            double h) { return third(in, d, param, i, h); });
    }
    add_fwd_bwd(out, ops.op, label, d.N == 0, inputs_of(d, ops.inputs), fwd,
                pass_fns(d, ops.bwd, ops.bwd_bounds), std::move(grad));
  }
}

}  // namespace

void add_layernorm(std::vector<OpCase>& out) {
  add_norm(out,
           {Op::layernorm, layernorm_inputs, layernorm_fwd, layernorm_bwd, layernorm_fwd_bounds,
            layernorm_bwd_bounds, layernorm_stats, layernorm_third_derivative});
}

void add_rmsnorm(std::vector<OpCase>& out) {
  add_norm(out, {Op::rmsnorm, rmsnorm_inputs, rmsnorm_fwd, rmsnorm_bwd, rmsnorm_fwd_bounds,
                 rmsnorm_bwd_bounds, rmsnorm_stats, rmsnorm_third_derivative});
}

}  // namespace tessel::kernels::harness::cases
