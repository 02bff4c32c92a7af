// The float32 reductions of one training step of a model, for the rounding bounds of tests that
// compare two computations of it (testing/rounding.h: chain_tolerance).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tessel/model/model_config.h"
#include "tessel/model/transformer.h"
#include "tessel/testing/rounding.h"

namespace tessel::model::test_util {

// Every reduction length (terms summed into one result element) of one forward pass, and with
// `backward` of its backward pass too, over `tokens` tokens in sequences of `seq_len`: the chain
// through which an error can reach the loss, a logit or the gradient of the first layer (the
// longest chain; every other result's is a part of it). Element-wise operations count as the few
// roundings they make. How tokens are split into micro-batches, data-parallel ranks or
// tensor-parallel partial sums only changes the order of these sums, not their lengths.
inline std::vector<int64_t> step_reductions(const ModelConfig& c, int64_t tokens, int64_t seq_len,
                                            bool backward = true) {
  const int64_t C = c.n_embd, hd = c.head_dim(), T = seq_len, N = tokens, V = c.padded_vocab();
  const bool llama = c.family == Family::llama;
  const int64_t ffn = c.ffn_hidden;
  const int64_t qkv_width = C + 2 * int64_t(c.n_kv_head) * hd;
  const int64_t fc_width = llama ? 2 * ffn : ffn;  // SwiGLU's gate and up
  // Normalisation: LayerNorm sums the mean and the variance, RMSNorm the mean square; scaling by
  // the weight (and the bias) adds two roundings.
  const std::vector<int64_t> norm =
      llama ? std::vector<int64_t>{C, 2} : std::vector<int64_t>{C, C, 3};
  const std::vector<int64_t> norm_back =
      llama ? std::vector<int64_t>{C, C, 3} : std::vector<int64_t>{C, C, C, 3};
  constexpr int64_t kActivation = 8;  // tanh-GELU or SiLU times up: a handful of roundings
  std::vector<int64_t> r;
  auto add = [&r](std::initializer_list<int64_t> ks) { r.insert(r.end(), ks); };
  auto add_norm = [&](const std::vector<int64_t>& ks) { r.insert(r.end(), ks.begin(), ks.end()); };
  add({2});  // token plus position embedding (gpt2), or nothing worse (llama)
  for (int l = 0; l < c.n_layer; ++l) {
    add_norm(norm);
    add({C, 2});            // q, k, v projections (+ bias); RoPE is a two-term sum
    add({hd, 2, T, 2, T});  // scores (and their scale), softmax (exp, sum, divide), weights x v
    add({C, 2, 2});         // output projection (+ bias), residual add
    add_norm(norm);
    add({C, 2, kActivation, ffn, 2, 2});  // MLP in (+ bias), activation, out (+ bias), residual
  }
  add_norm(norm);
  add({C, V, 4, N});  // head, log-sum-exp over the vocabulary, the loss' log and mean over tokens
  if (!backward) return r;
  add({4, V, N, 2});  // softmax - one-hot; d hidden through the head; d head (+ tied embedding)
  add_norm(norm_back);
  add({N, N});  // norm weight and bias gradients
  for (int l = 0; l < c.n_layer; ++l) {
    add({ffn, N, N, 2});                 // MLP out: d input, d weight, d bias; residual grad
    add({kActivation, fc_width, N, N});  // activation; MLP in: d input, d weight, d bias
    add_norm(norm_back);
    add({N, N, 2});               // norm weight and bias; residual grad
    add({C, N, N});               // output projection: d input, d weight, d bias
    add({hd, T, 2, T, T, T, 2});  // d weights, softmax backward, dq, dk, dv, RoPE
    add({qkv_width, N, N});       // q, k, v projections: d input, d weight, d bias
    add_norm(norm_back);
    add({N, N});
  }
  add({N, N});  // token embedding (scatter-add over tokens), positions
  return r;
}

// chain_tolerance of two float32 evaluations of one step that sum in different orders (sides 2),
// or of one against the exact value (sides 1: a float64 reference).
inline double step_tolerance(const ModelConfig& c, int64_t tokens, int64_t seq_len,
                             bool backward = true, int sides = 2) {
  const std::vector<int64_t> one = step_reductions(c, tokens, seq_len, backward);
  std::vector<int64_t> all;
  for (int s = 0; s < sides; ++s) all.insert(all.end(), one.begin(), one.end());
  return testing::chain_tolerance(all);
}

// How far another evaluation's gradient may be from `grads` (a model's flat gradient buffer,
// laid out by `views`), element by element: `tol` (step_tolerance) times the largest gradient of
// the element's tensor -- except in a row (a slice along the last dimension) that is exactly zero,
// which no term reached: an embedding row of a token the step did not use, vocabulary padding,
// positions beyond the sequence. Those are exactly zero in every evaluation. (Nonzero terms that
// cancel to an exact zero in every element of a row would take n_embd coincidences at once.)
inline std::vector<double> gradient_bounds(const std::vector<ParamView>& views,
                                           std::span<const float> grads, double tol) {
  std::vector<double> bound(grads.size(), 0.0);
  for (const ParamView& v : views) {
    const auto g = grads.subspan(size_t(v.offset), size_t(v.numel));
    double peak = 0;
    for (float x : g) peak = std::max(peak, double(std::fabs(x)));
    const size_t row = v.shape.rank() > 0 ? size_t(v.shape.dims().back()) : 1;
    for (size_t r0 = 0; r0 < g.size(); r0 += row) {
      const auto in_row = g.subspan(r0, std::min(row, g.size() - r0));
      const bool zero = std::all_of(in_row.begin(), in_row.end(), [](float x) { return x == 0; });
      std::fill_n(bound.begin() + v.offset + int64_t(r0), in_row.size(), zero ? 0.0 : tol * peak);
    }
  }
  return bound;
}

}  // namespace tessel::model::test_util
