// The op harness's attention and rope cases (op_harness_cases.h). Their bounds are those of the
// per-op tests, derived in testing/attention_bounds.cpp; the gradient mode's here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/attention.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/kernels/rope.h"
#include "tessel/testing/attention_bounds.h"

namespace tessel::kernels::harness::cases {
namespace {

using testing::QkvLayout;

// ---- attention ----------------------------------------------------------------------------------

struct AttnCfg {
  int B, T, Hq, Hkv, D;
  bool fused;  // q, k, v (and their gradients) interleaved per token in one buffer (QkvLayout)
  bool grad;
  testing::AttentionShape shape() const { return {B, T, Hq, Hkv, D, fused}; }
};

bool valid_heads(const AttnCfg& c) {
  return c.Hkv > 0 && c.Hq % c.Hkv == 0;
}

void attention_probs(Tensors& in, const AttnCfg& c) {
  const QkvLayout L(c.shape());
  std::vector<float> out(size_t(c.B) * c.T * c.Hq * c.D), probs(size_t(c.B) * c.Hq * c.T * c.T);
  const float* qkv = in.f("qkv").data();
  if (valid_heads(c)) {
    ref::attention_forward(out.data(), probs.data(), qkv + L.q_off, qkv + L.k_off, qkv + L.v_off,
                           c.B, c.T, c.Hq, c.Hkv, c.D, L.q_stride, L.kv_stride);
  }
  in.set("probs", std::move(probs));
}

Tensors attention_inputs(const AttnCfg& c, uint64_t seed) {
  const QkvLayout L(c.shape());
  Tensors in;
  in.set("qkv", normal(size_t(L.size), seed));
  in.set("dout", normal(size_t(c.B) * c.T * c.Hq * c.D, seed + 1));
  in.set("dqkv", normal(size_t(L.size), seed + 2));
  attention_probs(in, c);  // the backward's saved softmax: the reference forward's
  return in;
}

Outputs attention_fwd(Backend& b, const Tensors& in, const AttnCfg& c) {
  const QkvLayout L(c.shape());
  FBuf qkv(b, in.f("qkv"));
  FBuf out(b, nans(size_t(c.B) * c.T * c.Hq * c.D)), probs(b, nans(size_t(c.B) * c.Hq * c.T * c.T));
  b.attention_forward(out.get(), probs.get(), qkv.get() + L.q_off, qkv.get() + L.k_off,
                      qkv.get() + L.v_off, c.B, c.T, c.Hq, c.Hkv, c.D, L.q_stride, L.kv_stride);
  return {out_of("out", out.host()), out_of("probs", probs.host())};
}

Outputs attention_bwd(Backend& b, const Tensors& in, const AttnCfg& c) {
  const QkvLayout L(c.shape());
  FBuf qkv(b, in.f("qkv")), dout(b, in.f("dout")), probs(b, in.f("probs")), dqkv(b, in.f("dqkv"));
  const float* base = qkv.get();
  float* g = dqkv.get();
  b.attention_backward(g + L.q_off, g + L.k_off, g + L.v_off, dout.get(), probs.get(),
                       base + L.q_off, base + L.k_off, base + L.v_off, c.B, c.T, c.Hq, c.Hkv, c.D,
                       L.q_stride, L.kv_stride);
  return {out_of("dqkv", dqkv.host())};
}

Outputs attention_fwd_bounds(const Tensors& in, const Outputs&, const AttnCfg& c) {
  auto b = testing::attention_forward_bounds(c.shape(), in.f("qkv"));
  return {{"out", std::move(b.out)}, {"probs", std::move(b.probs)}};
}

// Both sides are given the same probabilities (the reference forward's) and add into the same
// pre-filled buffer dqkv.
Outputs attention_bwd_bounds(const Tensors& in, const Outputs&, const AttnCfg& c) {
  return {{"dqkv", testing::attention_backward_bounds(c.shape(), in.f("qkv"), in.f("probs"),
                                                      in.f("dout"), in.f("dqkv"))}};
}

// Which of q, k, v (or padding) element i of the qkv buffer is.
struct Where {
  char kind;  // 'q', 'k', 'v', or 'p' for padding
  int b, t, head, d;
};

Where locate(const AttnCfg& c, const QkvLayout& L, size_t index) {
  const int64_t i = int64_t(index), qw = int64_t(c.Hq) * c.D, kvw = int64_t(c.Hkv) * c.D;
  auto at = [&](char kind, int64_t row, int64_t col) {
    return Where{kind, int(row / c.T), int(row % c.T), int(col / c.D), int(col % c.D)};
  };
  if (c.fused) {
    const int64_t row = i / L.q_stride, col = i % L.q_stride;
    if (col < qw) return at('q', row, col);
    if (col < qw + kvw) return at('k', row, col - qw);
    return at('v', row, col - qw - kvw);
  }
  if (i < L.k_off) {
    const int64_t row = i / L.q_stride, col = i % L.q_stride;
    return col == qw ? Where{'p', 0, 0, 0, 0} : at('q', row, col);
  }
  const char kind = i < L.v_off ? 'k' : 'v';
  const int64_t j = i - (kind == 'k' ? L.k_off : L.v_off);
  const int64_t row = j / L.kv_stride, col = j % L.kv_stride;
  return col == kvw ? Where{'p', 0, 0, 0, 0} : at(kind, row, col);
}

// The gradient mode's truncation bound. Along an element of q in row (b, h, t), or of k, the row's
// scores move linearly, s_j(x) = s_j + beta_j x, and the loss part of the row is
// f = sum_j a_j p_j with a_j = sum_d w_d v_jd and p = softmax(s): an exponential family in x, so
// f' = Cov(a, beta), f'' = E[a~ beta~^2] and f''' = E[a~ beta~^3] - 3 E[a~ beta~] E[beta~^2]
// (a~ = a - E a, beta~ = beta - E beta, expectations under p). With R_a and R_b the ranges of a and
// beta over the row's keys, |a~| <= R_a, |beta~| <= R_b, |E[a~ beta~]| <= R_a R_b / 4 and
// E[beta~^2] <= R_b^2 / 4 (Popoviciu), whatever p is: |f'''| <= (1 + 3/16) R_a R_b^3 on the whole
// line. An element of q moves one row (beta_j = scale k_jd); an element of k_j moves score j of
// every later row of every head of its group (beta_j = scale q_td, the row's other beta 0). The
// loss is linear in v.
double attention_third_derivative(const Tensors& in, const AttnCfg& c, size_t index) {
  const QkvLayout L(c.shape());
  const Where w = locate(c, L, index);
  if (w.kind == 'v' || w.kind == 'p') return 0.0;
  const std::vector<float>& qkv = in.f("qkv");
  const std::vector<float>& dout = in.f("dout");
  const int group = c.Hq / c.Hkv, D = c.D, T = c.T;
  const double scale = 1.0 / std::sqrt(double(D));
  auto q_at = [&](int t, int h) { return L.q_off + (int64_t(w.b) * T + t) * L.q_stride + h * D; };
  auto kv_at = [&](int64_t off, int j, int hk) {
    return off + (int64_t(w.b) * T + j) * L.kv_stride + hk * D;
  };
  // The range of a_j = sum_d dout[b, t, h, d] v[b, j, hk, d] over the keys j <= t.
  auto range_a = [&](int t, int h) {
    const float* wo = dout.data() + (size_t(w.b) * T + t) * c.Hq * D + size_t(h) * D;
    double lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j <= t; ++j) {
      double a = 0;
      for (int d = 0; d < D; ++d) a += double(wo[d]) * qkv[kv_at(L.v_off, j, h / group) + d];
      lo = std::min(lo, a), hi = std::max(hi, a);
    }
    return hi - lo;
  };
  constexpr double k19_16 = 19.0 / 16.0;
  if (w.kind == 'q') {
    double lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j <= w.t; ++j) {
      const double beta = scale * qkv[kv_at(L.k_off, j, w.head / group) + w.d];
      lo = std::min(lo, beta), hi = std::max(hi, beta);
    }
    return k19_16 * range_a(w.t, w.head) * std::pow(hi - lo, 3);
  }
  double sum = 0;  // k_j: every row t >= j with another key besides j
  for (int h = w.head * group; h < (w.head + 1) * group; ++h) {
    for (int t = std::max(w.t, 1); t < T; ++t) {
      const double beta = std::fabs(scale * qkv[q_at(t, h) + w.d]);
      sum += k19_16 * range_a(t, h) * beta * beta * beta;
    }
  }
  return sum;
}

// out[b, t, h, :] depends on q[b, t, h, :] and on k and v of the keys j <= t of its kv head; an
// element v[b, j, hk, d] reaches only column d.
Deps attention_dependents(const AttnCfg& c, size_t index) {
  const QkvLayout L(c.shape());
  const Where w = locate(c, L, index);
  Deps deps;
  auto row = [&](int t, int h) { return (size_t(w.b) * c.T + t) * c.Hq * c.D + size_t(h) * c.D; };
  if (w.kind == 'q') {
    for (int d = 0; d < c.D; ++d) deps.emplace_back("out", row(w.t, w.head) + d);
  } else if (w.kind != 'p') {
    const int group = c.Hq / c.Hkv;
    for (int h = w.head * group; h < (w.head + 1) * group; ++h) {
      for (int t = w.t; t < c.T; ++t) {
        if (w.kind == 'v') {
          deps.emplace_back("out", row(t, h) + w.d);
        } else {
          for (int d = 0; d < c.D; ++d) deps.emplace_back("out", row(t, h) + d);
        }
      }
    }
  }
  return deps;
}

}  // namespace

void add_attention(std::vector<OpCase>& out) {
  // GQA (Hkv < Hq), MQA (Hkv = 1), odd head sizes, fused (strided) and separate (padded) q/kv,
  // T across the cpu kernel's query and key blocks, and B = 0, T = 0.
  const AttnCfg cfgs[] = {{1, 1, 1, 1, 8, true, false},    {2, 2, 3, 3, 8, false, false},
                          {2, 13, 4, 2, 16, true, false},  {1, 33, 6, 1, 8, false, false},
                          {2, 7, 4, 2, 5, false, false},   {1, 70, 3, 1, 24, true, false},
                          {1, 129, 2, 1, 16, true, false}, {0, 5, 2, 1, 8, true, false},
                          {2, 0, 2, 2, 8, false, false},   {2, 5, 4, 2, 4, true, true},
                          {1, 6, 3, 1, 3, false, true}};
  for (const AttnCfg& a : cfgs) {
    Label label("attention", "");
    label.dim("B", a.B).dim("T", a.T).dim("Hq", a.Hq).dim("Hkv", a.Hkv).dim("D", a.D);
    label.flag(a.fused ? "fused" : "separate");
    const PassFns fwd = pass_fns(a, attention_fwd, attention_fwd_bounds);
    std::optional<GradSpec> grad;
    if (a.grad) {
      grad = gradient(
          fwd, {{"qkv", "dqkv"}},
          [a](Tensors& in) {
            attention_probs(in, a);
            zero(in, {"dqkv"});
          },
          [a](const Tensors&, std::string_view, size_t i) { return attention_dependents(a, i); },
          [a](const Tensors& in, std::string_view, size_t i, double) {
            return attention_third_derivative(in, a, i);
          });
      grad->samples = 48;
    }
    add_fwd_bwd(out, Op::attention, label, a.B * a.T == 0, inputs_of(a, attention_inputs), fwd,
                pass_fns(a, attention_bwd, attention_bwd_bounds), std::move(grad));
  }
  // The contract: query heads not a multiple of the key/value heads, and no heads at all, throw.
  const AttnCfg bad[] = {{1, 2, 3, 2, 4, true, false}, {1, 2, 0, 0, 4, true, false}};
  for (const AttnCfg& a : bad) {
    for (Pass pass : {Pass::forward, Pass::backward}) {
      Label label("attention", pass == Pass::forward ? "fwd_rejects" : "bwd_rejects");
      label.dim("Hq", a.Hq).dim("Hkv", a.Hkv);
      auto run = pass == Pass::forward ? attention_fwd : attention_bwd;
      OpCase c = make_case(Op::attention, pass, label, a.Hq == 0, inputs_of(a, attention_inputs),
                           {[a, run](Backend& b, const Tensors& in) { return run(b, in, a); }, {}});
      c.expect_invalid_argument = true;
      out.push_back(std::move(c));
    }
  }
}

// ---- rope ---------------------------------------------------------------------------------------

namespace {

struct RopeCfg {
  int B, T, H, D;
  int64_t stride;  // floats between tokens; > H*D leaves a gap the kernel must not touch
  float theta;
  bool grad;
};

Tensors rope_inputs(const RopeCfg& r, uint64_t seed) {
  const size_t n = size_t(r.B) * r.T * size_t(r.stride);
  Tensors in;
  in.set("x", normal(n, seed));
  in.set("dx", normal(n, seed + 1));
  return in;
}

// Forward rotates x in place, backward the upstream gradient dx (rope.h).
Outputs rope_fwd(Backend& b, const Tensors& in, const RopeCfg& r) {
  FBuf x(b, in.f("x"));
  b.rope_forward(x.get(), r.B, r.T, r.H, r.D, r.stride, r.theta);
  return {out_of("x", x.host())};
}

Outputs rope_bwd(Backend& b, const Tensors& in, const RopeCfg& r) {
  FBuf dx(b, in.f("dx"));
  b.rope_backward(dx.get(), r.B, r.T, r.H, r.D, r.stride, r.theta);
  return {out_of("dx", dx.host())};
}

Outputs rope_fwd_bounds(const Tensors& in, const Outputs&, const RopeCfg& r) {
  return {{"x", testing::rope_bounds(in.f("x"), r.B, r.T, r.H, r.D, r.stride, r.theta)}};
}

Outputs rope_bwd_bounds(const Tensors& in, const Outputs&, const RopeCfg& r) {
  return {{"dx", testing::rope_bounds(in.f("dx"), r.B, r.T, r.H, r.D, r.stride, r.theta)}};
}

// Rotation pairs element i of a head with i +- D/2; the gaps pass through.
Deps rope_dependents(const RopeCfg& r, size_t index) {
  const int64_t i = int64_t(index), col = i % r.stride, base = i - col;
  if (col >= int64_t(r.H) * r.D) return {{"x", index}};
  const int64_t h = col / r.D, k = col % r.D, half = r.D / 2;
  const int64_t partner = k < half ? k + half : k - half;
  return {{"x", index}, {"x", size_t(base + h * r.D + partner)}};
}

}  // namespace

void add_rope(std::vector<OpCase>& out) {
  // Consecutive cases also exercise the cpu kernel's cached cos/sin table: a shorter T after a
  // longer one reuses it, a new D or theta rebuilds it. D = 0 rotates nothing.
  const RopeCfg cfgs[] = {
      {2, 64, 3, 16, 3 * 16, 10000.0f, false},  {2, 13, 3, 16, 3 * 16 + 5, 10000.0f, false},
      {1, 1, 2, 8, 16, 10000.0f, false},        {3, 13, 4, 2, 8, 500000.0f, false},
      {2, 64, 2, 64, 3 * 128, 10000.0f, false}, {1, 300, 1, 128, 128, 10000.0f, false},
      {1, 7, 3, 2, 7, 10000.0f, false},         {0, 4, 2, 8, 16, 10000.0f, false},
      {2, 0, 2, 8, 16, 10000.0f, false},        {1, 3, 2, 0, 1, 10000.0f, false},
      {2, 4, 2, 6, 14, 10000.0f, true}};
  for (const RopeCfg& r : cfgs) {
    Label label("rope", "");
    label.dim("B", r.B).dim("T", r.T).dim("H", r.H).dim("D", r.D).dim("stride", r.stride);
    label.dim("theta", int64_t(r.theta));
    const PassFns fwd = pass_fns(r, rope_fwd, rope_fwd_bounds);
    std::optional<GradSpec> grad;
    if (r.grad) {
      // The backward case's "dx" input is the loss weights, and its output the gradient of
      // sum dx * rope(x).
      grad = gradient(
          fwd, {{"x", "dx"}}, [](Tensors&) {},
          [r](const Tensors&, std::string_view, size_t i) { return rope_dependents(r, i); },
          affine);
      grad->weights = [](const Tensors& in) { return Outputs{out_of("x", in.f("dx"))}; };
    }
    add_fwd_bwd(out, Op::rope, label, r.B * r.T * r.D == 0, inputs_of(r, rope_inputs), fwd,
                pass_fns(r, rope_bwd, rope_bwd_bounds), std::move(grad));
  }
  // The contract: an odd head dimension throws.
  for (Pass pass : {Pass::forward, Pass::backward}) {
    const RopeCfg r{1, 1, 4, 3, 12, 10000.0f, false};
    auto run = pass == Pass::forward ? rope_fwd : rope_bwd;
    OpCase c =
        make_case(Op::rope, pass,
                  Label("rope", pass == Pass::forward ? "fwd_rejects" : "bwd_rejects").dim("D", 3),
                  false, inputs_of(r, rope_inputs),
                  {[r, run](Backend& b, const Tensors& in) { return run(b, in, r); }, {}});
    c.expect_invalid_argument = true;
    out.push_back(std::move(c));
  }
}

}  // namespace tessel::kernels::harness::cases
