#include "tessel/runtime/prepared_chunks.h"
#include "tessel/model/local_tp_group_test_util.h"
#include "tessel/runtime/pipeline_executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/layout/zero_split.h"
#include "tessel/model/init.h"
#include "tessel/model/tp_group.h"

namespace tessel::runtime {

using config::TrainConfig;
namespace {

TrainConfig tiny_config() {
  TrainConfig cfg;
  cfg.model = model::ModelConfig::preset("gpt2-tiny");
  cfg.data.seq_len = 16;
  return cfg;
}

std::shared_ptr<kernels::Backend> cpu() {
  return std::shared_ptr<kernels::Backend>(kernels::make_backend("cpu"));
}

layout::Plan pipeline(int pp, int64_t m, layout::ScheduleKind kind, int v = 1) {
  layout::Plan p;
  p.pp = pp;
  p.micro_batch = 2;
  p.micro_batches = m;
  p.schedule = kind;
  p.virtual_stages = v;
  return p;
}

TEST(ActivationPeaks, FollowTheSchedule) {
  // 1F1B: stage s of p has at most p - s micro-batches in flight (never more than M); GPipe
  // runs every forward before any backward.
  for (int s = 0; s < 4; ++s) {
    const auto p = pipeline(4, 8, layout::ScheduleKind::one_f_one_b);
    EXPECT_EQ(activation_peaks(pipeline_program(p, s), 1), std::vector<int>{4 - s}) << s;
    const auto g = pipeline(4, 8, layout::ScheduleKind::gpipe);
    EXPECT_EQ(activation_peaks(pipeline_program(g, s), 1), std::vector<int>{8}) << s;
  }
  const auto few = pipeline(4, 2, layout::ScheduleKind::one_f_one_b);
  EXPECT_EQ(activation_peaks(pipeline_program(few, 0), 1), std::vector<int>{2});
  // Interleaved: one peak per chunk, each at least 1.
  const auto v = pipeline(2, 4, layout::ScheduleKind::interleaved_one_f_one_b, 2);
  const auto peaks = activation_peaks(pipeline_program(v, 0), 2);
  ASSERT_EQ(peaks.size(), 2u);
  for (int k : peaks) EXPECT_GE(k, 1);
}

TEST(PrepareChunks, BuildsEachRanksStagesAndMoments) {
  const auto cfg = tiny_config();
  layout::Plan p = pipeline(2, 4, layout::ScheduleKind::one_f_one_b);
  p.dp = 3;
  p.zero_stage = 1;
  p = p.with_defaults(cfg.model);
  const auto ranges = p.stage_ranges(cfg.model);
  for (int rank = 0; rank < p.world(); ++rank) {
    const auto c = p.coord_of(rank);
    auto out = prepare_chunks(cfg, p, rank, cpu(), {});
    ASSERT_EQ(out.models.size(), 1u);
    const auto& m = *out.models[0];
    EXPECT_EQ(m.stage().layer_begin, ranges[size_t(c.pp)].layer_begin) << rank;
    EXPECT_EQ(m.stage().layer_end, ranges[size_t(c.pp)].layer_end) << rank;
    EXPECT_EQ(m.batch_size(), 2);
    EXPECT_EQ(m.seq_len(), 16);
    EXPECT_EQ(m.activation_slots(), 2 - c.pp);  // 1F1B over 2 stages
    // ZeRO-1: this dp rank's share of the moments, zeroed.
    const int64_t own = layout::zero_split(m.num_params(), 3, c.dp).n_own;
    ASSERT_EQ(out.adam_m[0].numel(), own);
    ASSERT_EQ(out.adam_v[0].numel(), own);
    const float* mv = out.adam_m[0].data<float>();
    EXPECT_TRUE(std::all_of(mv, mv + own, [](float x) { return x == 0; }));
    const float* w = m.params().data<float>();
    EXPECT_TRUE(std::all_of(w, w + m.num_params(), [](float x) { return x == 0; }));
  }
}

TEST(PrepareChunks, SkipsChunksTheSwitchTakesOver) {
  const auto cfg = tiny_config();
  const auto p = pipeline(2, 4, layout::ScheduleKind::interleaved_one_f_one_b, 2);
  auto out = prepare_chunks(cfg, p, 1, cpu(), {true, false});
  ASSERT_EQ(out.models.size(), 2u);
  EXPECT_EQ(out.models[0], nullptr);
  EXPECT_FALSE(out.adam_m[0].defined());
  ASSERT_NE(out.models[1], nullptr);
  // Rank 1's second chunk is virtual stage 1 * pp + 1 = 3.
  EXPECT_EQ(out.models[1]->stage().layer_end,
            p.with_defaults(cfg.model).stage_ranges(cfg.model)[3].layer_end);
}

// A tensor-parallel chunk is built as its rank's shard against a stand-in group, refuses to run
// before it is rebound, and once rebound computes what a model built on the group computes.
TEST(PrepareChunks, TensorParallelShardsRunOnceRebound) {
  const auto cfg = tiny_config();
  layout::Plan p;
  p.tp = 2;
  p.micro_batch = 2;
  auto backend = cpu();
  std::vector<int32_t> tokens(2 * 16), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t((i * 7) % 50);
    targets[i] = int32_t((i * 7 + 3) % 50);
  }
  std::vector<PreparedChunks> prepared;
  for (int r = 0; r < 2; ++r) prepared.push_back(prepare_chunks(cfg, p, r, backend, {}));
  for (int r = 0; r < 2; ++r) {
    auto& m = *prepared[size_t(r)].models[0];
    EXPECT_EQ(m.tp_size(), 2);
    EXPECT_EQ(m.tp_rank(), r);
    m.init(5);
    EXPECT_THROW(m.forward(tokens.data(), targets.data()), InvalidArgumentError);
  }
  std::vector<double> got(2), want(2);
  model::LocalTpGroup::run(2, [&](model::TpGroup& g) {
    auto& m = *prepared[size_t(g.rank())].models[0];
    m.rebind_tp_group(&g);
    got[size_t(g.rank())] = m.forward(tokens.data(), targets.data()).loss_sum;
    model::Transformer fresh(cfg.model, *backend, 2, 16, {}, &g);
    fresh.init(5);
    want[size_t(g.rank())] = fresh.forward(tokens.data(), targets.data()).loss_sum;
  });
  EXPECT_GT(want[0], 0);
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace tessel::runtime
