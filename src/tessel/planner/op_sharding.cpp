#include "tessel/planner/op_sharding.h"

#include <fmt/format.h>

#include <algorithm>

#include "tessel/core/check.h"

namespace tessel::planner {

std::string to_string(const Shard& s) {
  switch (s.kind) {
    case Shard::Kind::replicated:
      return "R";
    case Shard::Kind::split:
      return fmt::format("S({})", s.dim);
    case Shard::Kind::partial:
      return "P";
  }
  return "?";
}

namespace {

using Shape = std::vector<int64_t>;

double weight_elements(const std::vector<Shape>& weights, const std::vector<Shard>& layouts,
                       int t) {
  double n = 0;
  for (size_t i = 0; i < weights.size(); ++i)
    n += double(elements(weights[i])) / (layouts[i].kind == Shard::Kind::split ? t : 1);
  return n;
}

class Enumerator {
 public:
  Enumerator(const OpGraph& g, int id, int t)
      : g_(g), n_(g.node(id)), t_(t), weights_(g.weights_used_by(id)) {}

  std::vector<OpStrategy> run() {
    add("replicated", Shard::R(), std::vector<Shard>(n_.inputs.size(), Shard::R()),
        std::vector<Shard>(weights_.size(), Shard::R()), 1);
    switch (n_.kind) {
      case OpKind::matmul:
        weights_.empty() ? activation_matmul() : linear();
        break;
      case OpKind::gather:
        gather();
        break;
      case OpKind::add:
      case OpKind::mul:
      case OpKind::gelu:
      case OpKind::silu:
        elementwise(n_.kind == OpKind::add || (n_.kind == OpKind::mul && n_.inputs.size() == 1));
        break;
      case OpKind::layer_norm:
      case OpKind::rms_norm:
      case OpKind::softmax:
      case OpKind::rope:
        all_but_last(input_shape(0));
        break;
      case OpKind::loss: {
        all_but_last(input_shape(0), /*out_scalar=*/true);
        const Shape& logits = input_shape(0);
        if (divides(logits.back())) {
          add("vocab", Shard::R(), {Shard::S(int(logits.size()) - 1), Shard::R()}, {}, t_);
          const double tokens = double(elements(logits)) / double(logits.back());
          out_.back().comm_bytes = 3 * 2.0 * double(t_ - 1) / t_ * tokens * 4;
        }
        break;
      }
      case OpKind::reshape:
      case OpKind::transpose:
      case OpKind::split:
      case OpKind::concat:
        layout_op();
        break;
      case OpKind::input:
        for (int d = 0; d < int(n_.shape.size()); ++d)
          if (divides(n_.shape[size_t(d)]))
            add(fmt::format("split({})", d), Shard::S(d), {}, {}, t_);
        break;
      case OpKind::conv:
        conv();
        break;
      case OpKind::reduce:
        reduce();
        break;
      case OpKind::other:
        break;
    }
    return std::move(out_);
  }

 private:
  const Shape& input_shape(size_t i) const { return g_.node(n_.inputs[i]).shape; }
  bool divides(int64_t size) const { return size % t_ == 0; }
  void add(std::string name, Shard out, std::vector<Shard> in, std::vector<Shard> weights,
           int divide) {
    OpStrategy s;
    s.name = std::move(name);
    s.out = out;
    s.in = std::move(in);
    if (weights.empty()) weights.assign(weights_.size(), Shard::R());
    s.weights = std::move(weights);
    s.flops = n_.flops / divide;
    s.weight_elements = weight_elements(weights_, s.weights, t_);
    out_.push_back(std::move(s));
  }

  // x[..., K] W[..., K, N] (+ bias[N]); a tied head reads table[N, K]. W's leading dimensions
  // (stacked experts: [E, K, N]) line up with x's from the right.
  void linear() {
    const Shape& x = input_shape(0);
    const int last = int(n_.shape.size()) - 1;
    const bool tied = n_.weights_of >= 0;
    const int w_rank = int(weights_.front().size());
    const int64_t K = x.back(), N = n_.shape.back();
    auto weights = [&](Shard w0, bool bias_split) {
      std::vector<Shard> w = {w0};
      for (size_t i = 1; i < weights_.size(); ++i)  // the bias [N]: split with N, else whole
        w.push_back(bias_split ? Shard::S(0) : Shard::R());
      return w;
    };
    // Column splits N (W's last dimension), row splits K; the tied table [N, K] the reverse.
    if (divides(N))
      add("column", Shard::S(last), {Shard::R()}, weights(Shard::S(tied ? 0 : w_rank - 1), true),
          t_);
    if (divides(K))
      add("row", Shard::P(), {Shard::S(last)}, weights(Shard::S(tied ? 1 : w_rank - 2), false), t_);
    // A batch split keeps W whole, unless the dimension is one of W's own (experts): then each
    // device holds its experts, and no weight gradient needs summing.
    for (int d = 0; d < last; ++d) {
      if (!divides(n_.shape[size_t(d)])) continue;
      const int w_dim = d - (last + 1 - w_rank);
      add(fmt::format("batch({})", d), Shard::S(d), {Shard::S(d)},
          w_dim >= 0 && w_dim < w_rank - 2 ? weights(Shard::S(w_dim), false) : std::vector<Shard>{},
          t_);
    }
  }

  // a[..., M, K] b[..., K, N] -> y[..., M, N], or b given as [..., N, K] (q k^T).
  void activation_matmul() {
    const Shape& a = input_shape(0);
    const Shape& b = input_shape(1);
    const int rank = int(n_.shape.size());
    const bool b_transposed = b.back() != n_.shape.back();
    const int b_k = b_transposed ? rank - 1 : rank - 2;
    // A batch dimension an operand broadcasts (size 1 there: the MoE's tokens [b, 1, t, C] for
    // every expert) is read whole by every device.
    auto batch_layout = [&](const Shape& operand, int d) {
      return operand[size_t(d)] == 1 && n_.shape[size_t(d)] != 1 ? Shard::R() : Shard::S(d);
    };
    for (int d = 0; d < rank - 2; ++d)
      if (divides(n_.shape[size_t(d)]))
        add(fmt::format("batch({})", d), Shard::S(d), {batch_layout(a, d), batch_layout(b, d)}, {},
            t_);
    if (divides(a.back()))
      add("contraction", Shard::P(), {Shard::S(rank - 1), Shard::S(b_k)}, {}, t_);
  }

  // x[B, Cin, ...] * W[Cout, Cin, ...] (+ bias[Cout]) -> y[B, Cout, ...]: the batch (weights
  // replicated), output channels (W's rows, like a column split), or input channels (W's
  // columns, partial sums, like a row split).
  void conv() {
    const Shape& x = input_shape(0);
    if (divides(n_.shape[0])) add("batch(0)", Shard::S(0), {Shard::S(0)}, {}, t_);
    std::vector<Shard> out_channels = {Shard::S(0)}, in_channels = {Shard::S(1)};
    for (size_t i = 1; i < weights_.size(); ++i) {  // the bias follows the output channels
      out_channels.push_back(Shard::S(0));
      in_channels.push_back(Shard::R());
    }
    if (divides(n_.shape[1])) add("out_channels", Shard::S(1), {Shard::R()}, out_channels, t_);
    if (x.size() > 1 && divides(x[1]))
      add("in_channels", Shard::P(), {Shard::S(1)}, in_channels, t_);
  }

  // A reduction keeping its leading dimensions (a global pool [B, C, H, W] -> [B, C]): split
  // along a kept one.
  void reduce() {
    const Shape& x = input_shape(0);
    for (int d = 0; d < int(n_.shape.size()) && d < int(x.size()); ++d) {
      if (x[size_t(d)] != n_.shape[size_t(d)]) break;
      if (divides(x[size_t(d)]))
        add(fmt::format("split({})", d), Shard::S(d), {Shard::S(d)}, {}, t_);
    }
  }

  // table[V, C] looked up with ids [...] -> [..., C].
  void gather() {
    const Shape& table = weights_.front();
    const int last = int(n_.shape.size()) - 1;
    if (divides(table[0])) add("vocab", Shard::P(), {Shard::R()}, {Shard::S(0)}, t_);
    if (divides(table[1])) add("hidden", Shard::S(last), {Shard::R()}, {Shard::S(1)}, t_);
    const Shape& ids = input_shape(0);
    for (int d = 0; d < int(ids.size()); ++d)
      if (divides(ids[size_t(d)]))
        add(fmt::format("batch({})", d), Shard::S(d), {Shard::S(d)}, {}, t_);
  }

  // Same layout for the output and every input, inputs of lower rank broadcast from the right.
  void elementwise(bool linear_in_partials) {
    const int rank = int(n_.shape.size());
    for (int d = 0; d < rank; ++d) {
      if (!divides(n_.shape[size_t(d)])) continue;
      std::vector<Shard> in;
      bool ok = true;
      for (size_t i = 0; i < n_.inputs.size(); ++i) {
        const Shape& s = input_shape(i);
        const int aligned = d - (rank - int(s.size()));
        if (aligned < 0 || s[size_t(aligned)] == 1) {
          in.push_back(Shard::R());  // broadcast along d: each device needs all of it
        } else if (s[size_t(aligned)] == n_.shape[size_t(d)]) {
          in.push_back(Shard::S(aligned));
        } else {
          ok = false;
        }
      }
      if (ok) add(fmt::format("split({})", d), Shard::S(d), std::move(in), {}, t_);
    }
    // A sum of partials is the partial of the sum; a scale of one is the partial of the scale.
    // Every input must be partial and of the output's shape (a broadcast addend would be
    // counted t times).
    if (!linear_in_partials) return;
    for (size_t i = 0; i < n_.inputs.size(); ++i)
      if (input_shape(i) != n_.shape) return;
    add("partial", Shard::P(), std::vector<Shard>(n_.inputs.size(), Shard::P()), {}, 1);
  }

  // Split along any dimension but the last (which the operator reduces over).
  void all_but_last(const Shape& x, bool out_scalar = false) {
    for (int d = 0; d + 1 < int(x.size()); ++d) {
      if (!divides(x[size_t(d)])) continue;
      std::vector<Shard> in(n_.inputs.size(), Shard::S(d));
      // A mean over every token of a split batch: each device's part of the sum.
      add(fmt::format("split({})", d), out_scalar ? Shard::P() : Shard::S(d), std::move(in), {},
          t_);
    }
  }

  void layout_op() {
    const Shape& x = input_shape(0);
    for (int d = 0; d < int(x.size()); ++d) {
      const int e = d < int(n_.dim_of.size()) ? n_.dim_of[size_t(d)] : -1;
      if (e < 0 || !divides(x[size_t(d)]) || !divides(n_.shape[size_t(e)])) continue;
      add(fmt::format("split({})", d), Shard::S(e), {Shard::S(d)}, {}, t_);
    }
    add("partial", Shard::P(), {Shard::P()}, {}, 1);
  }

  const OpGraph& g_;
  const OpNode& n_;
  const int t_;
  const std::vector<Shape>& weights_;
  std::vector<OpStrategy> out_;
};

}  // namespace

std::vector<OpStrategy> op_strategies(const OpGraph& graph, int id, int t) {
  TESSEL_CHECK(t >= 1 && id >= 0 && id < graph.size(), InvalidArgumentError,
               "op_strategies: node {} of {} on {} devices", id, graph.size(), t);
  if (t == 1) {
    const OpNode& n = graph.node(id);
    const auto& w = graph.weights_used_by(id);
    OpStrategy s{"replicated",
                 Shard::R(),
                 std::vector<Shard>(n.inputs.size(), Shard::R()),
                 std::vector<Shard>(w.size(), Shard::R()),
                 n.flops,
                 0};
    for (const auto& shape : w) s.weight_elements += double(elements(shape));
    return {s};
  }
  return Enumerator(graph, id, t).run();
}

Reshard reshard(const Shard& from, const Shard& to, double bytes, int t) {
  TESSEL_CHECK(t >= 1 && bytes >= 0, InvalidArgumentError, "reshard: {} bytes on {} devices", bytes,
               t);
  using K = Shard::Kind;
  if (from == to || t == 1 || to.kind == K::partial || (from.kind == K::replicated)) return {};
  const double f = double(t - 1) / t;
  if (from.kind == K::split && to.kind == K::replicated) return {"all-gather", f * bytes, bytes};
  if (from.kind == K::partial && to.kind == K::split) return {"reduce-scatter", f * bytes, bytes};
  if (from.kind == K::partial && to.kind == K::replicated)
    return {"all-reduce", 2 * f * bytes, bytes};
  return {"all-to-all", f * bytes / t, bytes};  // S(d) -> S(e)
}

}  // namespace tessel::planner
