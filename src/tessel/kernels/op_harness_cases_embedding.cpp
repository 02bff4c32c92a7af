// The op harness's embedding cases (op_harness_cases.h), with their bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/embedding.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/testing/rounding.h"

namespace tessel::kernels::harness::cases {
namespace {

using testing::gamma;

struct EmbeddingCfg {
  int B, T, C, V;  // V: the vocabulary the tokens are drawn from
  int vs, vr;      // this shard's rows [vs, vs + vr)
  bool wpe;
  bool grad;
};

Tensors embedding_inputs(const EmbeddingCfg& e, uint64_t seed) {
  const size_t N = size_t(e.B) * e.T, C = size_t(e.C);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens(N);
  for (auto& t : tokens) t = int32_t(rng() % uint64_t(e.V));
  if (N >= 2) tokens[1] = tokens[0];  // a repeated token sums its rows
  Tensors in;
  in.set_ints("tokens", std::move(tokens));
  in.set("wte", normal(size_t(e.vr) * C, seed + 1));
  in.set("wpe", normal(size_t(e.T) * C, seed + 2));
  in.set("dout", normal(N * C, seed + 3));
  in.set("dwte", normal(size_t(e.vr) * C, seed + 4));
  in.set("dwpe", normal(size_t(e.T) * C, seed + 5));
  return in;
}

Outputs embedding_fwd(Backend& b, const Tensors& in, const EmbeddingCfg& e) {
  IBuf tokens(b, in.i("tokens"));
  FBuf wte(b, in.f("wte")), wpe(b, in.f("wpe"));
  FBuf out(b, nans(size_t(e.B) * e.T * e.C));  // forward overwrites
  b.embedding_forward(out.get(), tokens.get(), wte.get(), e.wpe ? wpe.get() : nullptr, e.B, e.T,
                      e.C, e.vs, e.vr);
  return {out_of("out", out.host())};
}

Outputs embedding_bwd(Backend& b, const Tensors& in, const EmbeddingCfg& e) {
  IBuf tokens(b, in.i("tokens"));
  FBuf dout(b, in.f("dout")), dwte(b, in.f("dwte")), dwpe(b, in.f("dwpe"));
  b.embedding_backward(dwte.get(), e.wpe ? dwpe.get() : nullptr, dout.get(), tokens.get(), e.B, e.T,
                       e.C, e.vs, e.vr);
  Outputs o{out_of("dwte", dwte.host())};
  if (e.wpe) o.push_back(out_of("dwpe", dwpe.host()));
  return o;
}

// Forward: out = wte row + wpe row, one float add of two floats (or a copy, or 0 for a token
// outside the shard): IEEE rounding gives every implementation the same bits. Bound 0.
Outputs embedding_fwd_bounds(const Tensors&, const Outputs&, const EmbeddingCfg& e) {
  return {zeros("out", size_t(e.B) * e.T * e.C)};
}

// Backward: a dwte row adds the k rows of dout whose token it holds to its pre-filled value p, a
// sum of k + 1 terms. The reference adds them one at a time in token order; a backend may add
// them in any order (threads, atomics). Each is within gamma(k) sum |terms| of the exact sum
// (rounding.h), so within 2 gamma(k) of each other; the magnitudes summed here in double are
// within gamma64(k + 1) of exact, which 2 gamma(k + 1) covers. k <= 1 is one float add of the same
// two values (or none): the same bits everywhere, bound 0. dwpe likewise with k = B.
Outputs embedding_bwd_bounds(const Tensors& in, const Outputs&, const EmbeddingCfg& e) {
  const size_t C = size_t(e.C);
  const auto& tokens = in.i("tokens");
  const auto& dout = in.f("dout");
  std::vector<double> wte_mag(size_t(e.vr) * C), wpe_mag(size_t(e.T) * C);
  std::vector<int64_t> uses(size_t(e.vr), 0);
  const auto& dwte = in.f("dwte");
  const auto& dwpe = in.f("dwpe");
  for (size_t i = 0; i < wte_mag.size(); ++i) wte_mag[i] = std::fabs(dwte[i]);
  for (size_t i = 0; i < wpe_mag.size(); ++i) wpe_mag[i] = std::fabs(dwpe[i]);
  for (size_t n = 0; n < tokens.size(); ++n) {
    const int64_t row = int64_t(tokens[n]) - e.vs;
    const size_t t = n % size_t(e.T);
    for (size_t c = 0; c < C; ++c) wpe_mag[t * C + c] += std::fabs(dout[n * C + c]);
    if (row < 0 || row >= e.vr) continue;
    ++uses[size_t(row)];
    for (size_t c = 0; c < C; ++c) wte_mag[size_t(row) * C + c] += std::fabs(dout[n * C + c]);
  }
  auto bound = [](int64_t k, double magnitude) {
    return k <= 1 ? 0.0 : 2 * gamma(k + 1) * magnitude;
  };
  Output wte{"dwte", std::vector<double>(wte_mag.size())};
  for (size_t i = 0; i < wte_mag.size(); ++i) wte.values[i] = bound(uses[i / C], wte_mag[i]);
  Output wpe{"dwpe", std::vector<double>(wpe_mag.size())};
  for (size_t i = 0; i < wpe_mag.size(); ++i) wpe.values[i] = bound(e.B, wpe_mag[i]);
  return {wte, wpe};
}

// out[n, c] = wte[tokens[n] - vs, c] + wpe[n % T, c]: affine in both.
Deps embedding_dependents(const Tensors& in, const EmbeddingCfg& e, std::string_view param,
                          size_t i) {
  const size_t C = size_t(e.C), c = i % C, row = i / C;
  const auto& tokens = in.i("tokens");
  Deps d;
  for (size_t n = 0; n < tokens.size(); ++n) {
    const bool hit =
        param == "wte" ? int64_t(tokens[n]) - e.vs == int64_t(row) : n % size_t(e.T) == row;
    if (hit) d.emplace_back("out", n * C + c);
  }
  return d;
}

}  // namespace

void add_embedding(std::vector<OpCase>& out) {
  const EmbeddingCfg cfgs[] = {
      {1, 1, 1, 1, 0, 1, true, false},      {2, 7, 3, 5, 0, 5, true, false},
      {3, 11, 33, 13, 0, 13, false, false}, {2, 9, 67, 11, 4, 4, true, false},  // a shard
      {4, 64, 130, 7, 0, 7, true, false},  // above the parallel threshold, repeated tokens
      {0, 5, 3, 4, 0, 4, true, false},      {2, 0, 3, 4, 0, 4, true, false},  // empty
      {2, 4, 3, 5, 0, 5, true, true},
  };
  for (const EmbeddingCfg& e : cfgs) {
    Label label("embedding", "");
    label.dim("B", e.B).dim("T", e.T).dim("C", e.C).dim("V", e.V);
    if (e.vs != 0 || e.vr != e.V) label.dim("start", e.vs).dim("rows", e.vr);
    label.flag(e.wpe ? "wpe" : "nowpe");
    const PassFns fwd = pass_fns(e, embedding_fwd, embedding_fwd_bounds);
    std::optional<GradSpec> grad;
    if (e.grad) {
      Params params = {{"wte", "dwte"}};
      if (e.wpe) params.push_back({"wpe", "dwpe"});
      grad = gradient(
          fwd, params,
          [](Tensors& in) {
            zero(in, {"dwte", "dwpe"});
          },
          [e](const Tensors& in, std::string_view param, size_t i) {
            return embedding_dependents(in, e, param, i);
          },
          affine);
    }
    add_fwd_bwd(out, Op::embedding, label, e.B * e.T == 0, inputs_of(e, embedding_inputs), fwd,
                pass_fns(e, embedding_bwd, embedding_bwd_bounds), std::move(grad));
  }
}

}  // namespace tessel::kernels::harness::cases
