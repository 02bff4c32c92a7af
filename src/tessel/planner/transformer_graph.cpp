#include "tessel/planner/transformer_graph.h"

#include <fmt/format.h>

#include <string>
#include <utility>

#include "tessel/core/check.h"

namespace tessel::planner {

namespace {

using Shape = std::vector<int64_t>;

class Builder {
 public:
  explicit Builder(OpGraph& g) : g_(g) {}
  int layer = -1;

  int node(const std::string& name, OpKind kind, std::vector<int> inputs, Shape shape, double flops,
           std::vector<Shape> weights = {}) {
    OpNode n;
    n.name = layer >= 0 ? fmt::format("h.{}.{}", layer, name) : name;
    n.kind = kind;
    n.inputs = std::move(inputs);
    n.shape = std::move(shape);
    n.flops = flops;
    n.weights = std::move(weights);
    n.layer = layer;
    return g_.add(std::move(n));
  }
  const Shape& shape(int id) const { return g_.node(id).shape; }
  // A layout operator whose input dimension d becomes output dimension dim_of[d].
  int layout(const std::string& name, OpKind kind, int x, Shape out, std::vector<int> dim_of) {
    OpNode n;
    n.name = layer >= 0 ? fmt::format("h.{}.{}", layer, name) : name;
    n.kind = kind;
    n.inputs = {x};
    n.shape = std::move(out);
    n.layer = layer;
    n.dim_of = std::move(dim_of);
    return g_.add(std::move(n));
  }

  // x [..., K] times a [K, N] weight (+ a bias of N): [..., N].
  int linear(const std::string& name, int x, int64_t n, bool bias) {
    Shape out = shape(x);
    const int64_t k = out.back();
    out.back() = n;
    std::vector<Shape> w = {{k, n}};
    if (bias) w.push_back({n});
    return node(name, OpKind::matmul, {x}, out, 2.0 * double(elements(out)) * double(k),
                std::move(w));
  }
  // Same shape as the first input, one FLOP per output element.
  int pointwise(const std::string& name, OpKind kind, std::vector<int> inputs, double per = 1) {
    const Shape out = shape(inputs.front());
    return node(name, kind, std::move(inputs), out, per * double(elements(out)));
  }
  int norm(const std::string& name, OpKind kind, int x, int64_t c, bool bias) {
    std::vector<Shape> w = {{c}};
    if (bias) w.push_back({c});
    const Shape out = shape(x);
    return node(name, kind, {x}, out, 5.0 * double(elements(out)), std::move(w));
  }

 private:
  OpGraph& g_;
};

}  // namespace

OpGraph transformer_graph(const model::ModelConfig& m, int64_t B, int T) {
  m.validate();
  TESSEL_CHECK(B >= 1 && T >= 1 && T <= m.max_seq_len, ConfigError,
               "transformer_graph: micro-batch {} and sequence {} for model '{}' (max_seq_len {}); "
               "need a micro-batch >= 1 and a sequence in [1, max_seq_len]",
               B, T, m.name, m.max_seq_len);
  const bool gpt2 = m.family == model::Family::gpt2;
  const bool bias = gpt2 && m.bias;
  const int64_t C = m.n_embd, F = m.ffn_hidden, Vp = m.padded_vocab(), H = m.n_head,
                Hkv = m.n_kv_head, D = m.head_dim();
  OpGraph g;
  Builder b(g);
  const int tokens = b.node("tokens", OpKind::input, {}, {B, T}, 0);
  const int targets = b.node("targets", OpKind::input, {}, {B, T}, 0);
  const int embed = b.node(gpt2 ? "wte" : "embed_tokens", OpKind::gather, {tokens}, {B, T, C},
                           double(B * T * C), {{Vp, C}});
  int x = embed;
  if (gpt2) {
    const int positions = b.node("positions", OpKind::input, {}, {T}, 0);
    const int wpe = b.node("wpe", OpKind::gather, {positions}, {T, C}, double(T * C),
                           {{int64_t(m.max_seq_len), C}});
    x = b.pointwise("embed_add", OpKind::add, {embed, wpe});
  }
  const Shape heads = {B, H, T, D}, scores = {B, H, T, T};
  const double score_flops = 2.0 * double(B * H * T * T * D);
  auto attention = [&](int q, int k, int v) {
    const int qk = b.node("qk", OpKind::matmul, {q, k}, scores, score_flops);
    const int scaled = b.pointwise("scale", OpKind::mul, {qk});
    const int p =
        b.node("softmax", OpKind::softmax, {scaled}, scores, 5.0 * double(elements(scores)));
    const int pv = b.node("pv", OpKind::matmul, {p, v}, heads, score_flops);
    // [B, H, T, D] -> [B, T, C]: heads are C's outer part, D its inner one.
    return b.layout("merge_heads", OpKind::reshape, pv, {B, T, C}, {0, 2, 1, -1});
  };
  for (int l = 0; l < m.n_layer; ++l) {
    b.layer = l;
    const int residual = x;
    if (gpt2) {
      const int ln1 = b.norm("ln_1", OpKind::layer_norm, x, C, bias);
      const int qkv = b.linear("attn.c_attn", ln1, 3 * C, bias);
      int part[3];
      for (int i = 0; i < 3; ++i) {
        // c_attn's columns as Megatron lays them out per partition (q_i, k_i, v_i), so a split
        // of its output is a split of each of q, k and v.
        const int s =
            b.layout(fmt::format("split.{}", "qkv"[i]), OpKind::split, qkv, {B, T, C}, {0, 1, 2});
        part[i] = b.layout(fmt::format("heads.{}", "qkv"[i]), OpKind::reshape, s, heads, {0, 2, 1});
      }
      const int att = attention(part[0], part[1], part[2]);
      const int proj = b.linear("attn.c_proj", att, C, bias);
      const int add1 = b.pointwise("residual_1", OpKind::add, {residual, proj});
      const int ln2 = b.norm("ln_2", OpKind::layer_norm, add1, C, bias);
      const int fc = b.linear("mlp.c_fc", ln2, F, bias);
      const int act = b.pointwise("gelu", OpKind::gelu, {fc}, 8);
      const int down = b.linear("mlp.c_proj", act, C, bias);
      x = b.pointwise("residual_2", OpKind::add, {add1, down});
    } else {
      const int n1 = b.norm("input_layernorm", OpKind::rms_norm, x, C, false);
      const int q = b.linear("self_attn.q_proj", n1, H * D, false);
      const int k = b.linear("self_attn.k_proj", n1, Hkv * D, false);
      const int v = b.linear("self_attn.v_proj", n1, Hkv * D, false);
      const Shape kv_heads = {B, Hkv, T, D};
      const int qh = b.layout("heads.q", OpKind::reshape, q, heads, {0, 2, 1});
      int kh = b.layout("heads.k", OpKind::reshape, k, kv_heads, {0, 2, 1});
      int vh = b.layout("heads.v", OpKind::reshape, v, kv_heads, {0, 2, 1});
      const int qr = b.node("rope.q", OpKind::rope, {qh}, heads, 3.0 * double(elements(heads)));
      kh = b.node("rope.k", OpKind::rope, {kh}, kv_heads, 3.0 * double(elements(kv_heads)));
      if (Hkv != H) {  // grouped-query attention: each kv head serves H / Hkv query heads
        kh = b.layout("repeat_kv.k", OpKind::concat, kh, heads, {0, 1, 2, 3});
        vh = b.layout("repeat_kv.v", OpKind::concat, vh, heads, {0, 1, 2, 3});
      }
      const int att = attention(qr, kh, vh);
      const int o = b.linear("self_attn.o_proj", att, C, false);
      const int add1 = b.pointwise("residual_1", OpKind::add, {residual, o});
      const int n2 = b.norm("post_attention_layernorm", OpKind::rms_norm, add1, C, false);
      const int gate = b.linear("mlp.gate_proj", n2, F, false);
      const int up = b.linear("mlp.up_proj", n2, F, false);
      const int act = b.pointwise("silu", OpKind::silu, {gate}, 4);
      const int prod = b.pointwise("gate_up", OpKind::mul, {act, up});
      const int down = b.linear("mlp.down_proj", prod, C, false);
      x = b.pointwise("residual_2", OpKind::add, {add1, down});
    }
  }
  b.layer = -1;
  const int final_norm =
      b.norm(gpt2 ? "ln_f" : "norm", gpt2 ? OpKind::layer_norm : OpKind::rms_norm, x, C, bias);
  int logits = -1;
  if (m.tie_embeddings) {
    OpNode head;
    head.name = "lm_head";
    head.kind = OpKind::matmul;
    head.inputs = {final_norm};
    head.shape = {B, T, Vp};
    head.flops = 2.0 * double(B * T) * double(C) * double(Vp);
    head.weights_of = embed;  // the embedding's table, transposed
    logits = g.add(std::move(head));
  } else {
    logits = b.linear("lm_head", final_norm, Vp, false);
  }
  b.node("loss", OpKind::loss, {logits, targets}, {}, 5.0 * double(B * T) * double(Vp));
  return g;
}

}  // namespace tessel::planner
