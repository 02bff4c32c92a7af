// The op harness's linear cases (op_harness_cases.h), with their bounds.
#include <cstdint>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "tessel/kernels/linear.h"
#include "tessel/kernels/linear_bf16.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels::harness::cases {
namespace {

using testing::absolute;
using testing::gamma;

struct LinearCfg {
  int N, IC, OC;
  bool bias;
  bool grad;
};

Tensors linear_inputs(const LinearCfg& d, uint64_t seed) {
  const size_t N = size_t(d.N), IC = size_t(d.IC), OC = size_t(d.OC);
  Tensors in;
  in.set("inp", normal(N * IC, seed));
  in.set("weight", normal(OC * IC, seed + 1, 0.2f));
  in.set("bias", normal(OC, seed + 2));
  in.set("dout", normal(N * OC, seed + 3));
  in.set("dinp", normal(N * IC, seed + 4));
  in.set("dweight", normal(OC * IC, seed + 5));
  in.set("dbias", normal(OC, seed + 6));
  return in;
}

Outputs linear_fwd(Backend& b, const Tensors& in, const LinearCfg& d) {
  FBuf inp(b, in.f("inp")), weight(b, in.f("weight")), bias(b, in.f("bias"));
  FBuf out(b, nans(size_t(d.N) * d.OC));
  b.linear_forward(out.get(), inp.get(), weight.get(), d.bias ? bias.get() : nullptr, d.N, d.IC,
                   d.OC);
  return {out_of("out", out.host())};
}

Outputs linear_bwd_input(Backend& b, const Tensors& in, const LinearCfg& d) {
  FBuf dout(b, in.f("dout")), weight(b, in.f("weight")), dinp(b, in.f("dinp"));
  b.linear_backward_input(dinp.get(), dout.get(), weight.get(), d.N, d.IC, d.OC);
  return {out_of("dinp", dinp.host())};
}

Outputs linear_bwd_weight(Backend& b, const Tensors& in, const LinearCfg& d) {
  FBuf dout(b, in.f("dout")), inp(b, in.f("inp"));
  FBuf dweight(b, in.f("dweight")), dbias(b, in.f("dbias"));
  b.linear_backward_weight(dweight.get(), d.bias ? dbias.get() : nullptr, dout.get(), inp.get(),
                           d.N, d.IC, d.OC);
  Outputs o{out_of("dweight", dweight.host())};
  if (d.bias) o.push_back(out_of("dbias", dbias.host()));
  return o;
}

// gamma(K + extra) times the magnitudes: the per-element bound of a result that sums K terms. A
// result of no terms (K = 0) is the buffer's value plus nothing: bound 0.
std::vector<double> sum_bounds(const std::vector<float>& magnitude, int64_t K, int extra) {
  std::vector<double> bound(magnitude.size(), 0.0);
  if (K == 0) return bound;
  for (size_t i = 0; i < bound.size(); ++i) bound[i] = gamma(K + extra) * magnitude[i];
  return bound;
}

// Forward (linear_test.cpp): the bias prefill plus a GEMM with beta = 1: IC + 1 terms, each rounded
// at most IC + 2 times (its product, IC additions; alpha = beta = 1 are exact); the reference's
// rounding to float and its double sum (u each), and the magnitudes' own rounding (u):
// gamma(IC + 5) of sum_i |x_i w_i| + |b| (the reference on absolute values).
Outputs linear_fwd_bounds(const Tensors& in, const Outputs&, const LinearCfg& d) {
  std::vector<float> mag(size_t(d.N) * d.OC);
  ref::linear_forward(mag.data(), absolute(in.f("inp")).data(), absolute(in.f("weight")).data(),
                      d.bias ? absolute(in.f("bias")).data() : nullptr, d.N, d.IC, d.OC);
  return {{"out", sum_bounds(mag, d.IC, 5)}};
}

// Backward (linear_test.cpp): dinp sums OC products and dweight N products into the buffer (a GEMM
// with beta = 1), dbias N values in a float accumulator then added: K + 1 terms each rounded at
// most K + 2 times (K = OC for dinp, N for dweight and dbias). The reference rounds its double sum
// to float, adds it (u each) and has its double error (below u); the magnitudes |init| + sum
// |terms| are the reference's float results on absolute values, two roundings: gamma(K + 7).
Outputs linear_bwd_input_bounds(const Tensors& in, const Outputs&, const LinearCfg& d) {
  auto mag = absolute(in.f("dinp"));
  ref::linear_backward_input(mag.data(), absolute(in.f("dout")).data(),
                             absolute(in.f("weight")).data(), d.N, d.IC, d.OC);
  return {{"dinp", sum_bounds(mag, d.OC, 7)}};
}

Outputs linear_bwd_weight_bounds(const Tensors& in, const Outputs&, const LinearCfg& d) {
  auto dw_mag = absolute(in.f("dweight")), db_mag = absolute(in.f("dbias"));
  ref::linear_backward_weight(dw_mag.data(), db_mag.data(), absolute(in.f("dout")).data(),
                              absolute(in.f("inp")).data(), d.N, d.IC, d.OC);
  return {{"dweight", sum_bounds(dw_mag, d.N, 7)}, {"dbias", sum_bounds(db_mag, d.N, 7)}};
}

// out[n, o] = sum_i inp[n, i] weight[o, i] + bias[o]: affine in each of inp, weight and bias;
// inp[n, .] reaches row n of out, weight[o, .] and bias[o] column o.
Deps linear_dependents(const LinearCfg& d, std::string_view param, size_t i) {
  Deps deps;
  const size_t N = size_t(d.N), IC = size_t(d.IC), OC = size_t(d.OC);
  if (param == "inp") {
    for (size_t o = 0; o < OC; ++o) deps.emplace_back("out", (i / IC) * OC + o);
  } else {
    const size_t o = param == "weight" ? i / IC : i;
    for (size_t n = 0; n < N; ++n) deps.emplace_back("out", n * OC + o);
  }
  return deps;
}

// ---- bf16 operands (linear_bf16.h) ----

// The weight rounded by the backend's own to_bf16, into w16 in its memory.
void round_weight(Backend& b, const Tensors& in, Buffer<bf16>& w16) {
  FBuf weight(b, in.f("weight"));
  b.to_bf16(w16.get(), weight.get(), int64_t(in.f("weight").size()));
}

// Forward, with the rounded weight widened back as an output: to_bf16 is exact (bound 0).
Outputs linear16_fwd(Backend& b, const Tensors& in, const LinearCfg& d) {
  FBuf inp(b, in.f("inp")), bias(b, in.f("bias"));
  Buffer<bf16> w16(b, in.f("weight").size());
  round_weight(b, in, w16);
  FBuf out(b, nans(size_t(d.N) * d.OC));
  b.linear_forward_bf16(out.get(), inp.get(), w16.get(), d.bias ? bias.get() : nullptr, d.N, d.IC,
                        d.OC);
  std::vector<float> widened;
  for (bf16 x : w16.host()) widened.push_back(bf16_to_f32(x));
  return {out_of("out", out.host()), out_of("weight_bf16", widened)};
}

Outputs linear16_bwd_input(Backend& b, const Tensors& in, const LinearCfg& d) {
  FBuf dout(b, in.f("dout")), dinp(b, in.f("dinp"));
  Buffer<bf16> w16(b, in.f("weight").size());
  round_weight(b, in, w16);
  b.linear_backward_input_bf16(dinp.get(), dout.get(), w16.get(), d.N, d.IC, d.OC);
  return {out_of("dinp", dinp.host())};
}

Outputs linear16_bwd_weight(Backend& b, const Tensors& in, const LinearCfg& d) {
  FBuf dout(b, in.f("dout")), inp(b, in.f("inp"));
  FBuf dweight(b, in.f("dweight")), dbias(b, in.f("dbias"));
  b.linear_backward_weight_bf16(dweight.get(), d.bias ? dbias.get() : nullptr, dout.get(),
                                inp.get(), d.N, d.IC, d.OC);
  Outputs o{out_of("dweight", dweight.host())};
  if (d.bias) o.push_back(out_of("dbias", dbias.host()));
  return o;
}

// The float layer's bounds on the operands rounded to bf16 (every product of two bf16s is exact in
// float, so the arithmetic is the float layer's on those operands; linear_bf16_test.cpp), plus
// what flushing subnormals loses in native bf16 instructions: up to 2^-126 for each of an
// element's K + 2 operations. The bias gradient sums the float dout, unrounded.
Tensors rounded_operands(const Tensors& in) {
  Tensors r = in;
  for (const char* name : {"inp", "weight", "dout"})
    for (float& x : r.f(name)) x = bf16_to_f32(f32_to_bf16(x));
  return r;
}

void add_flush(Output& o, int64_t K) {
  for (double& b : o.values) b += double(K + 2) * 0x1p-126;
}

Outputs linear16_fwd_bounds(const Tensors& in, const Outputs& outs, const LinearCfg& d) {
  Outputs o = linear_fwd_bounds(rounded_operands(in), outs, d);
  add_flush(o[0], d.IC);
  o.push_back({"weight_bf16", std::vector<double>(in.f("weight").size(), 0.0)});
  return o;
}

Outputs linear16_bwd_input_bounds(const Tensors& in, const Outputs& outs, const LinearCfg& d) {
  Outputs o = linear_bwd_input_bounds(rounded_operands(in), outs, d);
  add_flush(o[0], d.OC);
  return o;
}

Outputs linear16_bwd_weight_bounds(const Tensors& in, const Outputs& outs, const LinearCfg& d) {
  Outputs o = linear_bwd_weight_bounds(rounded_operands(in), outs, d);
  add_flush(o[0], d.N);
  o[1] = linear_bwd_weight_bounds(in, outs, d)[1];  // dbias: from the float dout
  return o;
}

}  // namespace

void add_linear_bf16(std::vector<OpCase>& out) {
  // The float layer's shapes but N = 0's (the rounding is deterministic, so the reference is
  // exact on the rounded operands: no gradient mode, whose finite differences would step across
  // bf16's rounding).
  const LinearCfg cfgs[] = {{1, 1, 1, true, false},      {3, 7, 33, true, false},
                            {17, 5, 67, false, false},   {7, 129, 3, true, false},
                            {33, 33, 129, false, false}, {130, 96, 300, true, false},
                            {256, 768, 64, true, false}};
  for (const LinearCfg& d : cfgs) {
    Label label("linear_bf16", "fwd");
    label.dim("N", d.N).dim("IC", d.IC).dim("OC", d.OC).flag(d.bias ? "bias" : "nobias");
    const auto inputs = inputs_of(d, linear_inputs);
    out.push_back(make_case(Op::linear_bf16, Pass::forward, label, false, inputs,
                            pass_fns(d, linear16_fwd, linear16_fwd_bounds)));
    label.what = "bwd_input";
    out.push_back(make_case(Op::linear_bf16, Pass::backward, label, false, inputs,
                            pass_fns(d, linear16_bwd_input, linear16_bwd_input_bounds)));
    label.what = "bwd_weight";
    out.push_back(make_case(Op::linear_bf16, Pass::backward, label, false, inputs,
                            pass_fns(d, linear16_bwd_weight, linear16_bwd_weight_bounds)));
  }
}

void add_linear(std::vector<OpCase>& out) {
  // Odd sizes, sizes with several GEMM blocks and dbias column blocks, and N = 0 (the weight
  // gradient must then stay as it was). IC = 0 and OC = 0 are left out: the cpu kernel's GEMM
  // rejects a zero leading dimension while the reference accepts them.
  const LinearCfg cfgs[] = {
      {1, 1, 1, true, false},   {3, 7, 33, true, false},     {17, 5, 67, false, false},
      {7, 129, 3, true, false}, {33, 33, 129, false, false}, {130, 96, 300, true, false},
      {0, 5, 7, true, false},   {3, 5, 4, true, true},       {2, 3, 2, false, true}};
  for (const LinearCfg& d : cfgs) {
    Label label("linear", "fwd");
    label.dim("N", d.N).dim("IC", d.IC).dim("OC", d.OC).flag(d.bias ? "bias" : "nobias");
    const auto inputs = inputs_of(d, linear_inputs);
    const PassFns fwd = pass_fns(d, linear_fwd, linear_fwd_bounds);
    out.push_back(make_case(Op::linear, Pass::forward, label, d.N == 0, inputs, fwd));
    // The two backward ops, each with the parameters whose gradients it gives.
    Params weights = {{"weight", "dweight"}};
    if (d.bias) weights.push_back({"bias", "dbias"});
    const std::tuple<const char*, PassFns, Params> backward[] = {
        {"bwd_input", pass_fns(d, linear_bwd_input, linear_bwd_input_bounds), {{"inp", "dinp"}}},
        {"bwd_weight", pass_fns(d, linear_bwd_weight, linear_bwd_weight_bounds), weights}};
    for (const auto& [what, fns, params] : backward) {
      label.what = what;
      OpCase c = make_case(Op::linear, Pass::backward, label, d.N == 0, inputs, fns);
      if (d.grad) {
        c.grad = gradient(
            fwd, params,
            [](Tensors& in) {
              zero(in, {"dinp", "dweight", "dbias"});
            },
            [d](const Tensors&, std::string_view param, size_t i) {
              return linear_dependents(d, param, i);
            },
            affine);
      }
      out.push_back(std::move(c));
    }
  }
}

}  // namespace tessel::kernels::harness::cases
