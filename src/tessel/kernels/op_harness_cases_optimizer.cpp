// The op harness's adamw_update, sum_of_squares and scale cases (op_harness_cases.h), with their
// bounds.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessel/kernels/op_harness_cases.h"
#include "tessel/kernels/optimizer.h"
#include "tessel/testing/adam_divergence.h"
#include "tessel/testing/kernel_bounds.h"

namespace tessel::kernels::harness::cases {
namespace {

using testing::gamma64;

struct AdamCfg {
  int64_t n;
  int steps;      // consecutive updates with given gradients
  int64_t step0;  // the first update's (1-based) step
  float lr, wd, gs;
  bool zero_grad;
  bool moments;  // start from random moments (else zeros)
};

AdamWConfig adam_config(const AdamCfg& a, int64_t step) {
  AdamWConfig cfg;
  cfg.lr = a.lr;
  cfg.beta1 = 0.9f;
  cfg.beta2 = 0.95f;
  cfg.eps = 1e-8f;
  cfg.weight_decay = a.wd;
  cfg.step = step;
  cfg.grad_scale = a.gs;
  cfg.zero_grad = a.zero_grad;
  return cfg;
}

Tensors adam_inputs(const AdamCfg& a, uint64_t seed) {
  const size_t n = size_t(a.n);
  Tensors in;
  in.set("param", normal(n, seed));
  in.set("m", a.moments ? normal(n, seed + 1, 0.1f) : std::vector<float>(n, 0.0f));
  auto v = a.moments ? normal(n, seed + 2, 0.1f) : std::vector<float>(n, 0.0f);
  for (float& x : v) x *= x;
  in.set("v", std::move(v));
  for (int s = 1; s <= a.steps; ++s) {
    auto g = normal(n, seed + 10 + uint64_t(s), 0.1f);
    if (n > 1) g[1] = 0.0f;  // no gradient: only decay and momentum move it
    in.set("grad" + std::to_string(s), std::move(g));
  }
  return in;
}

Outputs adam_run(Backend& b, const Tensors& in, const AdamCfg& a) {
  FBuf p(b, in.f("param")), m(b, in.f("m")), v(b, in.f("v")), g(b, in.f("grad1"));
  for (int s = 1; s <= a.steps; ++s) {
    g.upload(in.f("grad" + std::to_string(s)));
    const AdamWConfig cfg = adam_config(a, a.step0 + s - 1);
    b.adamw_update(p.get(), g.get(), m.get(), v.get(), a.n, cfg);
  }
  return {out_of("param", p.host()), out_of("m", m.host()), out_of("v", v.host()),
          out_of("grad", g.host())};
}

// testing::AdamDivergence with no difference in the gradients (delta = 0) from the same moments:
// it bounds the float32 rounding of both runs' moments, step and update, step by step (exact for
// one step; over several steps with the gradients given, as here). The reference's parameters
// before each step come from ref::adamw_update on the host. The gradient buffer is either zeroed
// (zero_grad) or left alone: bound 0.
Outputs adam_bounds(const Tensors& in, const Outputs&, const AdamCfg& a) {
  const size_t n = size_t(a.n);
  testing::AdamDivergence div(in.f("m"), in.f("v"), 0.9f, 0.95f, 1e-8f);
  std::vector<float> p = in.f("param"), m = in.f("m"), v = in.f("v");
  const std::vector<double> same(n, 0.0);
  for (int s = 1; s <= a.steps; ++s) {
    const AdamWConfig cfg = adam_config(a, a.step0 + s - 1);
    std::vector<float> g = in.f("grad" + std::to_string(s));
    div.step(g, cfg.grad_scale, same, p, cfg.lr, cfg.weight_decay, cfg.step);
    ref::adamw_update(p.data(), g.data(), m.data(), v.data(), a.n, cfg);
  }
  auto vec = [](std::span<const double> s) { return std::vector<double>(s.begin(), s.end()); };
  return {{"param", vec(div.bounds())},
          {"m", vec(div.m_bounds())},
          {"v", vec(div.v_bounds())},
          zeros("grad", n)};
}

// sum_of_squares and scale: one vector of n elements.
Tensors vector_inputs(const int64_t& n, uint64_t seed) {
  Tensors in;
  in.set("x", normal(size_t(n), seed));
  return in;
}

Outputs sum_of_squares_run(Backend& b, const Tensors& in, const int64_t& n) {
  FBuf x(b, in.f("x"));
  return {{"sum", {b.sum_of_squares(x.get(), n)}}};
}

// The products of two floats are exact in double (48 bits), so each side sums n exact positive
// terms in double, in any order within gamma64(n - 1) S of S = sum x^2 (rounding.h with the
// float64 unit roundoff); S <= r / (1 - gamma64(n)) from the reference's r: bound
// 2 gamma64(n) r / (1 - gamma64(n)). (A backend summing in float breaks the contract of
// optimizer.h and fails.)
Outputs sum_of_squares_bounds(const Tensors&, const Outputs& ref, const int64_t& n) {
  const double g = gamma64(n), r = find(ref, "sum")[0];
  return {{"sum", {2 * g * r / (1 - g)}}};
}

Outputs scale_run(Backend& b, const Tensors& in, const int64_t& n) {
  FBuf x(b, in.f("x"));
  b.scale(x.get(), n, 0.3f);
  return {out_of("x", x.host())};
}

// One float multiply per element, the same bits everywhere (bound 0).
Outputs scale_bounds(const Tensors&, const Outputs&, const int64_t& n) {
  return {zeros("x", size_t(n))};
}

}  // namespace

void add_optimizer(std::vector<OpCase>& out) {
  // Tiny, odd (the cpu kernel's 8-wide tail), above its parallel threshold (65536), n = 0.
  const int64_t sizes[] = {0, 1, 7, 33, 1000, 70001};
  for (int64_t n : sizes) {
    // The first step from zero moments; a later step from random moments with weight decay, a
    // clipping factor and zero_grad; three steps in a row.
    const AdamCfg cfgs[] = {{n, 1, 1, 1e-3f, 0.0f, 1.0f, false, false},
                            {n, 1, 4, 0.05f, 0.1f, 0.37f, true, true},
                            {n, 3, 1, 0.05f, 0.1f, 1.0f, false, false}};
    for (const AdamCfg& a : cfgs) {
      Label label("adamw", "update");
      label.dim("n", a.n).dim("steps", a.steps).dim("step", a.step0);
      if (a.wd > 0) label.flag("decay");
      if (a.gs != 1.0f) label.flag("scaled");
      if (a.zero_grad) label.flag("zero_grad");
      out.push_back(make_case(Op::adamw, Pass::forward, label, a.n == 0, inputs_of(a, adam_inputs),
                              pass_fns(a, adam_run, adam_bounds)));
    }
  }
  for (int64_t n : {0, 1, 7, 33, 65539, 300007}) {
    out.push_back(make_case(
        Op::grad_norm, Pass::forward, Label("sum_of_squares", "fwd").dim("n", n), n == 0,
        inputs_of(n, vector_inputs), pass_fns(n, sum_of_squares_run, sum_of_squares_bounds)));
  }
  for (int64_t n : {0, 1, 7, 33, 70001}) {
    out.push_back(make_case(Op::grad_norm, Pass::forward, Label("scale", "fwd").dim("n", n), n == 0,
                            inputs_of(n, vector_inputs), pass_fns(n, scale_run, scale_bounds)));
  }
}

}  // namespace tessel::kernels::harness::cases
