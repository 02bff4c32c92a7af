// The op harness's cases: for every op of the Backend interface, forward and backward, at several
// shapes (odd sizes, the kernels' parallel thresholds, and empty ones), each with the per-element
// bound on |backend - reference| derived beside it, and for the small backward cases a gradient
// mode (the forward, the loss weights, the third-derivative bound; see op_harness.cpp).
//
// The bounds are those of the per-op tests (kernels/<op>_test.cpp), which derive them for cpu::
// against ref::, applied to any backend that does the cpu:: kernels' arithmetic in any order
// (op_harness.h). Backward cases add into pre-filled gradient buffers, so a backend that
// overwrites instead of accumulating fails.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessel/kernels/activations.h"
#include "tessel/kernels/attention.h"
#include "tessel/kernels/cross_entropy.h"
#include "tessel/kernels/cross_entropy_test_data.h"
#include "tessel/kernels/embedding.h"
#include "tessel/kernels/layernorm.h"
#include "tessel/kernels/linear.h"
#include "tessel/kernels/op_harness_cases.h"
#include "tessel/kernels/optimizer.h"
#include "tessel/kernels/rmsnorm.h"
#include "tessel/kernels/rope.h"
#include "tessel/kernels/vocab_parallel_ce.h"
#include "tessel/testing/adam_divergence.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"

namespace tessel::kernels::harness::cases {
namespace {

using testing::gamma;
using testing::gamma64;
using testing::kFastExpError;
constexpr double u = testing::kUnitRoundoff;
constexpr double u64 = 0x1p-53;
constexpr double kSubnormal = 0x1p-149;  // a product or sum that underflows
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int kIgnore = test_data::kIgnore;

using Deps = std::vector<std::pair<std::string, size_t>>;

std::vector<float> normal(size_t n, uint64_t seed, float stddev = 1.0f) {
  return testing::random_normal(n, seed, stddev);
}

// An array in a backend's memory, filled from and read back to the host. Empty arrays get a
// small block too, so that a null pointer never stands for "absent" (bias, dbias, dwpe).
template <typename T>
class Buffer {
 public:
  Buffer(Backend& b, size_t n) : b_(b), n_(n) {
    p_ = static_cast<T*>(b.allocate(std::max<size_t>(n, 1) * sizeof(T)));
  }
  Buffer(Backend& b, const std::vector<T>& host) : Buffer(b, host.size()) {
    if (n_ > 0) b_.copy_from_host(p_, host.data(), n_ * sizeof(T));
  }
  ~Buffer() { b_.deallocate(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  T* get() const { return p_; }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) throw std::invalid_argument("Buffer::upload: size mismatch");
    if (n_ > 0) b_.copy_from_host(p_, host.data(), n_ * sizeof(T));
  }
  std::vector<T> host() const {
    b_.synchronize();
    std::vector<T> h(n_);
    if (n_ > 0) b_.copy_to_host(h.data(), p_, n_ * sizeof(T));
    return h;
  }

 private:
  Backend& b_;
  size_t n_;
  T* p_;
};
using FBuf = Buffer<float>;
using IBuf = Buffer<int32_t>;

Output out_of(std::string name, const std::vector<float>& v) {
  return {std::move(name), std::vector<double>(v.begin(), v.end())};
}

Output zeros(std::string name, size_t n) {
  return {std::move(name), std::vector<double>(n, 0.0)};
}

std::vector<float> nans(size_t n) {
  return std::vector<float>(n, kNaN);
}

// A case's name (a test name) and its dimensions for messages.
struct Label {
  std::string name, shape;
  Label(std::string_view op, std::string_view what)
      : name(std::string(op) + "_" + std::string(what)) {}
  Label& dim(const char* key, int64_t v) {
    name += std::string("_") + key + std::to_string(v);
    shape += (shape.empty() ? "" : " ") + std::string(key) + "=" + std::to_string(v);
    return *this;
  }
  Label& flag(const char* f) {
    name += std::string("_") + f;
    shape += (shape.empty() ? "" : " ") + std::string(f);
    return *this;
  }
};

OpCase make_case(Op op, Pass pass, const Label& label) {
  OpCase c;
  c.op = op;
  c.pass = pass;
  c.name = label.name;
  c.shape = label.shape;
  return c;
}

// (1 + a)(1 + b)... - 1: relative errors composed exactly.
double compose(std::initializer_list<double> rel) {
  double p = 1;
  for (double r : rel) p *= 1 + r;
  return p - 1;
}

// A backward that adds its result into a pre-filled buffer p. The backend computes
// a = fl(p + z~), z~ its result before the last rounding (rounded, or the exact product an FMA
// fuses into the add), the reference r = fl(p + z_r). The bound D derived for the two results
// into zeros covers |z~ - z_r| (an FMA only skips a rounding D counts). So
//   |a - r| <= D + u |p + z~| + u |p + z_r| <= D (1 + u) + 2u (|p| + |z_r|),
// with |z_r| <= |r - p| + 2u |r| (r = (p + z_r)(1 + d), |d| <= u), plus 2^-149 for a product that
// underflows.
double accumulated(double D, double p, double r) {
  return D * (1 + u) + 2 * u * (std::fabs(p) + std::fabs(r - p) + 2 * u * std::fabs(r)) +
         kSubnormal;
}

// ---- embedding ----------------------------------------------------------------------------------

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
Outputs embedding_fwd_bounds(const EmbeddingCfg& e) {
  return {zeros("out", size_t(e.B) * e.T * e.C)};
}

// Backward: a dwte row adds the k rows of dout whose token it holds to its pre-filled value p, a
// sum of k + 1 terms. The reference adds them one at a time in token order; a backend may add
// them in any order (threads, atomics). Each is within gamma(k) sum |terms| of the exact sum
// (rounding.h), so within 2 gamma(k) of each other; the magnitudes summed here in double are
// within gamma64(k + 1) of exact, which 2 gamma(k + 1) covers. k <= 1 is one float add of the same
// two values (or none): the same bits everywhere, bound 0. dwpe likewise with k = B.
Outputs embedding_bwd_bounds(const EmbeddingCfg& e, const Tensors& in) {
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
    for (Pass pass : {Pass::forward, Pass::backward}) {
      Label label("embedding", pass == Pass::forward ? "fwd" : "bwd");
      label.dim("B", e.B).dim("T", e.T).dim("C", e.C).dim("V", e.V);
      if (e.vs != 0 || e.vr != e.V) label.dim("start", e.vs).dim("rows", e.vr);
      label.flag(e.wpe ? "wpe" : "nowpe");
      OpCase c = make_case(Op::embedding, pass, label);
      c.empty = e.B * e.T == 0;
      c.make_inputs = [e](uint64_t seed) { return embedding_inputs(e, seed); };
      if (pass == Pass::forward) {
        c.run = [e](Backend& b, const Tensors& in) { return embedding_fwd(b, in, e); };
        c.bounds = [e](const Tensors&, const Outputs&) { return embedding_fwd_bounds(e); };
      } else {
        c.run = [e](Backend& b, const Tensors& in) { return embedding_bwd(b, in, e); };
        c.bounds = [e](const Tensors& in, const Outputs&) { return embedding_bwd_bounds(e, in); };
        if (e.grad) {
          GradSpec g;
          g.forward = [e](Backend& b, const Tensors& in) { return embedding_fwd(b, in, e); };
          g.forward_bounds = [e](const Tensors&, const Outputs&) {
            return embedding_fwd_bounds(e);
          };
          g.weights = [](const Tensors& in) { return Outputs{out_of("out", in.f("dout"))}; };
          g.params = {{"wte", "dwte"}};
          if (e.wpe) g.params.push_back({"wpe", "dwpe"});
          g.derive = [](Tensors& in) {
            std::fill(in.f("dwte").begin(), in.f("dwte").end(), 0.0f);
            std::fill(in.f("dwpe").begin(), in.f("dwpe").end(), 0.0f);
          };
          // out[n, c] = wte[tokens[n] - vs, c] + wpe[n % T, c]: affine in both.
          g.dependents = [e](const Tensors& in, std::string_view param, size_t i) {
            const size_t C = size_t(e.C), c = i % C, row = i / C;
            const auto& tokens = in.i("tokens");
            Deps d;
            for (size_t n = 0; n < tokens.size(); ++n) {
              const bool hit = param == "wte" ? int64_t(tokens[n]) - e.vs == int64_t(row)
                                              : n % size_t(e.T) == row;
              if (hit) d.emplace_back("out", n * C + c);
            }
            return d;
          };
          g.third_derivative = [](const Tensors&, std::string_view, size_t, double) { return 0.0; };
          c.grad = std::move(g);
        }
      }
      out.push_back(std::move(c));
    }
  }
}

// ---- layernorm and rmsnorm ----------------------------------------------------------------------

namespace {

constexpr float kEps = 1e-5f;

struct NormCfg {
  int N, C;
  bool bias;  // layernorm only
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

void zero(Tensors& in, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (in.has(n)) std::fill(in.f(n).begin(), in.f(n).end(), 0.0f);
}

// -- layernorm --

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
  const size_t NC = size_t(d.N) * d.C, C = size_t(d.C);
  // Rows with a common offset, so that a one-pass E[x^2] - E[x]^2 variance would show.
  auto inp = normal(NC, seed);
  for (size_t i = 0; i < NC; ++i) inp[i] += 3.0f + float(i % 5);
  Tensors in;
  in.set("inp", std::move(inp));
  in.set("weight", normal(C, seed + 1));
  in.set("bias", normal(C, seed + 2));
  in.set("dout", normal(NC, seed + 3));
  in.set("dinp", normal(NC, seed + 4));
  in.set("dweight", normal(C, seed + 5));
  in.set("dbias", normal(C, seed + 6));
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

// The float kernel's statistics of one row against the exact (float64) ones
// (layernorm_test.cpp):
//   mean: the float sum of C terms and the division, gamma(C) of A = sum |x| / C.
//   d_c = fl(x_c - mean) is off by that error D (the same for every c) and by u |d_c|. Because the
//   exact d_c sum to zero, D enters sum d^2 only squared: sum fl(d)^2 is within
//   (2u + u^2) sum d^2 + (1 + u)^2 C D^2 of sum d^2, and its float sum adds gamma(C) relatively
//   (positive terms); / C and + eps round twice: v = sum d^2 / C + eps is off by
//   nu <= gamma(C + 4) + (1 + gamma(C + 3)) D^2 / v relatively, and rstd = fl(1 / fl(sqrt(v)))
//   by rel_s = (1 - nu)^(-1/2) (1 + u) / (1 - u) - 1.
struct RowStats {
  double mean, rstd, A, D, rel_s;
};

RowStats row_stats(const float* x, int C, float eps) {
  double m = 0, a = 0;
  for (int c = 0; c < C; ++c) m += x[c], a += std::fabs(x[c]);
  m /= C;
  a /= C;
  double ss = 0;
  for (int c = 0; c < C; ++c) ss += (x[c] - m) * (x[c] - m);
  const double v = ss / C + double(eps);
  const double D = gamma(C) * a;
  const double nu = gamma(C + 4) + (1 + gamma(C + 3)) * D * D / v;
  return {m, 1 / std::sqrt(v), a, D, (1 + u) / (1 - u) / std::sqrt(1 - nu) - 1};
}

// Forward (layernorm_test.cpp): the reference's float64 statistics are off by gamma64(2C + 8) of
// the same terms, and it rounds mean, rstd and out to float once. out = fl(fl(fl(d) rstd) w) + b:
// the product carries d's error D + u|d|, rstd's rel_s and two roundings (R); the bias add rounds
// once more.
Outputs layernorm_fwd_bounds(const Tensors& in, const NormCfg& d) {
  const int N = d.N, C = d.C;
  const auto& inp = in.f("inp");
  const auto& weight = in.f("weight");
  const auto& bias = in.f("bias");
  Output out{"out", std::vector<double>(size_t(N) * C)}, mean{"mean", std::vector<double>(N)},
      rstd{"rstd", std::vector<double>(N)};
  for (int n = 0; n < N; ++n) {
    const float* x = inp.data() + size_t(n) * C;
    const RowStats st = row_stats(x, C, kEps);
    mean.values[n] = st.D + u * std::fabs(st.mean) + gamma64(C + 2) * st.A;
    rstd.values[n] = st.rstd * (st.rel_s + u + gamma64(2 * C + 8));
    const double R = (1 + u) * (1 + st.rel_s) * (1 + gamma(2)) - 1;
    for (int c = 0; c < C; ++c) {
      const double dc = x[c] - st.mean, w = std::fabs(weight[c]);
      const double bias_c = d.bias ? std::fabs(bias[c]) : 0.0;
      const double product_err = st.rstd * w * (st.D * (1 + R) + std::fabs(dc) * R);
      const double o = dc * st.rstd * weight[c] + (d.bias ? bias[c] : 0.0f);
      out.values[size_t(n) * C + c] =
          product_err + u * (std::fabs(o) + product_err) + u * std::fabs(o) +
          gamma64(2 * C + 16) * (st.rstd * w * (std::fabs(dc) + st.A) + bias_c);
    }
  }
  return {out, mean, rstd};
}

// Backward (layernorm_test.cpp), both sides given the same mean and rstd. Per row, with
// norm_c = (x_c - mean) rstd (two roundings), G1 = sum |w d| / C, G2 = sum |w d norm| / C:
// dnorm_mean (C products, C - 1 adds, / C) is off by gamma(C + 1) G1 and dnorm_norm_mean (four
// roundings per term) by gamma(C + 4) G2, plus gamma64 of the same for the reference. Then
// dx += (w d - dm - norm dnm) rstd rounds each term at most six times (norm's two, the product, two
// subtractions, * rstd, += into the buffer): gamma(6), and the reference rounds its value and the
// add: gamma(8) of |w d| rstd + G1 rstd + |norm| G2 rstd + |init|, plus gamma(9) for the float64
// terms' own error. dweight sums N terms of three roundings each into a float accumulator and adds
// it to the buffer: gamma(N + 3); dbias gamma(N); the reference rounds and adds (2u) and has its
// float64 error (below u): + 3 each. With N = 0 there is nothing to add: the buffer stays (bound
// 0).
Outputs layernorm_bwd_bounds(const Tensors& in, const NormCfg& d) {
  const int N = d.N, C = d.C;
  const size_t NC = size_t(N) * C;
  const auto& inp = in.f("inp");
  const auto& weight = in.f("weight");
  const auto& dout = in.f("dout");
  const auto& mean = in.f("mean");
  const auto& rstd = in.f("rstd");
  const auto& dinp_init = in.f("dinp");
  std::vector<double> dinp_bound(NC), dw_mag(C), db_mag(C);
  for (int c = 0; c < C; ++c) {
    dw_mag[c] = std::fabs(in.f("dweight")[c]);
    db_mag[c] = std::fabs(in.f("dbias")[c]);
  }
  for (int n = 0; n < N; ++n) {
    const double m = mean[n], st = rstd[n];
    double g1 = 0, g2 = 0;
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      const double norm = (inp[i] - m) * st, wd = std::fabs(double(weight[c]) * dout[i]);
      g1 += wd;
      g2 += wd * std::fabs(norm);
      dw_mag[c] += std::fabs(norm * dout[i]);
      db_mag[c] += std::fabs(dout[i]);
    }
    g1 /= C;
    g2 /= C;
    const double dm_err = (gamma(C + 1) + gamma64(C + 1)) * g1;
    const double dnm_err = (gamma(C + 4) + gamma64(C + 4)) * g2;
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      const double norm = std::fabs((inp[i] - m) * st);
      const double wd = std::fabs(double(weight[c]) * dout[i]);
      const double magnitude = st * (wd + g1 + norm * g2) + std::fabs(dinp_init[i]);
      dinp_bound[i] = st * (dm_err + norm * dnm_err) * (1 + gamma(6)) + gamma(9) * magnitude;
    }
  }
  Output dw{"dweight", std::vector<double>(C)}, db{"dbias", std::vector<double>(C)};
  for (int c = 0; c < C; ++c) {
    dw.values[c] = N == 0 ? 0.0 : gamma(N + 6) * dw_mag[c];
    db.values[c] = N == 0 ? 0.0 : gamma(N + 3) * db_mag[c];
  }
  return {{"dinp", dinp_bound}, dw, db};
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

}  // namespace

void add_layernorm(std::vector<OpCase>& out) {
  // 64 x 768 crosses the cpu kernels' parallel threshold; C = 1 has zero variance.
  const NormCfg cfgs[] = {{1, 1, true, false},   {7, 3, true, false},    {33, 67, false, false},
                          {5, 129, true, false}, {64, 768, true, false}, {0, 7, true, false},
                          {3, 5, true, true},    {2, 1, false, true}};
  for (const NormCfg& d : cfgs) {
    for (Pass pass : {Pass::forward, Pass::backward}) {
      Label label("layernorm", pass == Pass::forward ? "fwd" : "bwd");
      label.dim("N", d.N).dim("C", d.C).flag(d.bias ? "bias" : "nobias");
      OpCase c = make_case(Op::layernorm, pass, label);
      c.empty = d.N == 0;
      c.make_inputs = [d](uint64_t seed) { return layernorm_inputs(d, seed); };
      if (pass == Pass::forward) {
        c.run = [d](Backend& b, const Tensors& in) { return layernorm_fwd(b, in, d); };
        c.bounds = [d](const Tensors& in, const Outputs&) { return layernorm_fwd_bounds(in, d); };
        out.push_back(std::move(c));
        continue;
      }
      c.run = [d](Backend& b, const Tensors& in) { return layernorm_bwd(b, in, d); };
      c.bounds = [d](const Tensors& in, const Outputs&) { return layernorm_bwd_bounds(in, d); };
      if (d.grad) {
        GradSpec g;
        g.forward = [d](Backend& b, const Tensors& in) { return layernorm_fwd(b, in, d); };
        g.forward_bounds = [d](const Tensors& in, const Outputs&) {
          return layernorm_fwd_bounds(in, d);
        };
        g.weights = [](const Tensors& in) { return Outputs{out_of("out", in.f("dout"))}; };
        g.params = {{"inp", "dinp"}, {"weight", "dweight"}};
        if (d.bias) g.params.push_back({"bias", "dbias"});
        g.derive = [d](Tensors& in) {
          layernorm_stats(in, d);
          zero(in, {"dinp", "dweight", "dbias"});
        };
        g.dependents = [d](const Tensors&, std::string_view param, size_t i) {
          return norm_dependents(d, param, i);
        };
        g.third_derivative = [d](const Tensors& in, std::string_view param, size_t i, double h) {
          return layernorm_third_derivative(in, d, param, i, h);
        };
        c.grad = std::move(g);
      }
      out.push_back(std::move(c));
    }
  }
}

namespace {

// -- rmsnorm --

void rmsnorm_stats(Tensors& in, const NormCfg& d) {
  std::vector<float> out(size_t(d.N) * d.C), rstd(size_t(d.N));
  ref::rmsnorm_forward(out.data(), rstd.data(), in.f("inp").data(), in.f("weight").data(), d.N, d.C,
                       kEps);
  in.set("rstd", std::move(rstd));
}

Tensors rmsnorm_inputs(const NormCfg& d, uint64_t seed) {
  const size_t NC = size_t(d.N) * d.C, C = size_t(d.C);
  Tensors in;
  in.set("inp", normal(NC, seed));
  in.set("weight", normal(C, seed + 1));
  in.set("dout", normal(NC, seed + 3));
  in.set("dinp", normal(NC, seed + 4));
  in.set("dweight", normal(C, seed + 5));
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

// Forward (rmsnorm_test.cpp): the float sum of squares (C positive terms, product and adds) is off
// by gamma(C) relatively, / C and + eps by two more roundings: v = mean(x^2) + eps by
// nu = gamma(C + 2), and rstd = fl(1 / fl(sqrt(v))) by rel_s = (1 - nu)^(-1/2) (1+u)/(1-u) - 1.
// out = fl(fl(x rstd) w) adds two roundings, of one sign of terms (no cancellation). The reference
// rounds rstd and out to float once each; its float64 error is gamma64(C + 6) relatively.
Outputs rmsnorm_fwd_bounds(const Tensors& in, const NormCfg& d) {
  const int N = d.N, C = d.C;
  const auto& inp = in.f("inp");
  const auto& weight = in.f("weight");
  const double rel_s = (1 + u) / (1 - u) / std::sqrt(1 - gamma(C + 2)) - 1;
  const double rel_out = (1 + rel_s) * (1 + gamma(2)) - 1 + u + gamma64(C + 6);
  Output out{"out", std::vector<double>(size_t(N) * C)}, rstd{"rstd", std::vector<double>(N)};
  for (int n = 0; n < N; ++n) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += double(inp[size_t(n) * C + c]) * inp[size_t(n) * C + c];
    const double s = 1 / std::sqrt(ms / C + double(kEps));
    rstd.values[n] = s * (rel_s + u + gamma64(C + 6));
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      out.values[i] = rel_out * std::fabs(double(inp[i]) * s * weight[c]);
    }
  }
  return {out, rstd};
}

// Backward (rmsnorm_test.cpp), both sides given the same rstd s. Per row, dot = sum d w x (two
// products and C - 1 adds per term) is off by gamma(C + 1) G, G = sum |d w x|, and
// coef = s s s dot / C by four more roundings: gamma(C + 5) s^3 G / C (the reference: gamma64(C +
// 8) of the same). dx += d w s - coef x rounds each term at most four times (two products, the
// subtraction, the add into the buffer; coef x three) and the reference twice more (its float
// rounding and add): gamma(7). dweight sums N terms of two roundings into a float accumulator and
// adds it once: gamma(N + 2), and the reference's rounding, add and float64 sum: gamma(N + 5).
// With N = 0 there is nothing to add: the buffer stays (bound 0).
Outputs rmsnorm_bwd_bounds(const Tensors& in, const NormCfg& d) {
  const int N = d.N, C = d.C;
  const auto& inp = in.f("inp");
  const auto& weight = in.f("weight");
  const auto& dout = in.f("dout");
  const auto& rstd = in.f("rstd");
  const auto& dinp_init = in.f("dinp");
  std::vector<double> dinp_bound(size_t(N) * C), dw_mag(C);
  for (int c = 0; c < C; ++c) dw_mag[c] = std::fabs(in.f("dweight")[c]);
  for (int n = 0; n < N; ++n) {
    const double s = rstd[n];
    double G = 0;
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      G += std::fabs(double(dout[i]) * weight[c] * inp[i]);
      dw_mag[c] += std::fabs(double(inp[i]) * s * dout[i]);
    }
    const double coef = s * s * s * G / C;  // bounds |coef|
    const double coef_err = coef * ((1 + gamma(C + 5)) * (1 + gamma(3)) - 1 + gamma64(C + 8));
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      const double x = std::fabs(inp[i]), dws = std::fabs(double(dout[i]) * weight[c] * s);
      dinp_bound[i] = x * coef_err + gamma(7) * (dws + coef * x + std::fabs(dinp_init[i]));
    }
  }
  Output dw{"dweight", std::vector<double>(C)};
  for (int c = 0; c < C; ++c) dw.values[c] = N == 0 ? 0.0 : gamma(N + 5) * dw_mag[c];
  return {{"dinp", dinp_bound}, dw};
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

}  // namespace

void add_rmsnorm(std::vector<OpCase>& out) {
  const NormCfg cfgs[] = {{1, 1, false, false},   {7, 3, false, false},    {33, 67, false, false},
                          {5, 129, false, false}, {64, 768, false, false}, {0, 7, false, false},
                          {3, 5, false, true},    {2, 1, false, true}};
  for (const NormCfg& d : cfgs) {
    for (Pass pass : {Pass::forward, Pass::backward}) {
      Label label("rmsnorm", pass == Pass::forward ? "fwd" : "bwd");
      label.dim("N", d.N).dim("C", d.C);
      OpCase c = make_case(Op::rmsnorm, pass, label);
      c.empty = d.N == 0;
      c.make_inputs = [d](uint64_t seed) { return rmsnorm_inputs(d, seed); };
      if (pass == Pass::forward) {
        c.run = [d](Backend& b, const Tensors& in) { return rmsnorm_fwd(b, in, d); };
        c.bounds = [d](const Tensors& in, const Outputs&) { return rmsnorm_fwd_bounds(in, d); };
        out.push_back(std::move(c));
        continue;
      }
      c.run = [d](Backend& b, const Tensors& in) { return rmsnorm_bwd(b, in, d); };
      c.bounds = [d](const Tensors& in, const Outputs&) { return rmsnorm_bwd_bounds(in, d); };
      if (d.grad) {
        GradSpec g;
        g.forward = [d](Backend& b, const Tensors& in) { return rmsnorm_fwd(b, in, d); };
        g.forward_bounds = [d](const Tensors& in, const Outputs&) {
          return rmsnorm_fwd_bounds(in, d);
        };
        g.weights = [](const Tensors& in) { return Outputs{out_of("out", in.f("dout"))}; };
        g.params = {{"inp", "dinp"}, {"weight", "dweight"}};
        g.derive = [d](Tensors& in) {
          rmsnorm_stats(in, d);
          zero(in, {"dinp", "dweight"});
        };
        g.dependents = [d](const Tensors&, std::string_view param, size_t i) {
          return norm_dependents(d, param, i);
        };
        g.third_derivative = [d](const Tensors& in, std::string_view param, size_t i, double h) {
          return rmsnorm_third_derivative(in, d, param, i, h);
        };
        c.grad = std::move(g);
      }
      out.push_back(std::move(c));
    }
  }
}

// ---- linear -------------------------------------------------------------------------------------

namespace {

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

std::vector<float> absolute(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = std::fabs(x[i]);
  return r;
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
Outputs linear_fwd_bounds(const Tensors& in, const LinearCfg& d) {
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
Outputs linear_bwd_input_bounds(const Tensors& in, const LinearCfg& d) {
  auto mag = absolute(in.f("dinp"));
  ref::linear_backward_input(mag.data(), absolute(in.f("dout")).data(),
                             absolute(in.f("weight")).data(), d.N, d.IC, d.OC);
  return {{"dinp", sum_bounds(mag, d.OC, 7)}};
}

Outputs linear_bwd_weight_bounds(const Tensors& in, const LinearCfg& d) {
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

}  // namespace

void add_linear(std::vector<OpCase>& out) {
  // Odd sizes, sizes with several GEMM blocks and dbias column blocks, and N = 0 (the weight
  // gradient must then stay as it was). IC = 0 and OC = 0 are left out: the cpu kernel's GEMM
  // rejects a zero leading dimension while the reference accepts them.
  const LinearCfg cfgs[] = {
      {1, 1, 1, true, false},   {3, 7, 33, true, false},     {17, 5, 67, false, false},
      {7, 129, 3, true, false}, {33, 33, 129, false, false}, {130, 96, 300, true, false},
      {0, 5, 7, true, false},   {3, 5, 4, true, true},       {2, 3, 2, false, true}};
  enum Kind { kForward, kInput, kWeight };
  for (const LinearCfg& d : cfgs) {
    for (Kind kind : {kForward, kInput, kWeight}) {
      const char* what = kind == kForward ? "fwd" : kind == kInput ? "bwd_input" : "bwd_weight";
      Label label("linear", what);
      label.dim("N", d.N).dim("IC", d.IC).dim("OC", d.OC).flag(d.bias ? "bias" : "nobias");
      OpCase c = make_case(Op::linear, kind == kForward ? Pass::forward : Pass::backward, label);
      c.empty = d.N == 0;
      c.make_inputs = [d](uint64_t seed) { return linear_inputs(d, seed); };
      if (kind == kForward) {
        c.run = [d](Backend& b, const Tensors& in) { return linear_fwd(b, in, d); };
        c.bounds = [d](const Tensors& in, const Outputs&) { return linear_fwd_bounds(in, d); };
      } else if (kind == kInput) {
        c.run = [d](Backend& b, const Tensors& in) { return linear_bwd_input(b, in, d); };
        c.bounds = [d](const Tensors& in, const Outputs&) {
          return linear_bwd_input_bounds(in, d);
        };
      } else {
        c.run = [d](Backend& b, const Tensors& in) { return linear_bwd_weight(b, in, d); };
        c.bounds = [d](const Tensors& in, const Outputs&) {
          return linear_bwd_weight_bounds(in, d);
        };
      }
      if (d.grad && kind != kForward) {
        GradSpec g;
        g.forward = [d](Backend& b, const Tensors& in) { return linear_fwd(b, in, d); };
        g.forward_bounds = [d](const Tensors& in, const Outputs&) {
          return linear_fwd_bounds(in, d);
        };
        g.weights = [](const Tensors& in) { return Outputs{out_of("out", in.f("dout"))}; };
        if (kind == kInput) {
          g.params = {{"inp", "dinp"}};
        } else {
          g.params = {{"weight", "dweight"}};
          if (d.bias) g.params.push_back({"bias", "dbias"});
        }
        g.derive = [](Tensors& in) { zero(in, {"dinp", "dweight", "dbias"}); };
        g.dependents = [d](const Tensors&, std::string_view param, size_t i) {
          return linear_dependents(d, param, i);
        };
        g.third_derivative = [](const Tensors&, std::string_view, size_t, double) { return 0.0; };
        c.grad = std::move(g);
      }
      out.push_back(std::move(c));
    }
  }
}

// ---- attention ----------------------------------------------------------------------------------

namespace {

struct AttnCfg {
  int B, T, Hq, Hkv, D;
  bool fused;  // q, k, v (and their gradients) interleaved per token in one buffer
  bool grad;
};

// Where q, k, v live inside one buffer (attention_test.cpp). Fused: [B*T, (Hq + 2 Hkv) * D] rows
// with q, k, v side by side, as a QKV projection writes them. Separate: three back-to-back blocks,
// each padded by one float per token, so that a kernel assuming a contiguous layout reads the
// wrong values (and one that writes the padding fails its zero bound).
struct Layout {
  int64_t q_off, k_off, v_off, q_stride, kv_stride, size;
  explicit Layout(const AttnCfg& c) {
    const int64_t n = int64_t(c.B) * c.T;
    const int64_t qw = int64_t(c.Hq) * c.D, kvw = int64_t(c.Hkv) * c.D;
    if (c.fused) {
      q_stride = kv_stride = std::max<int64_t>(qw + 2 * kvw, 1);
      q_off = 0, k_off = qw, v_off = qw + kvw;
      size = n * q_stride;
    } else {
      q_stride = qw + 1, kv_stride = kvw + 1;
      q_off = 0, k_off = n * q_stride, v_off = k_off + n * kv_stride;
      size = v_off + n * kv_stride;
    }
  }
};

bool valid_heads(const AttnCfg& c) {
  return c.Hkv > 0 && c.Hq % c.Hkv == 0;
}

void attention_probs(Tensors& in, const AttnCfg& c) {
  const Layout L(c);
  std::vector<float> out(size_t(c.B) * c.T * c.Hq * c.D), probs(size_t(c.B) * c.Hq * c.T * c.T);
  const float* qkv = in.f("qkv").data();
  if (valid_heads(c)) {
    ref::attention_forward(out.data(), probs.data(), qkv + L.q_off, qkv + L.k_off, qkv + L.v_off,
                           c.B, c.T, c.Hq, c.Hkv, c.D, L.q_stride, L.kv_stride);
  }
  in.set("probs", std::move(probs));
}

Tensors attention_inputs(const AttnCfg& c, uint64_t seed) {
  const Layout L(c);
  Tensors in;
  in.set("qkv", normal(size_t(L.size), seed));
  in.set("dout", normal(size_t(c.B) * c.T * c.Hq * c.D, seed + 1));
  in.set("dqkv", normal(size_t(L.size), seed + 2));
  attention_probs(in, c);  // the backward's saved softmax: the reference forward's
  return in;
}

Outputs attention_fwd(Backend& b, const Tensors& in, const AttnCfg& c) {
  const Layout L(c);
  FBuf qkv(b, in.f("qkv"));
  FBuf out(b, nans(size_t(c.B) * c.T * c.Hq * c.D)), probs(b, nans(size_t(c.B) * c.Hq * c.T * c.T));
  b.attention_forward(out.get(), probs.get(), qkv.get() + L.q_off, qkv.get() + L.k_off,
                      qkv.get() + L.v_off, c.B, c.T, c.Hq, c.Hkv, c.D, L.q_stride, L.kv_stride);
  return {out_of("out", out.host()), out_of("probs", probs.host())};
}

Outputs attention_bwd(Backend& b, const Tensors& in, const AttnCfg& c) {
  const Layout L(c);
  FBuf qkv(b, in.f("qkv")), dout(b, in.f("dout")), probs(b, in.f("probs")), dqkv(b, in.f("dqkv"));
  const float* base = qkv.get();
  float* g = dqkv.get();
  b.attention_backward(g + L.q_off, g + L.k_off, g + L.v_off, dout.get(), probs.get(),
                       base + L.q_off, base + L.k_off, base + L.v_off, c.B, c.T, c.Hq, c.Hkv, c.D,
                       L.q_stride, L.kv_stride);
  return {out_of("dqkv", dqkv.host())};
}

// Forward (attention_test.cpp), element by element, from the arithmetic of each query row
// (b, h, t) with n = t + 1 keys:
//   scores s_j = q . k_j: a float sum of D products, off by gamma(D) S_j with S_j = sum_d |q_d
//   k_jd|.
//     Softmax takes a_j = fl(fl(s_j - max) scale) with scale rounded to float: the computed max is
//     common to every j (it cancels in the normalisation), so a_j is off by scale gamma(D) S_j
//     plus gamma(3) of scale |s_j - max|, and |s_j - max| <= s_max - s_j + gamma(D) (S_j + max_i
//     S_i). fast_exp adds kFastExpError (exp_error), the float sum of n positive terms gamma(n)
//     (softmax_error), and p = fl(e fl(1 / sum)) two roundings.
//   The reference does the same in double (libm exp within 2^-52, gamma64 for its sums) and rounds
//     p and out to float once.
//   out_d = sum_j p_j v_jd: the float sum of n products (gamma(n)) of the computed p (their errors
//     times |v_jd|), and the reference's double sum (gamma64(n)).
// Entries above the diagonal are exact zeros (bound 0). The derivation needs every exp argument
// above -80 (fast_exp's range); a case outside it throws.
Outputs attention_fwd_bounds(const Tensors& in, const AttnCfg& c) {
  const Layout L(c);
  const std::vector<float>& qkv = in.f("qkv");
  const int group = c.Hq / c.Hkv, D = c.D, T = c.T;
  const double scale = 1.0 / std::sqrt(double(D));
  Output probs{"probs", std::vector<double>(size_t(c.B) * c.Hq * T * T, 0.0)};
  Output out{"out", std::vector<double>(size_t(c.B) * T * c.Hq * D, 0.0)};
  for (int b = 0; b < c.B; ++b) {
    for (int h = 0; h < c.Hq; ++h) {
      const int hk = h / group;
      for (int t = 0; t < T; ++t) {
        const int n = t + 1;
        const float* qt = qkv.data() + L.q_off + (int64_t(b) * T + t) * L.q_stride + h * D;
        auto kv_row = [&](int64_t off, int j) {
          return qkv.data() + off + (int64_t(b) * T + j) * L.kv_stride + hk * D;
        };
        std::vector<double> sc(n), mag(n);
        for (int j = 0; j < n; ++j) {
          const float* kj = kv_row(L.k_off, j);
          for (int d = 0; d < D; ++d) {
            sc[j] += double(qt[d]) * kj[d];
            mag[j] += std::fabs(double(qt[d]) * kj[d]);
          }
        }
        const double s_max = *std::max_element(sc.begin(), sc.end());
        const double mag_max = *std::max_element(mag.begin(), mag.end());
        std::vector<double> a(n), rho(n), rho64(n);
        for (int j = 0; j < n; ++j) {
          a[j] = scale * (sc[j] - s_max);
          if (!(a[j] > -80.0)) throw std::domain_error("attention bound: an exp underflows");
          const double shift = scale * (s_max - sc[j] + gamma(D) * (mag[j] + mag_max));
          rho[j] = testing::exp_error(scale * gamma(D) * mag[j] + gamma(3) * shift, kFastExpError);
          const double shift64 = scale * (s_max - sc[j] + gamma64(D) * (mag[j] + mag_max));
          rho64[j] =
              testing::exp_error(scale * gamma64(D) * mag[j] + gamma64(3) * shift64, 0x1p-52);
        }
        const auto fast = testing::softmax_error(a, rho, gamma(n));
        const auto exact = testing::softmax_error(a, rho64, gamma64(n));
        std::vector<double> rel(n), rel64(n);
        const size_t p_row = ((size_t(b) * c.Hq + h) * T + t) * T;
        for (int j = 0; j < n; ++j) {
          rel[j] = (1 + fast.rel[j]) * (1 + u) * (1 + u) - 1;
          rel64[j] = (1 + exact.rel[j]) * (1 + u64) - 1;
          probs.values[p_row + j] = fast.p[j] * (rel[j] + rel64[j] + u * (1 + rel64[j]));
        }
        const size_t o_row = (size_t(b) * T + t) * c.Hq * D + size_t(h) * D;
        for (int d = 0; d < D; ++d) {
          double bound = 0;
          for (int j = 0; j < n; ++j) {
            const double pv = fast.p[j] * std::fabs(kv_row(L.v_off, j)[d]);
            bound += pv * (rel[j] + rel64[j] + (1 + rel[j]) * gamma(n) + gamma64(n) +
                           u * (1 + rel64[j]));
          }
          out.values[o_row + d] = bound;
        }
      }
    }
  }
  return {out, probs};
}

// Backward (attention_test.cpp), both sides given the same probabilities P and adding into the
// same pre-filled buffer `init` (laid out like qkv; padding gets a zero bound: it must stay
// untouched). Per query row (b, h, t), n = t + 1, with A_j = sum_d |dO_d v_jd|,
// B = sum_j P_j A_j and E_j = P_j (A_j + B):
//   dP_j = dO . v_j sums D products: gamma(D) A_j. delta = sum_j P_j dP_j, a float sum of n
//   products of the computed dP: gamma(D + n) B. dS_j = fl(P_j fl(dP_j - delta)): within
//   gamma(D + n + 2) E_j of P_j (dP_j - delta), whose size is at most E_j.
//   dq_t = init + scale sum_j dS_j k_j (alpha = float scale, accumulating into the buffer): n + 1
//   terms, each rounded at most n + 3 times (product, alpha, scale's own rounding, n additions),
//   with dS's error carried through: gamma(D + 2n + 5) of scale sum_j E_j |k_j| + |init|. dk_j
//   likewise over the m_j = group (T - j) later rows of every head of the group (their dS within
//   gamma(D + T + 2) E): gamma(D + T + m_j + 5). dv_j = init + sum P_tj dO_t: m_j products,
//   gamma(m_j + 1) of sum P |dO| + |init|.
//   The reference: the same sums in double (below u each) and two float roundings (its value and
//   the add into the buffer): + 3.
Outputs attention_bwd_bounds(const Tensors& in, const AttnCfg& c) {
  const Layout L(c);
  const std::vector<float>& qkv = in.f("qkv");
  const std::vector<float>& probs = in.f("probs");
  const std::vector<float>& dout = in.f("dout");
  const std::vector<float>& init = in.f("dqkv");
  const int group = c.Hq / c.Hkv, D = c.D, T = c.T;
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> mag(qkv.size(), 0.0), bound(qkv.size(), 0.0);
  auto q_at = [&](int b, int t, int h) {
    return L.q_off + (int64_t(b) * T + t) * L.q_stride + int64_t(h) * D;
  };
  auto kv_at = [&](int64_t off, int b, int t, int hk) {
    return off + (int64_t(b) * T + t) * L.kv_stride + int64_t(hk) * D;
  };
  for (int b = 0; b < c.B; ++b) {
    for (int h = 0; h < c.Hq; ++h) {
      const int hk = h / group;
      for (int t = 0; t < T; ++t) {
        const int n = t + 1;
        const float* P = probs.data() + ((size_t(b) * c.Hq + h) * T + t) * T;
        const float* dO = dout.data() + (size_t(b) * T + t) * c.Hq * D + size_t(h) * D;
        std::vector<double> A(n, 0.0);
        double Bt = 0;
        for (int j = 0; j < n; ++j) {
          const float* vj = qkv.data() + kv_at(L.v_off, b, j, hk);
          for (int d = 0; d < D; ++d) A[j] += std::fabs(double(dO[d]) * vj[d]);
          Bt += P[j] * A[j];
        }
        for (int j = 0; j < n; ++j) {
          const double E = P[j] * (A[j] + Bt);
          const int64_t qi = q_at(b, t, h), ki = kv_at(L.k_off, b, j, hk);
          const int64_t vi = kv_at(L.v_off, b, j, hk);
          for (int d = 0; d < D; ++d) {
            mag[qi + d] += scale * E * std::fabs(qkv[ki + d]);
            mag[ki + d] += scale * E * std::fabs(qkv[qi + d]);
            mag[vi + d] += P[j] * std::fabs(dO[d]);
          }
        }
      }
    }
  }
  for (int b = 0; b < c.B; ++b) {
    for (int t = 0; t < T; ++t) {
      const int n = t + 1;
      const int64_t m = int64_t(group) * (T - t);  // terms of dk_t and dv_t
      for (int h = 0; h < c.Hq; ++h) {
        const int64_t qi = q_at(b, t, h);
        for (int d = 0; d < D; ++d)
          bound[qi + d] = gamma(D + 2 * n + 8) * (mag[qi + d] + std::fabs(init[qi + d]));
      }
      for (int hk = 0; hk < c.Hkv; ++hk) {
        const int64_t ki = kv_at(L.k_off, b, t, hk), vi = kv_at(L.v_off, b, t, hk);
        for (int d = 0; d < D; ++d) {
          bound[ki + d] = gamma(D + T + m + 8) * (mag[ki + d] + std::fabs(init[ki + d]));
          bound[vi + d] = gamma(m + 4) * (mag[vi + d] + std::fabs(init[vi + d]));
        }
      }
    }
  }
  return {{"dqkv", bound}};
}

// Which of q, k, v (or padding) element i of the qkv buffer is.
struct Where {
  char kind;  // 'q', 'k', 'v', or 'p' for padding
  int b, t, head, d;
};

Where locate(const AttnCfg& c, const Layout& L, size_t index) {
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
  const Layout L(c);
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
  const Layout L(c);
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
    for (Pass pass : {Pass::forward, Pass::backward}) {
      Label label("attention", pass == Pass::forward ? "fwd" : "bwd");
      label.dim("B", a.B).dim("T", a.T).dim("Hq", a.Hq).dim("Hkv", a.Hkv).dim("D", a.D);
      label.flag(a.fused ? "fused" : "separate");
      OpCase c = make_case(Op::attention, pass, label);
      c.empty = a.B * a.T == 0;
      c.make_inputs = [a](uint64_t seed) { return attention_inputs(a, seed); };
      if (pass == Pass::forward) {
        c.run = [a](Backend& b, const Tensors& in) { return attention_fwd(b, in, a); };
        c.bounds = [a](const Tensors& in, const Outputs&) { return attention_fwd_bounds(in, a); };
        out.push_back(std::move(c));
        continue;
      }
      c.run = [a](Backend& b, const Tensors& in) { return attention_bwd(b, in, a); };
      c.bounds = [a](const Tensors& in, const Outputs&) { return attention_bwd_bounds(in, a); };
      if (a.grad) {
        GradSpec g;
        g.forward = [a](Backend& b, const Tensors& in) { return attention_fwd(b, in, a); };
        g.forward_bounds = [a](const Tensors& in, const Outputs&) {
          return attention_fwd_bounds(in, a);
        };
        g.weights = [](const Tensors& in) { return Outputs{out_of("out", in.f("dout"))}; };
        g.params = {{"qkv", "dqkv"}};
        g.samples = 48;
        g.derive = [a](Tensors& in) {
          attention_probs(in, a);
          zero(in, {"dqkv"});
        };
        g.dependents = [a](const Tensors&, std::string_view, size_t i) {
          return attention_dependents(a, i);
        };
        g.third_derivative = [a](const Tensors& in, std::string_view, size_t i, double) {
          return attention_third_derivative(in, a, i);
        };
        c.grad = std::move(g);
      }
      out.push_back(std::move(c));
    }
  }
  // The contract: query heads not a multiple of the key/value heads, and no heads at all, throw.
  const AttnCfg bad[] = {{1, 2, 3, 2, 4, true, false}, {1, 2, 0, 0, 4, true, false}};
  for (const AttnCfg& a : bad) {
    for (Pass pass : {Pass::forward, Pass::backward}) {
      Label label("attention", pass == Pass::forward ? "fwd_rejects" : "bwd_rejects");
      label.dim("Hq", a.Hq).dim("Hkv", a.Hkv);
      OpCase c = make_case(Op::attention, pass, label);
      c.expect_invalid_argument = true;
      c.empty = a.Hq == 0;
      c.make_inputs = [a](uint64_t seed) { return attention_inputs(a, seed); };
      if (pass == Pass::forward) {
        c.run = [a](Backend& b, const Tensors& in) { return attention_fwd(b, in, a); };
      } else {
        c.run = [a](Backend& b, const Tensors& in) { return attention_bwd(b, in, a); };
      }
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

// cos and sin of the angle t theta^(-2i/D), in double, and how far either side's double cos and
// sin can be from them (rope_test.cpp): both form the angle as t * pow(theta, -2i/D) (the
// exponent rounded once, pow within 1 ulp, the product once: |angle| (3 + ln theta) 2^-53, since
// pow(theta, y) moves by ln(theta) |y| times y's error) and glibc's cos and sin are within 1 ulp
// (2^-52).
struct Angle {
  double c, s, err;
  Angle(int t, int i, int D, double theta) {
    const double angle = t * std::pow(theta, -2.0 * i / D);
    c = std::cos(angle);
    s = std::sin(angle);
    err = (std::fabs(angle) * (3 + std::log(theta)) + 2) * u64;
  }
};

Tensors rope_inputs(const RopeCfg& r, uint64_t seed) {
  const size_t n = size_t(r.B) * r.T * size_t(r.stride);
  Tensors in;
  in.set("x", normal(n, seed));
  in.set("dx", normal(n, seed + 1));
  return in;
}

Outputs rope_run(Backend& b, const Tensors& in, const RopeCfg& r, bool forward) {
  const char* name = forward ? "x" : "dx";
  FBuf x(b, in.f(name));
  if (forward) {
    b.rope_forward(x.get(), r.B, r.T, r.H, r.D, r.stride, r.theta);
  } else {
    b.rope_backward(x.get(), r.B, r.T, r.H, r.D, r.stride, r.theta);
  }
  return {out_of(name, x.host())};
}

// Forward and backward alike (rope_test.cpp): a rotated component x1' = x1 c -+ x2 s computed in
// float from a float table of cos and sin: the table's u |c|, u |s| plus the two products and the
// sum (an FMA fuses one): gamma(3) (|x1 c| + |x2 s|); the reference's rounding of its double result
// (u of it) and its double arithmetic (below u of the terms): gamma(4) in all; plus each side's
// angle error times |x1| + |x2|. The gaps between tokens are untouched: bound 0.
Outputs rope_bounds(const Tensors& in, const RopeCfg& r, const char* name) {
  const std::vector<float>& x = in.f(name);
  std::vector<double> bound(x.size(), 0.0);
  const int half = r.D / 2;
  for (int64_t n = 0; n < int64_t(r.B) * r.T; ++n) {
    const int t = int(n % r.T);
    for (int h = 0; h < r.H; ++h) {
      for (int i = 0; i < half; ++i) {
        const size_t i1 = size_t(n * r.stride + int64_t(h) * r.D + i), i2 = i1 + half;
        const Angle ang(t, i, r.D, r.theta);
        const double x1 = x[i1], x2 = x[i2];
        const double both = 2 * (std::fabs(x1) + std::fabs(x2)) * ang.err;
        bound[i1] = gamma(4) * (std::fabs(x1 * ang.c) + std::fabs(x2 * ang.s)) + both;
        bound[i2] = gamma(4) * (std::fabs(x2 * ang.c) + std::fabs(x1 * ang.s)) + both;
      }
    }
  }
  return {{name, bound}};
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
    for (Pass pass : {Pass::forward, Pass::backward}) {
      const bool fwd = pass == Pass::forward;
      Label label("rope", fwd ? "fwd" : "bwd");
      label.dim("B", r.B).dim("T", r.T).dim("H", r.H).dim("D", r.D).dim("stride", r.stride);
      label.dim("theta", int64_t(r.theta));
      OpCase c = make_case(Op::rope, pass, label);
      c.empty = r.B * r.T * r.D == 0;
      c.make_inputs = [r](uint64_t seed) { return rope_inputs(r, seed); };
      c.run = [r, fwd](Backend& b, const Tensors& in) { return rope_run(b, in, r, fwd); };
      c.bounds = [r, fwd](const Tensors& in, const Outputs&) {
        return rope_bounds(in, r, fwd ? "x" : "dx");
      };
      if (r.grad && !fwd) {
        // Backward rotates the upstream gradient dx in place (rope.h): the case's "dx" input is
        // the loss weights, and its output the gradient of sum dx * rope(x).
        GradSpec g;
        g.forward = [r](Backend& b, const Tensors& in) { return rope_run(b, in, r, true); };
        g.forward_bounds = [r](const Tensors& in, const Outputs&) {
          return rope_bounds(in, r, "x");
        };
        g.weights = [](const Tensors& in) { return Outputs{out_of("x", in.f("dx"))}; };
        g.params = {{"x", "dx"}};
        g.derive = [](Tensors&) {};
        g.dependents = [r](const Tensors&, std::string_view, size_t i) {
          return rope_dependents(r, i);
        };
        g.third_derivative = [](const Tensors&, std::string_view, size_t, double) { return 0.0; };
        c.grad = std::move(g);
      }
      out.push_back(std::move(c));
    }
  }
  // The contract: an odd head dimension throws.
  for (Pass pass : {Pass::forward, Pass::backward}) {
    const bool fwd = pass == Pass::forward;
    const RopeCfg r{1, 1, 4, 3, 12, 10000.0f, false};
    OpCase c =
        make_case(Op::rope, pass, Label("rope", fwd ? "fwd_rejects" : "bwd_rejects").dim("D", 3));
    c.expect_invalid_argument = true;
    c.make_inputs = [r](uint64_t seed) { return rope_inputs(r, seed); };
    c.run = [r, fwd](Backend& b, const Tensors& in) { return rope_run(b, in, r, fwd); };
    out.push_back(std::move(c));
  }
}

// ---- gelu, swiglu, residual ---------------------------------------------------------------------

namespace {

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi), as both kernels use it
constexpr double kGeluCube = 0.044715;

// The relative error of s = 1 / (1 + e) computed as fl(1 / fl(1 + fast_exp(m))) with fast_exp's
// result off by rel_e (its own error and its argument's, exp_error): an error t of e moves s by
// -w t / (1 + w t), w = e / (1 + e) = 1 - s, and the add and the divide round once each.
double sigmoid_error(double w, double rel_e) {
  return compose({w * rel_e / (1 - w * rel_e), (1 + u) / (1 - u) - 1});
}

// The float64 references evaluate each element in a few double operations and libm calls (glibc's
// exp and tanh are within 2 ulp on x86-64: four double roundings each); each rounds at most
// 2^-53 of an operand, so gamma64(ops) times the sum of the operands' magnitudes bounds the
// reference's double error. It then rounds to float (u of its result, and 2^-150 if subnormal).
double reference_error(double result, int ops, double operands) {
  return u * std::fabs(result) + gamma64(ops) * operands + kSubnormal;
}

// GELU as the cpu kernel evaluates it (activations_test.cpp): gelu(x) = x s, gelu'(x) = s + T with
// s = 1 / (1 + e), e = exp(m), m = -2 sqrt(2/pi) (x + 0.044715 x^3) formed in double and rounded
// to float once, and T = 2 x du e s^2, du = sqrt(2/pi) (1 + 3 0.044715 x^2).
struct Gelu {
  double x, m, z, s, t, du, T;
  explicit Gelu(float xf) : x(xf) {
    z = kGeluScale * (x + kGeluCube * x * x * x);
    m = -2 * z;
    s = 1 / (1 + std::exp(m));
    t = std::tanh(z);  // 0.5 (1 + t) = s
    du = kGeluScale * (1 + 3 * kGeluCube * x * x);
    T = 2 * x * du * s * (1 - s);
  }
  // |m_float - m|: the rounding to float (u) and the five double operations before it.
  double m_error() const { return (u + gamma64(5)) * std::fabs(m); }
  // fast_exp(m) relative to exp(m), valid for -87.33 <= m <= 88 (no clamping).
  double e_error() const { return testing::exp_error(m_error(), kFastExpError); }
  // fast_exp clamps m above 88 (to exp(88)) and returns 0 below -87.33: then s and T are within
  // a few exp(-87.3) of both exact values, all of one sign; these thresholds leave room for m's
  // rounding.
  bool clamped_high() const { return m > 87.99; }
  bool clamped_low() const { return m < -87.3; }
};

// Inputs: N(0, 3) values, and from n = 1000 on a dense grid over [-12, 12] in the first half,
// which covers both saturated tails.
std::vector<float> activation_inputs(int64_t n, uint64_t seed) {
  auto x = normal(size_t(n), seed, 3.0f);
  if (n >= 1000) {
    const int64_t grid = n / 2;
    for (int64_t i = 0; i < grid; ++i) x[size_t(i)] = -12.0f + 24.0f * float(i) / float(grid);
  }
  return x;
}

// gelu forward (activations_test.cpp): out = fl(x / fl(1 + e)). Unclamped, s carries
// sigmoid_error; clamped high, out and gelu both lie between 0 and x exp(-87.99); clamped low
// (e = 0), out = x and |gelu - x| <= |x| exp(-87.3). The reference rounds 0.5 x (1 + tanh z):
// twelve roundings (tanh counted as four) of operands 0.5 |x| (1 + |t|) and |gelu|, and z's error
// moves 1 + t by (1 - t^2) dz, at most 2 |z| dz of gelu relatively.
double gelu_out_bound(float xf) {
  const Gelu g(xf);
  const double ax = std::fabs(g.x), gelu = g.x * g.s;
  double cpu_err = g.clamped_high()
                       ? 2 * ax * std::exp(-87.99)
                       : std::fabs(gelu) * sigmoid_error(1 - g.s, g.e_error()) + kSubnormal;
  if (g.clamped_low()) cpu_err += ax * std::exp(-87.3);
  return cpu_err + reference_error(gelu, 12,
                                   0.5 * ax * (1 + std::fabs(g.t)) +
                                       (1 + 2 * std::fabs(g.z)) * std::fabs(gelu));
}

// gelu backward into zeros (activations_test.cpp): dinp = fl(fl(s + T) dout). s carries
// sigmoid_error; T = fl(fl(2x du) fl(e s s)): du rounds seven times (the constants, 3c x x, 1 + .,
// the product), all of positive terms; e s^2 = s (1 - s) moves by at most the error of e (its
// dependence through s cancels half of it) plus s's roundings twice and two products. The
// reference: (0.5 (1 + t) + 0.5 x (1 - t t) du) dout in double, 24 roundings (tanh counted as
// four) of operands 0.5 (1 + |t|), 0.5 |x| (1 + t^2) du, |s| + |T|; z's error moves s and T by
// at most 2 |z| dz relatively.
double gelu_dinp_bound(float xf, float dout) {
  const Gelu g(xf);
  const double ax = std::fabs(g.x), d = std::fabs(dout);
  double inner_err;  // |fl(s + T) - (s + T)|
  if (g.clamped_high() || g.clamped_low()) {
    // s, T and their computed values all within (1 + 2|x| du) 2 exp(-87.3) of the exact s and
    // T, plus the rounding of the sum.
    inner_err = u * std::fabs(g.s + g.T) + 2 * (1 + 2 * ax * g.du) * std::exp(-87.3);
  } else {
    const double rel_e = g.e_error();
    const double rel_s = sigmoid_error(1 - g.s, rel_e);
    const double r2 = (1 + u) / (1 - u) - 1;  // s's own two roundings
    const double rel_es2 = compose({rel_e / (1 - rel_e), r2, r2, gamma(2)});
    const double rel_T = compose({gamma(7), rel_es2, gamma(2)});
    const double terms_err = g.s * rel_s + std::fabs(g.T) * rel_T;
    inner_err = terms_err + u * (std::fabs(g.s + g.T) + terms_err);
  }
  const double grad = g.s + g.T;
  const double ref_operands = d * (0.5 * (1 + std::fabs(g.t)) + 0.5 * ax * (1 + g.t * g.t) * g.du +
                                   (1 + 2 * std::fabs(g.z)) * (g.s + std::fabs(g.T)));
  return d * inner_err + u * d * (std::fabs(grad) + inner_err) +
         reference_error(grad * dout, 24, ref_operands);
}

// swiglu (activations_test.cpp): s = fast_sigmoid(g) = fl(1 / fl(1 + fast_exp(-g))): -g is exact
// and fast_exp unclamped for |g| < 87, so s carries sigmoid_error with fast_exp's own error only.
struct SwigluBounds {
  double out, dgate, dup;
};

SwigluBounds swiglu_bounds(float gate, float up, float dout) {
  const double g = gate, ag = std::fabs(g), up_i = up, d = dout;
  if (!(ag < 87.0)) throw std::domain_error("swiglu bound: fast_exp(-gate) clamps");
  const double s = 1 / (1 + std::exp(-g));
  const double rel_s = sigmoid_error(1 - s, kFastExpError);
  SwigluBounds b;
  // out = fl(fl(g s) up): two more roundings. The reference: exp (four roundings) and four
  // operations, all relative to out (no cancellation).
  const double out = g * s * up_i;
  b.out = std::fabs(out) * compose({rel_s, gamma(2)}) + reference_error(out, 8, std::fabs(out));
  // dgate = fl(fl(fl(d up) s) F) with F = fl(1 + fl(g fl(1 - s))), which cancels near g = -1.28:
  // absolute errors through 1 - s (s's error, one rounding), times g (one), plus 1 (one; an FMA
  // fuses two of these). The reference: twelve roundings in double (exp as four), operands
  // P (1 + |g| + |F|).
  const double one_minus_s_err = s * rel_s + u * (1 - s + s * rel_s);
  const double g_term_err = ag * one_minus_s_err + u * ag * (1 - s + one_minus_s_err);
  const double F = 1 + g * (1 - s);
  const double F_err = g_term_err + u * (std::fabs(F) + g_term_err);
  const double P = std::fabs(d * up_i * s);  // d up s, off by rel_P relatively
  const double rel_P = compose({rel_s, gamma(2)});
  const double dgate_err = P * (std::fabs(F) * rel_P + (1 + rel_P) * F_err);
  const double dgate = d * up_i * s * F;
  b.dgate = dgate_err + u * (std::fabs(dgate) + dgate_err) +
            reference_error(dgate, 12, P * (1 + ag + std::fabs(F)));
  // dup = fl(fl(d g) s); the reference: eight roundings relative to dup.
  const double dup = d * g * s;
  b.dup = std::fabs(dup) * compose({rel_s, gamma(2)}) + reference_error(dup, 8, std::fabs(dup));
  return b;
}

// Bounds on the logistic function's derivatives over an interval whose smallest |y| is y_min:
// sigma' = sigma (1 - sigma) = e^-|y| / (1 + e^-|y|)^2 <= min(1/4, e^-|y|);
// sigma'' = sigma' (1 - 2 sigma), |1 - 2 sigma| <= 1, and its largest value is 1 / (6 sqrt 3);
// sigma''' = sigma' (1 - 6 sigma + 6 sigma^2), |.| <= 1 on [0, 1], largest value 1/8 (at y = 0).
struct SigmoidDerivatives {
  double d1, d2, d3;
  explicit SigmoidDerivatives(double y_min) {
    const double tail = std::exp(-y_min);
    d1 = std::min(0.25, tail);
    d2 = std::min(1 / (6 * std::sqrt(3.0)), tail);
    d3 = std::min(0.125, tail);
  }
};

// The least |y| over [lo, hi].
double least_magnitude(double lo, double hi) {
  return lo <= 0 && hi >= 0 ? 0.0 : std::min(std::fabs(lo), std::fabs(hi));
}

// gelu''' on [x - h, x + h]: gelu = x s(x), s = sigma(2 z(x)), z = a (x + b x^3) increasing, so
// gelu''' = 3 s'' + x s''' with s'' = sigma'' (2z')^2 + sigma' 2z'' and
// s''' = sigma''' (2z')^3 + 3 sigma'' (2z')(2z'') + sigma' 2z''', z' = a (1 + 3b x^2) <= a (1 + 3b
// X^2), |z''| = 6ab|x| <= 6ab X, z''' = 6ab (X = |x| + h), and sigma's derivatives at 2z bounded by
// SigmoidDerivatives over the interval's least |2z|.
double gelu_third_derivative(double x, double h) {
  auto two_z = [](double v) { return 2 * kGeluScale * (v + kGeluCube * v * v * v); };
  const SigmoidDerivatives sd(least_magnitude(two_z(x - h), two_z(x + h)));
  const double X = std::fabs(x) + h;
  const double z1 = 2 * kGeluScale * (1 + 3 * kGeluCube * X * X);  // 2 z'
  const double z2 = 2 * 6 * kGeluScale * kGeluCube * X;            // 2 |z''|
  const double z3 = 2 * 6 * kGeluScale * kGeluCube;                // 2 z'''
  const double s2 = sd.d2 * z1 * z1 + sd.d1 * z2;
  const double s3 = sd.d3 * z1 * z1 * z1 + 3 * sd.d2 * z1 * z2 + sd.d1 * z3;
  return 3 * s2 + X * s3;
}

// silu''' = (g sigma)''' = 3 sigma'' + g sigma''' on [g - h, g + h].
double silu_third_derivative(double g, double h) {
  const SigmoidDerivatives sd(least_magnitude(g - h, g + h));
  return 3 * sd.d2 + (std::fabs(g) + h) * sd.d3;
}

enum class Act { gelu, swiglu, residual };

struct ActCfg {
  Act act;
  int64_t n;
  bool grad;
};

Tensors activation_case_inputs(const ActCfg& a, uint64_t seed) {
  const size_t n = size_t(a.n);
  Tensors in;
  in.set("dout", normal(n, seed + 3));
  if (a.act == Act::gelu) {
    in.set("inp", activation_inputs(a.n, seed));
    in.set("dinp", normal(n, seed + 4));
  } else if (a.act == Act::swiglu) {
    in.set("gate", activation_inputs(a.n, seed));
    in.set("up", normal(n, seed + 1));
    in.set("dgate", normal(n, seed + 4));
    in.set("dup", normal(n, seed + 5));
  } else {
    in.set("a", normal(n, seed));
    in.set("b", normal(n, seed + 1));
    in.set("da", normal(n, seed + 4));
    in.set("db", normal(n, seed + 5));
  }
  return in;
}

Outputs activation_fwd(Backend& b, const Tensors& in, const ActCfg& a) {
  FBuf out(b, nans(size_t(a.n)));
  if (a.act == Act::gelu) {
    FBuf inp(b, in.f("inp"));
    b.gelu_forward(out.get(), inp.get(), a.n);
  } else if (a.act == Act::swiglu) {
    FBuf gate(b, in.f("gate")), up(b, in.f("up"));
    b.swiglu_forward(out.get(), gate.get(), up.get(), a.n);
  } else {
    FBuf x(b, in.f("a")), y(b, in.f("b"));
    b.residual_forward(out.get(), x.get(), y.get(), a.n);
  }
  return {out_of("out", out.host())};
}

Outputs activation_bwd(Backend& b, const Tensors& in, const ActCfg& a) {
  FBuf dout(b, in.f("dout"));
  if (a.act == Act::gelu) {
    FBuf inp(b, in.f("inp")), dinp(b, in.f("dinp"));
    b.gelu_backward(dinp.get(), inp.get(), dout.get(), a.n);
    return {out_of("dinp", dinp.host())};
  }
  if (a.act == Act::swiglu) {
    FBuf gate(b, in.f("gate")), up(b, in.f("up")), dgate(b, in.f("dgate")), dup(b, in.f("dup"));
    b.swiglu_backward(dgate.get(), dup.get(), dout.get(), gate.get(), up.get(), a.n);
    return {out_of("dgate", dgate.host()), out_of("dup", dup.host())};
  }
  FBuf da(b, in.f("da")), db(b, in.f("db"));
  b.residual_backward(da.get(), db.get(), dout.get(), a.n);
  return {out_of("da", da.host()), out_of("db", db.host())};
}

// Residual: out = a + b and da += dout, db += dout are one float add each: the same bits on every
// backend (bound 0). gelu and swiglu: the bounds above; backward adds into the pre-filled buffers
// (accumulated()).
Outputs activation_fwd_bounds(const Tensors& in, const ActCfg& a) {
  const size_t n = size_t(a.n);
  Output out{"out", std::vector<double>(n, 0.0)};
  if (a.act == Act::gelu) {
    for (size_t i = 0; i < n; ++i) out.values[i] = gelu_out_bound(in.f("inp")[i]);
  } else if (a.act == Act::swiglu) {
    for (size_t i = 0; i < n; ++i)
      out.values[i] = swiglu_bounds(in.f("gate")[i], in.f("up")[i], 0.0f).out;
  }
  return {out};
}

Outputs activation_bwd_bounds(const Tensors& in, const Outputs& ref, const ActCfg& a) {
  const size_t n = size_t(a.n);
  const auto& dout = in.f("dout");
  if (a.act == Act::gelu) {
    Output dinp{"dinp", std::vector<double>(n)};
    const auto& r = find(ref, "dinp");
    for (size_t i = 0; i < n; ++i) {
      dinp.values[i] = accumulated(gelu_dinp_bound(in.f("inp")[i], dout[i]), in.f("dinp")[i], r[i]);
    }
    return {dinp};
  }
  if (a.act == Act::swiglu) {
    Output dgate{"dgate", std::vector<double>(n)}, dup{"dup", std::vector<double>(n)};
    const auto& rg = find(ref, "dgate");
    const auto& ru = find(ref, "dup");
    for (size_t i = 0; i < n; ++i) {
      const SwigluBounds b = swiglu_bounds(in.f("gate")[i], in.f("up")[i], dout[i]);
      dgate.values[i] = accumulated(b.dgate, in.f("dgate")[i], rg[i]);
      dup.values[i] = accumulated(b.dup, in.f("dup")[i], ru[i]);
    }
    return {dgate, dup};
  }
  return {zeros("da", n), zeros("db", n)};
}

}  // namespace

void add_activations(std::vector<OpCase>& out) {
  // Tiny, odd (vector tails), both saturated tails (n >= 1000), above the cpu kernels' parallel
  // threshold (32768), and n = 0.
  const int64_t sizes[] = {0, 1, 7, 33, 1000, 40001};
  std::vector<ActCfg> cfgs;
  for (Act act : {Act::gelu, Act::swiglu, Act::residual}) {
    for (int64_t n : sizes) cfgs.push_back({act, n, false});
    cfgs.push_back({act, 41, true});
  }
  for (const ActCfg& a : cfgs) {
    const Op op = a.act == Act::gelu ? Op::gelu : a.act == Act::swiglu ? Op::swiglu : Op::residual;
    for (Pass pass : {Pass::forward, Pass::backward}) {
      Label label(op_name(op), pass == Pass::forward ? "fwd" : "bwd");
      label.dim("n", a.n);
      OpCase c = make_case(op, pass, label);
      c.empty = a.n == 0;
      c.make_inputs = [a](uint64_t seed) { return activation_case_inputs(a, seed); };
      if (pass == Pass::forward) {
        c.run = [a](Backend& b, const Tensors& in) { return activation_fwd(b, in, a); };
        c.bounds = [a](const Tensors& in, const Outputs&) { return activation_fwd_bounds(in, a); };
        out.push_back(std::move(c));
        continue;
      }
      c.run = [a](Backend& b, const Tensors& in) { return activation_bwd(b, in, a); };
      c.bounds = [a](const Tensors& in, const Outputs& ref) {
        return activation_bwd_bounds(in, ref, a);
      };
      if (a.grad) {
        GradSpec g;
        g.forward = [a](Backend& b, const Tensors& in) { return activation_fwd(b, in, a); };
        g.forward_bounds = [a](const Tensors& in, const Outputs&) {
          return activation_fwd_bounds(in, a);
        };
        g.weights = [](const Tensors& in) { return Outputs{out_of("out", in.f("dout"))}; };
        if (a.act == Act::gelu) g.params = {{"inp", "dinp"}};
        if (a.act == Act::swiglu) g.params = {{"gate", "dgate"}, {"up", "dup"}};
        if (a.act == Act::residual) g.params = {{"a", "da"}, {"b", "db"}};
        g.derive = [](Tensors& in) { zero(in, {"dinp", "dgate", "dup", "da", "db"}); };
        g.dependents = [](const Tensors&, std::string_view, size_t i) { return Deps{{"out", i}}; };
        // L = sum_i w_i f(x_i): d^3 L / dx_i^3 = w_i f'''(x_i); swiglu is linear in up and
        // residual in both.
        g.third_derivative = [a](const Tensors& in, std::string_view param, size_t i, double h) {
          const double w = std::fabs(in.f("dout")[i]);
          if (a.act == Act::gelu) return w * gelu_third_derivative(in.f("inp")[i], h);
          if (a.act == Act::swiglu && param == "gate")
            return w * std::fabs(in.f("up")[i]) * silu_third_derivative(in.f("gate")[i], h);
          return 0.0;
        };
        c.grad = std::move(g);
      }
      out.push_back(std::move(c));
    }
  }
}

// ---- cross_entropy ------------------------------------------------------------------------------

namespace {

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

// cross_entropy (cross_entropy_test.cpp): each side against the exact loss and gradient of its
// float logits, testing::cross_entropy_row_bound (the backend with fast_exp, the reference with
// libm, both summing in double; kernel_bounds.h derives it); the losses each rounded to float
// (u of each), the sums of the rows' double losses in row order (gamma64(N) each). Ignored rows
// and padding columns are exact zeros, the count exact.
Outputs ce_bounds(const Tensors& in, const CeCfg& c) {
  const auto& logits = in.f("logits");
  const auto& targets = in.i("targets");
  Output dl{"dlogits", std::vector<double>(size_t(c.N) * c.Vp, 0.0)};
  Output losses{"losses", std::vector<double>(size_t(c.N), 0.0)};
  double sum_bound = 0, magnitude = 0;
  for (int n = 0; n < c.N; ++n) {
    if (targets[n] == kIgnore) continue;
    const float* x = logits.data() + size_t(n) * c.Vp;
    const auto fast = testing::cross_entropy_row_bound(x, c.V, targets[n], c.gs, true, 0);
    const auto libm = testing::cross_entropy_row_bound(x, c.V, targets[n], c.gs, false, 0);
    for (int v = 0; v < c.V; ++v)
      dl.values[size_t(n) * c.Vp + v] = fast.dlogit_error[v] + libm.dlogit_error[v];
    const double both = fast.loss_error + libm.loss_error;
    losses.values[n] = both + u * (2 * std::fabs(fast.loss) + both);
    sum_bound += both;
    magnitude += std::fabs(fast.loss) + both;
  }
  return {dl, losses, {"loss_sum", {sum_bound + 2 * gamma64(c.N) * magnitude}}, zeros("valid", 1)};
}

// The loss is grad_scale times a sum of rows' logsumexp(x) - x_target: along logit v of a valid
// row, d^3/dx_v^3 logsumexp = p (1 - p)(1 - 2p), at most 1 / (6 sqrt 3) in size; 0 for padding
// columns and ignored rows.
double ce_third_derivative(const std::vector<int32_t>& targets, int V, int Vp, float gs, size_t i) {
  const size_t n = i / size_t(Vp), v = i % size_t(Vp);
  if (targets[n] == kIgnore || v >= size_t(V)) return 0.0;
  return std::fabs(gs) / (6 * std::sqrt(3.0));
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
    OpCase oc = make_case(Op::cross_entropy, with_dlogits ? Pass::backward : Pass::forward, label);
    oc.empty = c.N == 0;
    oc.make_inputs = [c](uint64_t seed) { return ce_inputs(c, seed); };
    oc.run = [c, with_dlogits](Backend& b, const Tensors& in) {
      return ce_run(b, in, c, with_dlogits);
    };
    oc.bounds = [c](const Tensors& in, const Outputs&) { return ce_bounds(in, c); };
    if (c.grad) {
      // dlogits is the gradient of grad_scale * loss_sum.
      GradSpec g;
      g.forward = [c](Backend& b, const Tensors& in) { return ce_run(b, in, c, false); };
      g.forward_bounds = [c](const Tensors& in, const Outputs&) { return ce_bounds(in, c); };
      g.weights = [c](const Tensors&) { return Outputs{{"loss_sum", {double(c.gs)}}}; };
      g.params = {{"logits", "dlogits"}};
      g.samples = int(c.N * c.Vp);
      g.derive = [](Tensors&) {};
      g.dependents = [](const Tensors&, std::string_view, size_t) { return Deps{{"loss_sum", 0}}; };
      g.third_derivative = [c](const Tensors& in, std::string_view, size_t i, double) {
        return ce_third_derivative(in.i("targets"), c.V, c.Vp, c.gs, i);
      };
      oc.grad = std::move(g);
    }
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

// The three steps against the exact values (vocab_parallel_ce_test.cpp): cross_entropy_row_bound
// with the shard sums' tp float roundings, the backend with fast_exp and the reference with libm;
// every rank's losses and loss sum alike.
Outputs vp_pipeline_bounds(const Tensors& in, const VpCfg& v) {
  const auto& full = in.f("full");
  const auto& targets = in.i("targets");
  Output dl{"dlogits", std::vector<double>(size_t(v.N) * v.Vp, 0.0)};
  std::vector<double> loss_bound(size_t(v.N), 0.0);
  double sum_bound = 0, magnitude = 0;
  for (int n = 0; n < v.N; ++n) {
    if (targets[n] == kIgnore) continue;
    const float* x = full.data() + size_t(n) * v.Vp;
    const auto fast = testing::cross_entropy_row_bound(x, v.V, targets[n], v.gs, true, v.tp);
    const auto libm = testing::cross_entropy_row_bound(x, v.V, targets[n], v.gs, false, v.tp);
    for (int j = 0; j < v.V; ++j)
      dl.values[size_t(n) * v.Vp + j] = fast.dlogit_error[j] + libm.dlogit_error[j];
    const double both = fast.loss_error + libm.loss_error;
    loss_bound[n] = both + u * (2 * std::fabs(fast.loss) + both);
    sum_bound += both;
    magnitude += std::fabs(fast.loss) + both;
  }
  Output losses{"losses", {}}, loss_sum{"loss_sum", {}};
  for (int r = 0; r < v.tp; ++r) {
    losses.values.insert(losses.values.end(), loss_bound.begin(), loss_bound.end());
    loss_sum.values.push_back(sum_bound + 2 * gamma64(v.N) * magnitude);
  }
  return {dl, losses, loss_sum, zeros("valid", size_t(v.tp))};
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
    OpCase c = make_case(Op::vocab_parallel_ce, Pass::backward, label);
    c.empty = v.N == 0;
    c.make_inputs = [v](uint64_t seed) { return vp_inputs(v, seed, 0); };
    c.run = [v](Backend& b, const Tensors& in) { return vp_pipeline(b, in, v, true); };
    c.bounds = [v](const Tensors& in, const Outputs&) { return vp_pipeline_bounds(in, v); };
    if (v.grad) {
      // The shards' dlogits are the gradient of grad_scale * loss_sum (rank 0's; all agree) of
      // the sharded computation, with respect to the full logits.
      GradSpec g;
      g.forward = [v](Backend& b, const Tensors& in) { return vp_pipeline(b, in, v, false); };
      g.forward_bounds = [v](const Tensors& in, const Outputs&) {
        return vp_pipeline_bounds(in, v);
      };
      g.weights = [v](const Tensors&) {
        Output w{"loss_sum", std::vector<double>(size_t(v.tp), 0.0)};
        w.values[0] = v.gs;
        return Outputs{w};
      };
      g.params = {{"full", "dlogits"}};
      g.samples = v.N * v.Vp;
      g.derive = [](Tensors&) {};
      g.dependents = [](const Tensors&, std::string_view, size_t) { return Deps{{"loss_sum", 0}}; };
      g.third_derivative = [v](const Tensors& in, std::string_view, size_t i, double) {
        return ce_third_derivative(in.i("targets"), v.V, v.Vp, v.gs, i);
      };
      c.grad = std::move(g);
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

// ---- adamw_update, sum_of_squares, scale --------------------------------------------------------

namespace {

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
Outputs adam_bounds(const Tensors& in, const AdamCfg& a) {
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
      OpCase c = make_case(Op::adamw, Pass::forward, label);
      c.empty = a.n == 0;
      c.make_inputs = [a](uint64_t seed) { return adam_inputs(a, seed); };
      c.run = [a](Backend& b, const Tensors& in) { return adam_run(b, in, a); };
      c.bounds = [a](const Tensors& in, const Outputs&) { return adam_bounds(in, a); };
      out.push_back(std::move(c));
    }
  }
  // sum_of_squares: the products of two floats are exact in double (48 bits), so each side sums n
  // exact positive terms in double, in any order within gamma64(n - 1) S of S = sum x^2
  // (rounding.h with the float64 unit roundoff); S <= r / (1 - gamma64(n)) from the reference's r:
  // bound 2 gamma64(n) r / (1 - gamma64(n)). (A backend summing in float breaks the contract of
  // optimizer.h and fails.)
  for (int64_t n :
       {int64_t(0), int64_t(1), int64_t(7), int64_t(33), int64_t(65539), int64_t(300007)}) {
    OpCase c = make_case(Op::grad_norm, Pass::forward, Label("sum_of_squares", "fwd").dim("n", n));
    c.empty = n == 0;
    c.make_inputs = [n](uint64_t seed) {
      Tensors in;
      in.set("x", normal(size_t(n), seed));
      return in;
    };
    c.run = [](Backend& b, const Tensors& in) {
      FBuf x(b, in.f("x"));
      return Outputs{{"sum", {b.sum_of_squares(x.get(), int64_t(in.f("x").size()))}}};
    };
    c.bounds = [n](const Tensors&, const Outputs& ref) {
      const double g = gamma64(n), r = find(ref, "sum")[0];
      return Outputs{{"sum", {2 * g * r / (1 - g)}}};
    };
    out.push_back(std::move(c));
  }
  // scale: one float multiply per element, the same bits everywhere (bound 0).
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(33), int64_t(70001)}) {
    OpCase c = make_case(Op::grad_norm, Pass::forward, Label("scale", "fwd").dim("n", n));
    c.empty = n == 0;
    c.make_inputs = [n](uint64_t seed) {
      Tensors in;
      in.set("x", normal(size_t(n), seed));
      return in;
    };
    c.run = [](Backend& b, const Tensors& in) {
      FBuf x(b, in.f("x"));
      b.scale(x.get(), int64_t(in.f("x").size()), 0.3f);
      return Outputs{out_of("x", x.host())};
    };
    c.bounds = [n](const Tensors&, const Outputs&) { return Outputs{zeros("x", size_t(n))}; };
    out.push_back(std::move(c));
  }
}

}  // namespace tessel::kernels::harness::cases
