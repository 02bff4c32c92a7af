// Golden test: the engine's tiny models against PyTorch (tools/golden.py), plus the golden-file
// reader's own checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/golden_file.h"
#include "tessel/model/model_config.h"
#include "tessel/model/rounding_test_util.h"
#include "tessel/model/transformer.h"
#include "tessel/testing/adam_divergence.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::model {
namespace {

std::filesystem::path golden_path() {
  return testing::source_path("src/tessel/model/testdata/golden.bin");
}

std::vector<char> golden_bytes() {
  std::ifstream in(golden_path(), std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// ----------------------------------------------------------------------------- reader

TEST(GoldenFile, ReadsTheCommittedFile) {
  const GoldenFile g = GoldenFile::read(golden_path());
  for (const std::string model : {"gpt2-tiny", "llama-tiny"}) {
    const Tensor& tokens = g.get(model + "/tokens");
    EXPECT_EQ(tokens.dtype(), DType::i32);
    EXPECT_EQ(tokens.shape(), Shape({2, 16}));
    EXPECT_EQ(g.get(model + "/logits").shape(), Shape({2, 16, 384}));
    EXPECT_EQ(g.get(model + "/train_losses").shape(), Shape({5}));
    EXPECT_EQ(g.scalar(model + "/config/vocab"), 257);
    EXPECT_FLOAT_EQ(float(g.scalar(model + "/adamw/lr")), 1e-2f);
    EXPECT_EQ(g.names_under(model + "/param/"), g.names_under(model + "/grad/"));
  }
  EXPECT_EQ(g.get("gpt2-tiny/param/transformer.wte.weight").shape(), Shape({384, 32}));
  EXPECT_EQ(g.get("llama-tiny/param/model.layers.0.self_attn.k_proj.weight").shape(),
            Shape({16, 32}));
  EXPECT_THROW(g.get("gpt2-tiny/param/nope"), InvalidArgumentError);
  EXPECT_THROW(g.scalar("gpt2-tiny/tokens"), InvalidArgumentError);
}

TEST(GoldenFile, RejectsBadMagicVersionAndTrailingBytes) {
  const std::vector<char> good = golden_bytes();
  ASSERT_GT(good.size(), 16u);
  std::vector<char> bad = good;
  bad[0] = 'X';
  EXPECT_THROW(GoldenFile::parse(bad, "bad magic"), CorruptDataError);
  bad = good;
  bad[8] = 2;  // version 2
  EXPECT_THROW(GoldenFile::parse(bad, "bad version"), CorruptDataError);
  bad = good;
  bad.push_back(0);
  EXPECT_THROW(GoldenFile::parse(bad, "trailing byte"), CorruptDataError);
}

TEST(GoldenFile, RejectsTruncatedFiles) {
  const std::vector<char> good = golden_bytes();
  ASSERT_GT(good.size(), 200u);
  // Cutting anywhere must be detected: headers, names, dims and data alike. Sample cut points
  // densely at the start (file header, first record header) and sparsely through the rest.
  std::vector<size_t> cuts;
  for (size_t n = 0; n < 200; ++n) cuts.push_back(n);
  for (size_t n = 200; n < good.size(); n += 4999) cuts.push_back(n);
  cuts.push_back(good.size() - 1);
  for (size_t n : cuts) {
    EXPECT_THROW(GoldenFile::parse(std::span(good).first(n), "truncated"), CorruptDataError)
        << "cut at " << n;
  }
}

TEST(GoldenFile, RejectsInconsistentRecordHeader) {
  // A minimal one-record file built by hand: "x" f32 [2] = {1, 2}.
  auto make = [](uint32_t dtype, int64_t dim, uint64_t nbytes) {
    std::vector<char> b;
    auto put = [&b](const void* p, size_t n) {
      b.insert(b.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    };
    put("TSLGOLD\0", 8);
    const uint32_t version = 1, count = 1, name_len = 1, rank = 1;
    put(&version, 4);
    put(&count, 4);
    put(&name_len, 4);
    put("x", 1);
    put(&dtype, 4);
    put(&rank, 4);
    put(&dim, 8);
    put(&nbytes, 8);
    const float data[2] = {1.0f, 2.0f};
    put(data, sizeof(data));
    return b;
  };
  const GoldenFile ok = GoldenFile::parse(make(1, 2, 8), "ok");
  EXPECT_EQ(ok.get("x").shape(), Shape({2}));
  EXPECT_EQ(ok.get("x").data<float>()[1], 2.0f);
  EXPECT_THROW(GoldenFile::parse(make(7, 2, 8), "unknown dtype"), CorruptDataError);
  EXPECT_THROW(GoldenFile::parse(make(1, 2, 12), "byte count mismatch"), CorruptDataError);
  EXPECT_THROW(GoldenFile::parse(make(1, -1, 8), "negative dim"), CorruptDataError);
  EXPECT_THROW(GoldenFile::parse(make(1, int64_t(1) << 40, 8), "huge dim"), CorruptDataError);
}

TEST(GoldenFile, MissingFileIsAnIoError) {
  testing::TempDir dir;
  EXPECT_THROW(GoldenFile::read(dir / "absent.bin"), IoError);
}

// ----------------------------------------------------------------------------- engine vs torch

// The golden values are torch's answer computed in float64 for the float32 weights (see
// tools/golden.py): the exact answer, to float32 precision. The engine's float32 computation is
// within one side's rounding of it (testing/rounding.h): every logit within the forward pass'
// chain_tolerance of the largest logit, the loss within it of the loss, every gradient element
// within the forward and backward pass' chain_tolerance of its tensor's largest gradient (a row
// of exact zeros, no token's, exactly), the golden values' own float32 rounding (half an ulp)
// added. (TESSEL_REPORT_MARGINS=1 prints how close each comparison came to its bound.)

// tol times the scale, plus half an ulp of each golden value (its rounding to float32).
std::vector<double> bounds_of(std::span<const float> golden_values, double scaled) {
  std::vector<double> b(golden_values.size());
  for (size_t i = 0; i < b.size(); ++i)
    b[i] = scaled + 0.5 * testing::kUnitRoundoff * std::fabs(golden_values[i]);
  return b;
}

double max_abs(std::span<const float> x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

const GoldenFile& golden() {
  static const GoldenFile g = GoldenFile::read(golden_path());
  return g;
}

// A zeroed float buffer in backend memory.
class DeviceBuffer {
 public:
  DeviceBuffer(kernels::Backend& backend, int64_t n)
      : backend_(backend), ptr_(static_cast<float*>(backend.allocate(size_t(n) * sizeof(float)))) {
    backend_.memset_zero(ptr_, size_t(n) * sizeof(float));
  }
  ~DeviceBuffer() { backend_.deallocate(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  float* get() const { return ptr_; }

 private:
  kernels::Backend& backend_;
  float* ptr_;
};

struct GoldenCase {
  const char* model;
  const char* backend;
};
void PrintTo(const GoldenCase& c, std::ostream* os) {
  *os << c.model << " on " << c.backend;
}

class GoldenModel : public ::testing::TestWithParam<GoldenCase> {
 protected:
  void SetUp() override {
    model_ = GetParam().model;
    backend_ = kernels::make_backend(GetParam().backend);
    config_ = ModelConfig::preset(model_);
    check_config();
    const Tensor& tokens = golden().get(rec("tokens"));
    const Tensor& targets = golden().get(rec("targets"));
    ASSERT_EQ(tokens.rank(), 2u);
    ASSERT_EQ(targets.shape(), tokens.shape());
    B_ = int(tokens.dim(0));
    T_ = int(tokens.dim(1));
    tokens_.assign(tokens.data<int32_t>(), tokens.data<int32_t>() + tokens.numel());
    targets_.assign(targets.data<int32_t>(), targets.data<int32_t>() + targets.numel());
    valid_ = int(std::count_if(targets_.begin(), targets_.end(),
                               [](int32_t t) { return t != Transformer::kIgnoreIndex; }));
    ASSERT_LT(valid_, B_ * T_) << "the golden batch must exercise ignored targets";
    net_ = std::make_unique<Transformer>(config_, *backend_, B_, T_);
    load_weights();
  }

  std::string rec(const std::string& what) const { return model_ + "/" + what; }

  // One side's rounding (the golden values are exact) of the forward pass, and of forward and
  // backward, over the golden batch.
  double forward_tol() const {
    return test_util::step_tolerance(config_, int64_t(B_) * T_, T_, /*backward=*/false, 1);
  }
  double grad_tol() const {
    return test_util::step_tolerance(config_, int64_t(B_) * T_, T_, true, 1);
  }

  // The golden gradients in the engine's flat layout.
  std::vector<float> golden_grads() const {
    std::vector<float> flat(size_t(net_->num_params()));
    for (const ParamView& v : net_->param_views()) {
      const Tensor& g = golden().get(rec("grad/" + v.name));
      std::copy_n(g.data<float>(), v.numel, flat.begin() + v.offset);
    }
    return flat;
  }

  void check_config() {
    auto expect_field = [&](const char* key, int value) {
      EXPECT_EQ(value, int(golden().scalar(rec(std::string("config/") + key))))
          << model_ << " preset field " << key << " differs from the golden model";
    };
    expect_field("n_layer", config_.n_layer);
    expect_field("n_embd", config_.n_embd);
    expect_field("n_head", config_.n_head);
    expect_field("n_kv_head", config_.n_kv_head);
    expect_field("ffn", config_.ffn_hidden);
    expect_field("vocab", config_.vocab_size);
    expect_field("padded_vocab", config_.padded_vocab());
    expect_field("max_seq", config_.max_seq_len);
  }

  // Every engine parameter must be in the file and vice versa: a parameter the engine lacks, or
  // one torch lacks, is a model mismatch, not something to skip.
  void load_weights() {
    const std::vector<std::string> in_file = golden().names_under(rec("param/"));
    const std::set<std::string> file_names(in_file.begin(), in_file.end());
    std::set<std::string> engine_names;
    for (const ParamView& v : net_->param_views()) engine_names.insert(v.name);
    std::string only_engine, only_file;
    for (const auto& n : engine_names)
      if (!file_names.count(n)) only_engine += " " + n;
    for (const auto& n : file_names)
      if (!engine_names.count(n)) only_file += " " + n;
    ASSERT_TRUE(only_engine.empty() && only_file.empty())
        << model_ << ": parameters only in the engine:" << only_engine
        << "; only in the golden file:" << only_file;
    for (const ParamView& v : net_->param_views()) {
      const Tensor& w = golden().get(rec("param/" + v.name));
      ASSERT_EQ(w.shape(), v.shape) << v.name;
      backend_->copy_from_host(net_->param(v.name).raw(), w.raw(), w.nbytes());
    }
  }

  std::vector<float> to_host(const Tensor& t) const {
    std::vector<float> out(size_t(t.numel()));
    backend_->copy_to_host(out.data(), t.raw(), out.size() * sizeof(float));
    return out;
  }

  double mean_loss(const kernels::CrossEntropyResult& r) const {
    EXPECT_EQ(r.valid, valid_);
    return r.loss_sum / double(r.valid);
  }

  std::string model_;
  std::unique_ptr<kernels::Backend> backend_;
  ModelConfig config_;
  int B_ = 0, T_ = 0, valid_ = 0;
  std::vector<int32_t> tokens_, targets_;
  std::unique_ptr<Transformer> net_;
};

TEST_P(GoldenModel, ForwardMatchesLogitsAndLoss) {
  const double loss = mean_loss(net_->forward(tokens_.data(), targets_.data()));
  const Tensor& want = golden().get(rec("logits"));
  ASSERT_EQ(net_->logits().shape(), want.shape());
  const auto logits = want.span<const float>();
  EXPECT_TRUE(testing::within_bounds(to_host(net_->logits()), logits,
                                     bounds_of(logits, forward_tol() * max_abs(logits)), "logits"));
  const double want_loss = golden().scalar(rec("loss"));
  EXPECT_TRUE(testing::within_bound(loss, want_loss, forward_tol() * std::fabs(want_loss), "loss"));
}

TEST_P(GoldenModel, GradientsMatchEveryParameter) {
  const double loss =
      mean_loss(net_->forward_backward(tokens_.data(), targets_.data(), 1.0f / float(valid_)));
  EXPECT_NEAR(loss, golden().scalar(rec("loss")), forward_tol() * std::fabs(loss));
  const std::vector<float> want = golden_grads();
  std::vector<double> bound = test_util::gradient_bounds(net_->param_views(), want, grad_tol());
  for (size_t i = 0; i < bound.size(); ++i)
    bound[i] += 0.5 * testing::kUnitRoundoff * std::fabs(want[i]);
  for (const ParamView& v : net_->param_views()) {
    const auto at = [&](const auto& x) {
      return std::span(x).subspan(size_t(v.offset), size_t(v.numel));
    };
    EXPECT_TRUE(
        testing::within_bounds(to_host(net_->grad(v.name)), at(want), at(bound), v.name.c_str()));
  }
}

// One AdamW step against torch's: the engine's step from the golden weights against the exact
// AdamW step (torch's formula, in double) of the golden gradients, within AdamDivergence's bound
// for gradients that differ by the engine's rounding; and the loss torch logged after that step
// against the engine's loss at torch's updated weights. (Later steps are left to the optimizer's
// own tests: a trajectory of several steps has no bound that follows from the arithmetic, see
// testing/rounding.h.)
TEST_P(GoldenModel, AnAdamWStepMatchesTorch) {
  kernels::AdamWConfig cfg;
  cfg.lr = float(golden().scalar(rec("adamw/lr")));
  cfg.beta1 = float(golden().scalar(rec("adamw/beta1")));
  cfg.beta2 = float(golden().scalar(rec("adamw/beta2")));
  cfg.eps = float(golden().scalar(rec("adamw/eps")));
  cfg.step = 1;
  const float decay = float(golden().scalar(rec("adamw/weight_decay")));
  // The golden run decays 2-D tensors (matrices, embeddings) only; the spec must say the same.
  for (const ParamView& v : net_->param_views())
    EXPECT_EQ(v.weight_decay, v.shape.rank() >= 2) << v.name;

  const int64_t n = net_->num_params();
  const std::vector<float> before = to_host(net_->params());
  const std::vector<float> g = golden_grads();
  // Torch's step, exact: from zero moments, m_hat = g and v_hat = g^2.
  std::vector<double> torch_after(static_cast<size_t>(n));
  for (const ParamView& v : net_->param_views()) {
    const double wd = v.weight_decay ? decay : 0.0;
    for (int64_t i = v.offset; i < v.offset + v.numel; ++i) {
      const double p = before[size_t(i)], gi = g[size_t(i)];
      torch_after[size_t(i)] =
          p * (1 - double(cfg.lr) * wd) - double(cfg.lr) * gi / (std::fabs(gi) + double(cfg.eps));
    }
  }
  // The engine's step, on its own gradients.
  net_->zero_grad();
  mean_loss(net_->forward_backward(tokens_.data(), targets_.data(), 1.0f / float(valid_)));
  DeviceBuffer m(*backend_, n), s(*backend_, n);
  float* params = static_cast<float*>(net_->params().raw());
  float* grads = static_cast<float*>(net_->grads().raw());
  for (const ParamView& v : net_->param_views()) {
    kernels::AdamWConfig c = cfg;
    c.weight_decay = v.weight_decay ? decay : 0.0f;
    backend_->adamw_update(params + v.offset, grads + v.offset, m.get() + v.offset,
                           s.get() + v.offset, v.numel, c);
  }
  const std::vector<float> after = to_host(net_->params());
  // The engine's gradients are within grad_tol of the exact ones; the golden file holds those
  // rounded to float32 (half an ulp more).
  std::vector<double> delta = test_util::gradient_bounds(net_->param_views(), g, grad_tol());
  for (size_t i = 0; i < delta.size(); ++i)
    delta[i] += 0.5 * testing::kUnitRoundoff * std::fabs(g[i]);
  testing::AdamDivergence bound(n, cfg.beta1, cfg.beta2, cfg.eps);
  bound.step(g, 1.0f, delta, before, cfg.lr, decay, 1);
  // Torch's exact result, rounded to float (half an ulp more).
  const std::vector<float> torch_weights(torch_after.begin(), torch_after.end());
  std::vector<double> allowed(bound.bounds().begin(), bound.bounds().end());
  for (size_t i = 0; i < allowed.size(); ++i)
    allowed[i] += 0.5 * testing::kUnitRoundoff * std::fabs(torch_after[i]);
  EXPECT_TRUE(testing::within_bounds(after, torch_weights, allowed, "parameters after one step"));

  // Torch logged the loss at its updated weights: the engine at those weights (rounded to float32,
  // which moves the loss by at most sum |dL/dtheta| u |theta| to first order) computes it within
  // the forward pass' rounding.
  backend_->copy_from_host(params, torch_weights.data(), torch_weights.size() * sizeof(float));
  net_->zero_grad();
  const double loss =
      mean_loss(net_->forward_backward(tokens_.data(), targets_.data(), 1.0f / float(valid_)));
  const std::vector<float> g1 = to_host(net_->grads());
  double weights_rounding = 0;
  for (size_t i = 0; i < g1.size(); ++i)
    weights_rounding +=
        std::fabs(double(g1[i])) * testing::kUnitRoundoff * std::fabs(torch_after[i]);
  const double want_loss = golden().get(rec("train_losses")).data<float>()[1];
  const double loss_bound = forward_tol() * std::fabs(want_loss) + weights_rounding;
  EXPECT_TRUE(testing::within_bound(loss, want_loss, loss_bound, "the loss after one step"));
}

// The comparison is sharp enough to see a small change: nudging one final-norm weight by 1% (one
// of 32 channels) must push some logit past three times its bound.
TEST_P(GoldenModel, DetectsASmallWeightChange) {
  const std::string name =
      config_.family == Family::gpt2 ? "transformer.ln_f.weight" : "model.norm.weight";
  std::vector<float> w = to_host(net_->param(name));
  w[0] *= 1.01f;
  backend_->copy_from_host(net_->param(name).raw(), w.data(), w.size() * sizeof(float));
  net_->forward(tokens_.data(), targets_.data());
  const auto logits = golden().get(rec("logits")).span<const float>();
  EXPECT_FALSE(testing::within_bounds(to_host(net_->logits()), logits,
                                      bounds_of(logits, 3 * forward_tol() * max_abs(logits))));
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenModel,
                         ::testing::Values(GoldenCase{"gpt2-tiny", "cpu"},
                                           GoldenCase{"gpt2-tiny", "reference"},
                                           GoldenCase{"llama-tiny", "cpu"},
                                           GoldenCase{"llama-tiny", "reference"}),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) {
                           std::string s = std::string(info.param.model) + "_" + info.param.backend;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace tessel::model
