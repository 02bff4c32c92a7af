#include "tessel/model/init.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/tensor/box_copy.h"

namespace tessel::model {
namespace {

std::vector<float> full(const ParamSpec& p, uint64_t seed) {
  std::vector<float> v(size_t(p.numel()));
  init_full(p, seed, v.data());
  return v;
}

// The box generated alone must equal, bit for bit, the same box cut out of the full tensor.
void expect_box_is_slice(const ParamSpec& p, uint64_t seed, const Box& box) {
  std::vector<float> whole = full(p, seed);
  std::vector<float> slice(size_t(box.volume()));
  pack_box(whole.data(), p.shape, box, slice.data(), sizeof(float));
  std::vector<float> alone(size_t(box.volume()), -123.0f);
  init_box(p, seed, box, alone.data());
  ASSERT_EQ(std::memcmp(alone.data(), slice.data(), slice.size() * sizeof(float)), 0)
      << p.name << " box " << box.str();
}

TEST(Init, BoxEqualsSliceOfFullTensor) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    ModelSpec s = ModelSpec::from(ModelConfig::preset(preset));
    for (const ParamSpec& p : s) {
      if (p.shape.rank() == 2) {
        const int64_t R = p.shape[0], C = p.shape[1];
        // Row shards, column shards, an interior block, a single element, the whole tensor.
        expect_box_is_slice(p, 5, Box({0, 0}, {R / 2, C}));
        expect_box_is_slice(p, 5, Box({R / 2, 0}, {R, C}));
        expect_box_is_slice(p, 5, Box({0, C / 4}, {R, C / 2}));
        expect_box_is_slice(p, 5, Box({R / 3, C / 3}, {R / 3 + 3, C / 3 + 5}));
        expect_box_is_slice(p, 5, Box({R - 1, C - 1}, {R, C}));
        expect_box_is_slice(p, 5, Box::of(p.shape));
      } else {
        const int64_t n = p.shape[0];
        expect_box_is_slice(p, 5, Box({n / 3}, {n - 1}));
      }
    }
  }
}

TEST(Init, LargeBoxesTakeTheParallelPathAndStillMatch) {
  ParamSpec p{"big", Shape{700, 300}, InitKind::normal, 0.02f, true, TpSplit::column, 0, -1};
  expect_box_is_slice(p, 11, Box({0, 0}, {700, 300}));
  expect_box_is_slice(p, 11, Box({3, 17}, {690, 283}));
  ParamSpec p3{"rank3", Shape{4, 5, 6}, InitKind::normal, 1.0f, false, TpSplit::replicated, 0, -1};
  expect_box_is_slice(p3, 11, Box({1, 2, 3}, {3, 5, 5}));
}

TEST(Init, DeterministicPerSeedAndName) {
  ModelSpec s = ModelSpec::from(ModelConfig::preset("gpt2-tiny"));
  const ParamSpec& a = s.at("transformer.h.0.attn.c_attn.weight");
  ParamSpec renamed = a;
  renamed.name = "transformer.h.1.attn.c_attn.weight";
  std::vector<float> x = full(a, 1), y = full(a, 1), z = full(a, 2), w = full(renamed, 1);
  EXPECT_EQ(x, y);
  int same_seed = 0, same_name = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    same_seed += x[i] == z[i];
    same_name += x[i] == w[i];
  }
  EXPECT_EQ(same_seed, 0);
  EXPECT_EQ(same_name, 0);
  EXPECT_EQ(init_value(a, 1, 77), x[77]);
}

TEST(Init, NormalHasRequestedMomentsAndConstantsAreExact) {
  ParamSpec p{"w", Shape{512, 512}, InitKind::normal, 0.02f, true, TpSplit::column, 0, -1};
  std::vector<float> v = full(p, 3);
  double sum = 0, sq = 0, max_abs = 0;
  for (float x : v) {
    sum += x;
    sq += double(x) * x;
    max_abs = std::max(max_abs, double(std::fabs(x)));
  }
  const double n = double(v.size());
  const double mean = sum / n, stddev = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.02 * 5 / std::sqrt(n));  // 5 standard errors
  EXPECT_NEAR(stddev, 0.02, 0.02 * 0.01);
  EXPECT_GT(max_abs, 0.02 * 3.5);  // tails exist
  EXPECT_LT(max_abs, 0.02 * 7.0);

  ParamSpec ones{"n", Shape{10}, InitKind::ones, 0.0f, false, TpSplit::replicated, 0, -1};
  ParamSpec zeros{"b", Shape{10}, InitKind::zeros, 0.0f, false, TpSplit::replicated, 0, -1};
  EXPECT_EQ(full(ones, 1), std::vector<float>(10, 1.0f));
  EXPECT_EQ(full(zeros, 1), std::vector<float>(10, 0.0f));
}

TEST(Init, VocabularyPaddingRowsAreZero) {
  ModelSpec s = ModelSpec::from(ModelConfig::preset("llama-tiny"));
  const ParamSpec& head = s.at("lm_head.weight");  // [384, 32], 257 real rows
  std::vector<float> v = full(head, 9);
  const int64_t C = head.shape[1];
  for (int64_t r = 0; r < head.shape[0]; ++r) {
    int zeros = 0;
    for (int64_t c = 0; c < C; ++c) zeros += v[size_t(r * C + c)] == 0.0f;
    if (r < 257) {
      EXPECT_LT(zeros, C) << "row " << r;
    } else {
      EXPECT_EQ(zeros, C) << "row " << r;
    }
  }
}

TEST(Init, RejectsBoxOutsideTensor) {
  ParamSpec p{"w", Shape{4, 4}, InitKind::normal, 1.0f, true, TpSplit::column, 0, -1};
  float out[32];
  EXPECT_THROW(init_box(p, 1, Box({0, 0}, {5, 4}), out), InvalidArgumentError);
  EXPECT_THROW(init_box(p, 1, Box({0}, {4}), out), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::model
