// Tensor parallelism end to end: tp ranks as threads (LocalTpGroup), each building its shard of
// a Transformer, against the same model built whole (tp = 1).
//
// Tolerances (testing/rounding.h). The shards compute the same sums as the whole model, split
// into tp partial sums that are rounded to float before the all-reduce adds them, and the GEMMs
// block differently at the smaller shapes: the same reductions in other orders. So results agree
// to float rounding, not bit for bit:
// - the loss, the logits and every gradient element to step_tolerance (the chain of the step's
//   reductions, both sides) times the scale of their tensor;
// - after AdamW steps, every parameter element to AdamDivergence's bound, which follows the
//   optimizer's arithmetic from the whole model's gradients: tight where a gradient stands above
//   the rounding, up to lr per step where it does not (AdamW divides by the gradient's RMS; the
//   gpt2 key bias has an exactly zero gradient, softmax ignoring a shift of all scores), and the
//   losses after the first step to their rounding plus the first-order effect of that divergence.
// Initial parameters, and the gradients and parameters of copies of replicated elements across
// ranks, are compared bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/local_tp_group_test_util.h"
#include "tessel/model/rounding_test_util.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/tp_shard.h"
#include "tessel/model/transformer.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/testing/adam_divergence.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::model {
namespace {

constexpr float kLr = 1e-2f;
constexpr float kWeightDecay = 0.1f;

// Both sides' rounding of one step over B x T tokens (forward only for the loss and logits),
// relative to the scale of each result tensor.
double grad_tolerance(const ModelConfig& c, int B, int T) {
  return test_util::step_tolerance(c, int64_t(B) * T, T);
}
double forward_tolerance(const ModelConfig& c, int B, int T) {
  return test_util::step_tolerance(c, int64_t(B) * T, T, /*backward=*/false);
}

struct Batch {
  std::vector<int32_t> tokens, targets;
  int64_t valid = 0;
};

// Random tokens and targets, every 5th target ignored; every vocabulary shard sees tokens.
Batch random_batch(int B, int T, int V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int i = 0; i < B * T; ++i) b.tokens.push_back(int32_t(rng() % uint64_t(V)));
  for (int i = 0; i < B * T; ++i) {
    const bool ignore = i % 5 == 4;
    b.targets.push_back(ignore ? -1 : int32_t(rng() % uint64_t(V)));
    b.valid += ignore ? 0 : 1;
  }
  b.tokens[0] = V - 1;  // the last real token, in the last shard holding real rows
  b.targets[1] = V - 1;
  return b;
}

struct Case {
  std::string name;
  ModelConfig config;
  int tp;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

ModelConfig small(const char* preset, int n_kv_head = 0) {
  ModelConfig c = ModelConfig::preset(preset);
  c.n_layer = 2;
  if (n_kv_head > 0) c.n_kv_head = n_kv_head;
  return c;
}

// gpt2 (fused QKV, biases, tied head), llama with 2 kv heads (split at tp 2, replicated at tp
// 4) and multi-query llama (one kv head, replicated on every rank).
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {2, 4}) {
    out.push_back({"gpt2_tp" + std::to_string(tp), small("gpt2-tiny"), tp});
    out.push_back({"llama_tp" + std::to_string(tp), small("llama-tiny"), tp});
    out.push_back({"llama_mqa_tp" + std::to_string(tp), small("llama-tiny", 1), tp});
  }
  return out;
}

std::vector<float> to_vector(const Tensor& t) {
  const float* p = t.data<float>();
  return {p, p + t.numel()};
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

// The elements of the global tensor `whole` that rank's shard holds, laid out like the shard.
template <typename E>
std::vector<E> shard_of(const std::vector<E>& whole, const ParamSpec& spec, const ModelConfig& c,
                        int rank, int tp) {
  const Shape local = tp_local_shape(spec, c, rank, tp);
  std::vector<E> out(size_t(local.numel())), piece;
  for (const ShardPiece& pc : tp_shard_pieces(spec, c, rank, tp)) {
    piece.resize(size_t(pc.global.volume()));
    pack_box(whole.data(), spec.shape, pc.global, piece.data(), sizeof(E));
    unpack_box(piece.data(), pc.local, out.data(), local, sizeof(E));
  }
  return out;
}

// Adds the shard of a random global perturbation to every parameter, so that biases (zero at
// init) and norm weights (one) are not special values: a bias added by every rank instead of
// once, say, must show.
void perturb(Transformer& m) {
  for (const ParamView& v : m.param_views()) {
    const ParamSpec& ps = m.spec().at(v.name);
    const std::vector<float> whole =
        testing::random_normal(size_t(ps.numel()), std::hash<std::string>{}(ps.name), 0.02f);
    const std::vector<float> mine = shard_of(whole, ps, m.config(), m.tp_rank(), m.tp_size());
    float* dst = m.param(v.name).data<float>();
    for (size_t i = 0; i < mine.size(); ++i) dst[i] += mine[i];
  }
}

// The state an AdamW step changes: parameters and both moments, per parameter (the whole tensor,
// or one rank's shard of it).
struct State {
  std::vector<std::vector<float>> params, m, v;
};

// One model (whole, or one tp rank's shard) on one batch, with its AdamW moments.
class ModelRun {
 public:
  ModelRun(const ModelConfig& c, TpGroup* tp, int B, int T, uint64_t seed)
      : backend_(kernels::make_backend("cpu")),
        model_(c, *backend_, B, T, {}, tp),
        m_(size_t(model_.num_params()), 0.0f),
        v_(m_),
        batch_(random_batch(B, T, c.vocab_size, seed + 100)) {
    model_.init(seed);
    perturb(model_);
  }

  Transformer& model() { return model_; }
  std::span<const float> flat_params() const {
    return {model_.params().data<float>(), size_t(model_.num_params())};
  }
  std::span<const float> flat_grads() const {
    return {model_.grads().data<float>(), size_t(model_.num_params())};
  }
  std::span<const float> flat_m() const { return m_; }
  std::span<const float> flat_v() const { return v_; }

  // One forward_backward (gradients zeroed first); returns the mean loss.
  double forward_backward() {
    model_.zero_grad();
    auto r = model_.forward_backward(batch_.tokens.data(), batch_.targets.data(),
                                     1.0f / float(batch_.valid));
    EXPECT_EQ(r.valid, batch_.valid);
    return r.loss_sum / double(r.valid);
  }
  std::vector<std::vector<float>> grads() {
    std::vector<std::vector<float>> out;
    for (const ParamView& v : model_.param_views()) out.push_back(to_vector(model_.grad(v.name)));
    return out;
  }

  // AdamW on the gradients of the last forward_backward (1-based `step`).
  void adamw(int step) {
    for (const ParamView& v : model_.param_views()) {
      kernels::AdamWConfig cfg;
      cfg.lr = kLr;
      cfg.weight_decay = v.weight_decay ? kWeightDecay : 0.0f;
      cfg.step = step;
      backend_->adamw_update(model_.params().data<float>() + v.offset,
                             model_.grads().data<float>() + v.offset, m_.data() + v.offset,
                             v_.data() + v.offset, v.numel, cfg);
    }
  }

  State state() {
    State s;
    for (const ParamView& v : model_.param_views()) {
      s.params.push_back(to_vector(model_.param(v.name)));
      s.m.emplace_back(m_.begin() + v.offset, m_.begin() + v.offset + v.numel);
      s.v.emplace_back(v_.begin() + v.offset, v_.begin() + v.offset + v.numel);
    }
    return s;
  }
  // Takes the whole model's state, sliced to this rank's shards.
  void load_whole(const State& whole) {
    const ModelConfig& c = model_.config();
    const auto& views = model_.param_views();
    for (size_t i = 0; i < views.size(); ++i) {
      const ParamView& v = views[i];
      const ParamSpec& ps = model_.spec().at(v.name);
      auto put = [&](const std::vector<float>& from, float* to) {
        const std::vector<float> mine = shard_of(from, ps, c, model_.tp_rank(), model_.tp_size());
        std::copy(mine.begin(), mine.end(), to);
      };
      put(whole.params[i], model_.param(v.name).data<float>());
      put(whole.m[i], m_.data() + v.offset);
      put(whole.v[i], v_.data() + v.offset);
    }
  }

 private:
  std::unique_ptr<kernels::Backend> backend_;
  Transformer model_;
  std::vector<float> m_, v_;
  Batch batch_;
};

// What one step of the whole model gives, and the bounds another evaluation of the same step
// from the same state must keep to (per parameter, like the gradients).
struct WholeStep {
  State before, after;
  double loss = 0, loss_bound = 0;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<double>> grad_bound, param_bound, m_bound, v_bound;
};

// `steps` AdamW steps of the whole model on one batch (so that the loss falls); steps = 0: one
// forward_backward only.
std::vector<WholeStep> train_whole(const ModelConfig& c, int B, int T, int steps, uint64_t seed) {
  ModelRun run(c, nullptr, B, T, seed);
  const auto& views = run.model().param_views();
  auto split = [&](std::span<const double> flat) {
    std::vector<std::vector<double>> out;
    for (const ParamView& v : views)
      out.emplace_back(flat.begin() + v.offset, flat.begin() + v.offset + v.numel);
    return out;
  };
  std::vector<WholeStep> out;
  for (int step = 1; step <= std::max(steps, 1); ++step) {
    WholeStep s;
    s.before = run.state();
    s.loss = run.forward_backward();
    s.loss_bound = forward_tolerance(c, B, T) * std::fabs(s.loss);
    s.grads = run.grads();
    const std::vector<double> delta =
        test_util::gradient_bounds(views, run.flat_grads(), grad_tolerance(c, B, T));
    s.grad_bound = split(delta);
    if (steps > 0) {
      kernels::AdamWConfig defaults;
      testing::AdamDivergence one_step(run.flat_m(), run.flat_v(), defaults.beta1, defaults.beta2,
                                       defaults.eps);
      one_step.step(run.flat_grads(), 1.0f, delta, run.flat_params(), kLr, kWeightDecay, step);
      s.param_bound = split(one_step.bounds());
      s.m_bound = split(one_step.m_bounds());
      s.v_bound = split(one_step.v_bounds());
      run.adamw(step);
    }
    s.after = run.state();
    out.push_back(std::move(s));
  }
  return out;
}

class TensorParallel : public ::testing::TestWithParam<Case> {};

INSTANTIATE_TEST_SUITE_P(Models, TensorParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Shards are generated as boxes of the global tensors: bit-identical slices of the tp = 1 model.
TEST_P(TensorParallel, InitialShardsAreExactSlices) {
  const Case& tc = GetParam();
  auto backend = kernels::make_backend("cpu");
  Transformer whole(tc.config, *backend, 1, 4);
  whole.init(3);
  auto groups = LocalTpGroup::create(tc.tp);  // construction and init do not communicate
  int64_t total = 0;
  for (int r = 0; r < tc.tp; ++r) {
    Transformer shard(tc.config, *backend, 1, 4, {}, groups[size_t(r)].get());
    shard.init(3);
    EXPECT_EQ(shard.tp_rank(), r);
    EXPECT_EQ(shard.tp_size(), tc.tp);
    for (const ParamView& v : shard.param_views()) {
      const ParamSpec& spec = shard.spec().at(v.name);
      EXPECT_EQ(v.shape, tp_local_shape(spec, tc.config, r, tc.tp)) << v.name;
      EXPECT_EQ(v.tp_copies, tp_copies(spec, tc.config, tc.tp)) << v.name;
      EXPECT_EQ(v.tp_primary, tp_is_primary(spec, tc.config, r, tc.tp)) << v.name;
      if (v.tp_primary) total += v.numel;
      const std::vector<float> want =
          shard_of(to_vector(whole.param(v.name)), spec, tc.config, r, tc.tp);
      const std::vector<float> got = to_vector(shard.param(v.name));
      ASSERT_EQ(got.size(), want.size()) << v.name;
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << v.name;
    }
  }
  // Counting each primary copy once gives the whole model.
  EXPECT_EQ(total, whole.num_params());
}

// The forward logits of the shards are the column slices of the whole model's logits.
TEST_P(TensorParallel, LogitsAreVocabularySlices) {
  const Case& tc = GetParam();
  const int B = 2, T = 5;
  const ModelConfig& c = tc.config;
  Batch b = random_batch(B, T, c.vocab_size, 9);
  auto backend = kernels::make_backend("cpu");
  Transformer whole(c, *backend, B, T);
  whole.init(4);
  whole.forward(b.tokens.data(), nullptr);
  const std::vector<float> full = to_vector(whole.logits());
  const double peak = max_abs(full);
  LocalTpGroup::run(tc.tp, [&](TpGroup& g) {
    auto be = kernels::make_backend("cpu");
    Transformer m(c, *be, B, T, {}, &g);
    m.init(4);
    m.forward(b.tokens.data(), nullptr);
    const TpVocabRange vr = tp_vocab_range(c, g.rank(), g.size());
    ASSERT_EQ(m.logits().shape(), (Shape{B, T, vr.rows}));
    const std::vector<float> mine = to_vector(m.logits());
    double err = 0;
    for (int n = 0; n < B * T; ++n) {
      for (int v = 0; v < vr.rows; ++v) {
        err = std::max(err, std::fabs(double(mine[size_t(n) * vr.rows + v]) -
                                      full[size_t(n) * c.padded_vocab() + vr.start + v]));
      }
    }
    EXPECT_LE(err, forward_tolerance(c, B, T) * peak) << "rank " << g.rank();
  });
}

// One forward_backward: the same loss on every rank as the whole model's, every local gradient
// equal to its slice of the whole model's gradient, replicated gradients identical across ranks.
TEST_P(TensorParallel, LossAndGradientsMatchTheWholeModel) {
  const Case& tc = GetParam();
  const int B = 2, T = 8;
  const WholeStep base = train_whole(tc.config, B, T, 0, 5)[0];
  std::vector<double> losses(size_t(tc.tp));
  std::vector<std::vector<std::vector<float>>> grads(size_t(tc.tp));
  LocalTpGroup::run(tc.tp, [&](TpGroup& g) {
    ModelRun run(tc.config, &g, B, T, 5);
    losses[size_t(g.rank())] = run.forward_backward();
    grads[size_t(g.rank())] = run.grads();
  });
  const ModelSpec spec = ModelSpec::from(tc.config);
  for (int r = 0; r < tc.tp; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    EXPECT_NEAR(losses[size_t(r)], base.loss, base.loss_bound);
    // Every rank computes the same loss from the same reduced statistics.
    EXPECT_EQ(losses[size_t(r)], losses[0]);
    for (size_t i = 0; i < spec.size(); ++i) {
      const ParamSpec& ps = spec[i];
      EXPECT_GT(max_abs(base.grads[i]), 0.0) << ps.name;
      const std::vector<float>& got = grads[size_t(r)][i];
      EXPECT_TRUE(testing::within_bounds(got, shard_of(base.grads[i], ps, tc.config, r, tc.tp),
                                         shard_of(base.grad_bound[i], ps, tc.config, r, tc.tp),
                                         ps.name.c_str()));
      // Copies of the same elements carry bit-identical gradients (so identical updates keep
      // them in sync): compare with the first rank holding the same pieces.
      const auto pieces = tp_shard_pieces(ps, tc.config, r, tc.tp);
      for (int q = 0; q < r; ++q) {
        if (tp_shard_pieces(ps, tc.config, q, tc.tp) != pieces) continue;
        EXPECT_EQ(std::memcmp(got.data(), grads[size_t(q)][i].data(), got.size() * sizeof(float)),
                  0)
            << ps.name << " differs between ranks " << q << " and " << r;
        break;
      }
    }
  }
}

// AdamW steps on every rank's shard follow the whole model: losses, gradients, parameters and
// moments of every step, and replicated parameters stay bit-identical across ranks. Each step of
// the shards starts from the whole model's state before it (sliced): a free-running comparison
// has no bound (see AdamDivergence), one step from a shared state has an exact one.
TEST_P(TensorParallel, AdamWStepsFollowTheWholeModel) {
  const Case& tc = GetParam();
  const int B = 2, T = 8, steps = 4;
  const std::vector<WholeStep> base = train_whole(tc.config, B, T, steps, 6);
  // The losses must move, or the comparison says little.
  EXPECT_LT(base.back().loss, base.front().loss - 0.05);
  std::vector<std::vector<double>> losses(size_t(tc.tp));
  std::vector<std::vector<std::vector<std::vector<float>>>> grads(size_t(tc.tp));
  std::vector<std::vector<State>> after(size_t(tc.tp));
  LocalTpGroup::run(tc.tp, [&](TpGroup& g) {
    ModelRun run(tc.config, &g, B, T, 6);
    for (int s = 0; s < steps; ++s) {
      run.load_whole(base[size_t(s)].before);
      losses[size_t(g.rank())].push_back(run.forward_backward());
      grads[size_t(g.rank())].push_back(run.grads());
      run.adamw(s + 1);
      after[size_t(g.rank())].push_back(run.state());
    }
  });
  const ModelSpec spec = ModelSpec::from(tc.config);
  // The parameter bound must be able to fail. It reaches lr where a gradient is below the
  // rounding (and is loose at the first step, where AdamW moves every element by lr sign(g) and
  // only near-zero gradients are uncertain), but for most elements it stays far below one step:
  // a misapplied update (a wrong learning rate or step, a doubled or skipped update) shows.
  for (int s = 0; s < steps; ++s) {
    std::vector<double> all;
    for (const auto& b : base[size_t(s)].param_bound) all.insert(all.end(), b.begin(), b.end());
    std::nth_element(all.begin(), all.begin() + all.size() / 2, all.end());
    EXPECT_LT(all[all.size() / 2], 0.01 * kLr) << "step " << s + 1 << ": the bound's median";
    std::printf("[tp] %s step %d: parameter bound median %.2g lr\n", tc.name.c_str(), s + 1,
                all[all.size() / 2] / kLr);
  }
  for (int r = 0; r < tc.tp; ++r) {
    for (int s = 0; s < steps; ++s) {
      SCOPED_TRACE(::testing::Message() << "rank " << r << ", step " << s + 1);
      const WholeStep& want = base[size_t(s)];
      EXPECT_NEAR(losses[size_t(r)][size_t(s)], want.loss, want.loss_bound);
      const State& got = after[size_t(r)][size_t(s)];
      for (size_t i = 0; i < spec.size(); ++i) {
        const ParamSpec& ps = spec[i];
        auto expect_within = [&](const std::string& what, const std::vector<float>& mine,
                                 const std::vector<float>& whole,
                                 const std::vector<double>& bound) {
          EXPECT_TRUE(testing::within_bounds(mine, shard_of(whole, ps, tc.config, r, tc.tp),
                                             shard_of(bound, ps, tc.config, r, tc.tp),
                                             (ps.name + " " + what).c_str()));
        };
        expect_within("gradient", grads[size_t(r)][size_t(s)][i], want.grads[i],
                      want.grad_bound[i]);
        expect_within("parameter", got.params[i], want.after.params[i], want.param_bound[i]);
        expect_within("Adam m", got.m[i], want.after.m[i], want.m_bound[i]);
        expect_within("Adam v", got.v[i], want.after.v[i], want.v_bound[i]);
        if (tp_copies(ps, tc.config, tc.tp) == tc.tp && r > 0) {
          EXPECT_EQ(got.params[i], after[0][size_t(s)].params[i]) << ps.name;
        }
      }
    }
  }
}

// Pipeline stages of tensor-parallel shards, chained by hand, reproduce the whole model: every
// tp rank builds both stages and passes its (replicated) boundary activations and gradients.
TEST_P(TensorParallel, PipelineStagesOfShardsMatchTheWholeModel) {
  const Case& tc = GetParam();
  const int B = 2, T = 6;
  const ModelConfig& c = tc.config;
  const WholeStep base = train_whole(c, B, T, 0, 7)[0];
  Batch b = random_batch(B, T, c.vocab_size, 7 + 100);
  const ModelSpec spec = ModelSpec::from(c);
  std::vector<double> losses(static_cast<size_t>(tc.tp));
  std::vector<std::vector<std::vector<float>>> grads(static_cast<size_t>(tc.tp));
  LocalTpGroup::run(tc.tp, [&](TpGroup& g) {
    auto be = kernels::make_backend("cpu");
    Transformer s0(c, *be, B, T, StageRange::layers(c, 0, 1), &g);
    Transformer s1(c, *be, B, T, StageRange::layers(c, 1, 2), &g);
    s0.init(7);
    s1.init(7);
    perturb(s0);
    perturb(s1);
    s0.zero_grad();
    s1.zero_grad();
    s0.forward_stage(b.tokens.data(), nullptr);
    std::memcpy(s1.input_hidden().data<float>(), s0.output_hidden().data<float>(),
                size_t(s0.output_hidden().numel()) * sizeof(float));
    auto r = s1.forward_stage(nullptr, b.targets.data(), 1.0f / float(b.valid));
    losses[size_t(g.rank())] = r.loss_sum / double(r.valid);
    s1.backward_stage();
    std::memcpy(s0.output_grad().data<float>(), s1.input_grad().data<float>(),
                size_t(s1.input_grad().numel()) * sizeof(float));
    s0.backward_stage();
    // A tied embedding is in both stages; its gradient is the sum of the two.
    for (const ParamSpec& ps : spec) {
      std::vector<float> sum;
      for (Transformer* s : {&s0, &s1}) {
        if (!s->spec().contains(ps.name)) continue;
        std::vector<float> part = to_vector(s->grad(ps.name));
        if (sum.empty()) sum.assign(part.size(), 0.0f);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
      }
      grads[size_t(g.rank())].push_back(std::move(sum));
    }
  });
  for (int r = 0; r < tc.tp; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    EXPECT_NEAR(losses[size_t(r)], base.loss, base.loss_bound);
    for (size_t i = 0; i < spec.size(); ++i) {
      EXPECT_TRUE(testing::within_bounds(
          grads[size_t(r)][i], shard_of(base.grads[i], spec[i], c, r, tc.tp),
          shard_of(base.grad_bound[i], spec[i], c, r, tc.tp), spec[i].name.c_str()));
    }
  }
}

TEST(TensorParallelErrors, RejectsModelsThatDoNotSplit) {
  auto backend = kernels::make_backend("cpu");
  auto three = LocalTpGroup::create(3);
  EXPECT_THROW(Transformer(small("gpt2-tiny"), *backend, 1, 4, {}, three[0].get()), ConfigError);
  // A group of one is plain single-rank execution.
  auto one = LocalTpGroup::create(1);
  Transformer m(small("llama-tiny"), *backend, 1, 4, {}, one[0].get());
  EXPECT_EQ(m.tp_group(), nullptr);
  EXPECT_EQ(m.num_params(), small("llama-tiny").num_params());
}

}  // namespace
}  // namespace tessel::model
