#include "tessel/layout/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::layout {
namespace {

using model::ModelConfig;
using model::StageRange;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using tessel::testing::error_of;

template <typename F>
std::string config_error(F&& f) {
  return error_of<ConfigError>(std::forward<F>(f));
}

Plan make_plan(int dp, int tp, int pp, RankOrder order = RankOrder::tp_dp_pp) {
  Plan p;
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  p.order = order;
  return p;
}

TEST(Plan, RankMappingIsABijectionForSmallGrids) {
  for (RankOrder order : {RankOrder::tp_dp_pp, RankOrder::dp_tp_pp}) {
    for (int dp = 1; dp <= 8; ++dp) {
      for (int tp = 1; dp * tp <= 8; ++tp) {
        for (int pp = 1; dp * tp * pp <= 8; ++pp) {
          const Plan p = make_plan(dp, tp, pp, order);
          std::set<std::tuple<int, int, int>> seen;
          for (int r = 0; r < p.world(); ++r) {
            const Coord c = p.coord_of(r);
            EXPECT_TRUE(0 <= c.dp && c.dp < dp && 0 <= c.tp && c.tp < tp && 0 <= c.pp && c.pp < pp)
                << p.describe() << " rank " << r;
            EXPECT_EQ(p.rank_of(c), r) << p.describe();
            seen.insert({c.dp, c.tp, c.pp});
          }
          EXPECT_EQ(int(seen.size()), p.world()) << p.describe();
        }
      }
    }
  }
}

TEST(Plan, DefaultOrderPutsTpInnermostAndPpOutermost) {
  const Plan p = make_plan(/*dp=*/2, /*tp=*/2, /*pp=*/2);
  EXPECT_EQ(p.coord_of(1), (Coord{0, 1, 0}));
  EXPECT_EQ(p.coord_of(2), (Coord{1, 0, 0}));
  EXPECT_EQ(p.coord_of(4), (Coord{0, 0, 1}));
  EXPECT_EQ(p.rank_of(Coord{1, 1, 1}), 7);
  EXPECT_EQ(p.rank_of(Coord{1, 0, 1}), (1 * 2 + 1) * 2 + 0);

  const Plan q = make_plan(2, 2, 2, RankOrder::dp_tp_pp);
  EXPECT_EQ(q.coord_of(1), (Coord{1, 0, 0}));
  EXPECT_EQ(q.coord_of(2), (Coord{0, 1, 0}));
  EXPECT_EQ(q.coord_of(4), (Coord{0, 0, 1}));
}

TEST(Plan, RankMappingRejectsOutOfRange) {
  const Plan p = make_plan(2, 1, 2);
  EXPECT_THROW(p.coord_of(4), InvalidArgumentError);
  EXPECT_THROW(p.coord_of(-1), InvalidArgumentError);
  EXPECT_THROW(p.rank_of(Coord{2, 0, 0}), InvalidArgumentError);
  EXPECT_THROW(p.rank_of(Coord{0, 1, 0}), InvalidArgumentError);
}

TEST(Plan, DefaultSplitsOfGpt2Tiny) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");  // 6 layers = 8 units
  EXPECT_THAT(default_layers_per_stage(c, 1, 1), ElementsAre(8));
  EXPECT_THAT(default_layers_per_stage(c, 2, 1), ElementsAre(4, 4));
  EXPECT_THAT(default_layers_per_stage(c, 3, 1), ElementsAre(3, 3, 2));
  EXPECT_THAT(default_layers_per_stage(c, 4, 1), ElementsAre(2, 2, 2, 2));
  EXPECT_THAT(default_layers_per_stage(c, 4, 2), ElementsAre(1, 1, 1, 1, 1, 1, 1, 1));
  EXPECT_THAT(default_layers_per_stage(c, 7, 1), ElementsAre(1, 2, 1, 1, 1, 1, 1));
  EXPECT_THAT(config_error([&] { default_layers_per_stage(c, 3, 3); }),
              HasSubstr("9 pipeline stages but model 'gpt2-tiny' has only 8 units"));
}

TEST(Plan, DefaultSplitOf124mGivesTheEndStagesFewerLayers) {
  const ModelConfig c = ModelConfig::preset("gpt2-124m");  // 12 layers = 14 units
  EXPECT_THAT(default_layers_per_stage(c, 4, 1), ElementsAre(3, 4, 4, 3));
  Plan p = make_plan(1, 1, 4).with_defaults(c);
  EXPECT_THAT(p.stage_ranges(c),
              ElementsAre(StageRange{0, 2, true, false}, StageRange{2, 6, false, false},
                          StageRange{6, 10, false, false}, StageRange{10, 12, false, true}));
}

TEST(Plan, StageRangesOfOneUnitStagesIncludeEmbeddingOnlyAndHeadOnly) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  Plan p = make_plan(1, 1, 4);
  p.virtual_stages = 2;
  p = p.with_defaults(c);
  const auto r = p.stage_ranges(c);
  ASSERT_EQ(r.size(), 8u);
  EXPECT_EQ(r[0], (StageRange{0, 0, true, false}));
  EXPECT_EQ(r[1], (StageRange{0, 1, false, false}));
  EXPECT_EQ(r[6], (StageRange{5, 6, false, false}));
  EXPECT_EQ(r[7], (StageRange{6, 6, false, true}));
  // Interleaving: stage s on pipeline rank s % pp as chunk s / pp.
  EXPECT_EQ(p.pp_rank_of_stage(5), 1);
  EXPECT_EQ(p.chunk_of_stage(5), 1);
  EXPECT_EQ(p.stage_of(1, 1), 5);
}

// Every split of every preset tiles the model: embedding once at the start, head once at the
// end, blocks contiguous and each held once.
TEST(Plan, StageRangesTileTheModelExactlyOnce) {
  for (const char* name : {"gpt2-tiny", "llama-tiny", "gpt2-124m"}) {
    const ModelConfig c = ModelConfig::preset(name);
    std::vector<std::vector<int>> splits;
    for (int stages = 1; stages <= c.n_layer + 2; ++stages)
      splits.push_back(default_layers_per_stage(c, stages, 1));
    splits.push_back({1, c.n_layer, 1});   // embedding and head alone
    splits.push_back({c.n_layer + 1, 1});  // head alone
    splits.push_back({1, 1, c.n_layer});   // uneven, head with blocks
    for (const auto& lps : splits) {
      Plan p = make_plan(1, 1, int(lps.size()));
      p.layers_per_stage = lps;
      const auto ranges = p.stage_ranges(c);
      ASSERT_EQ(ranges.size(), lps.size());
      int next_layer = 0, embeddings = 0, heads = 0;
      for (size_t s = 0; s < ranges.size(); ++s) {
        const StageRange& r = ranges[s];
        EXPECT_EQ(r.layer_begin, next_layer) << name << " stage " << s;
        EXPECT_EQ(r.num_layers() + r.has_embedding + r.has_head, lps[s]) << name << " stage " << s;
        next_layer = r.layer_end;
        embeddings += r.has_embedding;
        heads += r.has_head;
      }
      EXPECT_EQ(next_layer, c.n_layer) << name;
      EXPECT_TRUE(ranges.front().has_embedding);
      EXPECT_TRUE(ranges.back().has_head);
      EXPECT_EQ(embeddings, 1);
      EXPECT_EQ(heads, 1);
    }
  }
}

TEST(Plan, ValidPlansPass) {
  const ModelConfig tiny = ModelConfig::preset("gpt2-tiny");
  Plan p = make_plan(2, 2, 2);
  p.micro_batch = 2;
  p.micro_batches = 4;
  EXPECT_NO_THROW(p.validate(tiny, 16, 8));

  p.schedule = ScheduleKind::interleaved_one_f_one_b;
  p.virtual_stages = 2;
  p.zero_stage = 1;
  p.layers_per_stage = {1, 3, 3, 1};
  EXPECT_NO_THROW(p.validate(tiny, 16, 8));

  // llama-tiny has 2 kv heads: tp 4 replicates each over two ranks.
  const ModelConfig llama = ModelConfig::preset("llama-tiny");
  EXPECT_NO_THROW(make_plan(1, 4, 1).validate(llama, 1, 4));
}

TEST(Plan, WorkerCountMismatchNamesBothCounts) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  Plan p = make_plan(2, 2, 1);
  p.micro_batch = 4;
  p.micro_batches = 2;
  const std::string msg = config_error([&] { p.validate(c, 16, 3); });
  EXPECT_THAT(msg, HasSubstr("dp 2 x tp 2 x pp 1 = 4 workers but 3 were started"));
}

TEST(Plan, TensorParallelDegreeMustFitTheModel) {
  ModelConfig c = ModelConfig::preset("gpt2-tiny");  // 4 heads, ffn 128, padded vocab 384
  EXPECT_THAT(config_error([&] { make_plan(1, 3, 1).validate(c, 1, 3); }),
              HasSubstr("tp 3 does not divide n_head 4"));

  ModelConfig gqa = ModelConfig::preset("llama-tiny");
  gqa.n_head = 12;
  gqa.n_kv_head = 4;
  gqa.n_embd = 96;
  gqa.ffn_hidden = 96;
  EXPECT_THAT(config_error([&] { make_plan(1, 6, 1).validate(gqa, 1, 6); }),
              HasSubstr("tp 6 neither divides n_kv_head 4"));

  ModelConfig odd_ffn = c;
  odd_ffn.ffn_hidden = 126;
  EXPECT_THAT(config_error([&] { make_plan(1, 4, 1).validate(odd_ffn, 1, 4); }),
              HasSubstr("tp 4 does not divide ffn_hidden 126"));

  ModelConfig wide = c;  // 256 heads of width 1, so only the vocabulary stops tp 256
  wide.n_embd = 256;
  wide.n_head = 256;
  wide.n_kv_head = 256;
  wide.ffn_hidden = 256;
  EXPECT_THAT(config_error([&] { make_plan(1, 256, 1).validate(wide, 1, 256); }),
              HasSubstr("tp 256 does not divide the padded vocabulary 384"));
}

TEST(Plan, PipelineCannotHaveMoreStagesThanUnits) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  EXPECT_THAT(config_error([&] { make_plan(1, 1, 9).validate(c, 1, 9); }),
              HasSubstr("pp 9 x virtual_stages 1 = 9 pipeline stages but model 'gpt2-tiny' has "
                        "only 8 units (6 layers + embedding + head)"));
}

TEST(Plan, LayersPerStageMustMatchStagesAndUnits) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  Plan p = make_plan(1, 1, 2);
  p.layers_per_stage = {8};
  EXPECT_THAT(config_error([&] { p.validate(c, 1, 2); }),
              HasSubstr("layers_per_stage has 1 entries but pp 2 x virtual_stages 1 = 2 stages"));
  p.layers_per_stage = {3, 4};
  EXPECT_THAT(config_error([&] { p.validate(c, 1, 2); }),
              HasSubstr("layers_per_stage [3, 4] sums to 7 but model 'gpt2-tiny' has 8 units"));
  p.layers_per_stage = {8, 0};
  EXPECT_THAT(config_error([&] { p.validate(c, 1, 2); }), HasSubstr("layers_per_stage[1] is 0"));
  EXPECT_THAT(config_error([&] { p.stage_ranges(c); }), HasSubstr("layers_per_stage[1] is 0"));
}

TEST(Plan, MicroBatchesMustMakeTheGlobalBatch) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  Plan p = make_plan(2, 1, 1);
  p.micro_batch = 4;
  p.micro_batches = 3;
  std::string msg = config_error([&] { p.validate(c, 32, 2); });
  EXPECT_THAT(msg, HasSubstr("micro_batch 4 x micro_batches 3 x dp 2 = 24 samples per step but "
                             "the global batch is 32"));
  EXPECT_THAT(msg, HasSubstr("set micro_batches to 4"));

  p.micro_batch = 3;
  EXPECT_THAT(config_error([&] { p.validate(c, 32, 2); }),
              HasSubstr("micro_batch must divide the 16 samples per replica; choose from 1, 2, 4, "
                        "8, 16"));
  EXPECT_THAT(config_error([&] { p.validate(c, 33, 2); }), HasSubstr("dp 2 must divide"));
}

TEST(Plan, ScheduleConstraints) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  Plan p = make_plan(1, 1, 2);
  p.micro_batches = 4;
  p.virtual_stages = 2;
  EXPECT_THAT(
      config_error([&] { p.validate(c, 4, 2); }),
      HasSubstr("virtual_stages is 2 but only the interleaved-1f1b, zb-v and adaptive schedules"));

  p.schedule = ScheduleKind::interleaved_one_f_one_b;
  p.virtual_stages = 1;
  EXPECT_THAT(config_error([&] { p.validate(c, 4, 2); }),
              HasSubstr("interleaved-1f1b schedule needs pp >= 2 and virtual_stages >= 2"));

  p.virtual_stages = 2;
  p.micro_batches = 3;
  EXPECT_THAT(config_error([&] { p.validate(c, 3, 2); }),
              HasSubstr("needs micro_batches (3) to be a multiple of pp (2)"));

  // zb-v: two chunks as a V, an untied model (rank 0 holds the embedding and the head).
  p.schedule = ScheduleKind::zb_v;
  p.micro_batches = 4;
  p.virtual_stages = 1;
  ModelConfig untied = ModelConfig::preset("llama-tiny");
  untied.tie_embeddings = false;
  EXPECT_THAT(config_error([&] { p.validate(untied, 4, 2); }),
              HasSubstr("zb-v schedule places two model chunks per pipeline rank as a V"));
  p.virtual_stages = 2;
  EXPECT_NO_THROW(p.validate(untied, 4, 2));
  EXPECT_THAT(config_error([&] { p.validate(c, 4, 2); }), HasSubstr("tied to the embedding"));
}

// The V placement of zb-v: rank r holds virtual stages r and 2 pp - 1 - r.
TEST(Plan, ZbVPlacesItsChunksAsAV) {
  Plan p = make_plan(1, 1, 3);
  p.schedule = ScheduleKind::zb_v;
  p.virtual_stages = 2;
  EXPECT_EQ(p.stage_of(0, 0), 0);
  EXPECT_EQ(p.stage_of(0, 1), 5);
  EXPECT_EQ(p.stage_of(2, 0), 2);
  EXPECT_EQ(p.stage_of(2, 1), 3);
  for (int vs = 0; vs < 6; ++vs)
    EXPECT_EQ(p.stage_of(p.pp_rank_of_stage(vs), p.chunk_of_stage(vs)), vs) << vs;
  p.schedule = ScheduleKind::interleaved_one_f_one_b;
  EXPECT_EQ(p.stage_of(0, 1), 3);
  EXPECT_EQ(p.pp_rank_of_stage(5), 2);
  EXPECT_EQ(parse_schedule("zb-v"), ScheduleKind::zb_v);
  // The default split gives every rank of the V equal units (gpt2-tiny: 8 over 3 ranks, the rest
  // to the ranks without the embedding and head), each rank's share split over its two chunks.
  p.schedule = ScheduleKind::zb_v;
  const Plan d = p.with_defaults(ModelConfig::preset("gpt2-tiny"));
  EXPECT_THAT(d.layers_per_stage, ElementsAre(1, 2, 2, 1, 1, 1));
  EXPECT_EQ(parse_schedule("zb-h1"), ScheduleKind::zb_h1);
}

TEST(Plan, ZeroStageAndPositiveDegrees) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  Plan p;
  p.zero_stage = 2;
  EXPECT_THAT(config_error([&] { p.validate(c, 1, 1); }), HasSubstr("zero_stage is 2"));
  p = Plan{};
  p.dp = 0;
  EXPECT_THAT(config_error([&] { p.validate(c, 1, 0); }), HasSubstr("dp is 0"));
  p = Plan{};
  p.micro_batches = -1;
  EXPECT_THAT(config_error([&] { p.validate(c, 1, 1); }), HasSubstr("micro_batches is -1"));
}

TEST(Plan, JsonRoundTrip) {
  Plan p = make_plan(2, 4, 3, RankOrder::dp_tp_pp);
  p.virtual_stages = 2;
  p.micro_batch = 5;
  p.micro_batches = int64_t(1) << 40;
  p.schedule = ScheduleKind::interleaved_one_f_one_b;
  p.zero_stage = 1;
  p.recompute = model::Recompute::full;
  p.layers_per_stage = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(plan_from_json(to_json(p)), p);
  EXPECT_EQ(plan_from_json(nlohmann::json::parse(to_json(p).dump())), p);
  EXPECT_EQ(plan_from_json(to_json(Plan{})), Plan{});
  for (ScheduleKind s : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b}) {
    p.schedule = s;
    EXPECT_EQ(plan_from_json(to_json(p)), p);
  }
}

TEST(Plan, BadJsonIsCorruptData) {
  const nlohmann::json good = to_json(Plan{});
  auto corrupt = [](const nlohmann::json& doc) {
    return error_of<CorruptDataError>([&] { plan_from_json(doc); });
  };
  EXPECT_THAT(corrupt(nlohmann::json::array()), HasSubstr("not a JSON object"));
  nlohmann::json d = good;
  d.erase("tp");
  EXPECT_THAT(corrupt(d), HasSubstr("no 'tp' field"));
  d = good;
  d["dp"] = "two";
  EXPECT_THAT(corrupt(d), HasSubstr("'dp'"));
  d = good;
  d["pp"] = int64_t(1) << 40;
  EXPECT_THAT(corrupt(d), HasSubstr("'pp'"));
  d = good;
  d["schedule"] = "zigzag";
  EXPECT_THAT(corrupt(d), HasSubstr("unknown schedule 'zigzag'"));
  d = good;
  d["rank_order"] = "pp-tp-dp";
  EXPECT_THAT(corrupt(d), HasSubstr("unknown rank order 'pp-tp-dp'"));
  d = good;
  d["recompute"] = "sometimes";
  EXPECT_THAT(corrupt(d), HasSubstr("'recompute'"));
  d = good;
  d["layers_per_stage"] = {4, 2.5};
  EXPECT_THAT(corrupt(d), HasSubstr("layers_per_stage[1]"));
}

TEST(Plan, NamesAndDescription) {
  for (auto s :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved_one_f_one_b})
    EXPECT_EQ(parse_schedule(schedule_name(s)), s);
  EXPECT_EQ(schedule_name(ScheduleKind::one_f_one_b), "1f1b");
  EXPECT_THAT(config_error([] { parse_schedule("2f2b"); }), HasSubstr("interleaved-1f1b"));
  EXPECT_EQ(parse_rank_order("dp-tp-pp"), RankOrder::dp_tp_pp);

  Plan p = make_plan(2, 2, 1);
  p.micro_batch = 4;
  p.micro_batches = 2;
  p.zero_stage = 1;
  EXPECT_EQ(p.describe(), "dp=2 tp=2 pp=1 v=1 mb=4x2 1f1b zero1");
}

TEST(Plan, AdaptiveScheduleCapsMemoryAtZbH1sBudgetUnlessTold) {
  Plan p;
  p.pp = 4;
  p.micro_batches = 8;
  p.schedule = parse_schedule("adaptive");
  EXPECT_EQ(p.schedule, ScheduleKind::adaptive);
  EXPECT_TRUE(p.split_backward());
  EXPECT_FALSE(p.v_shaped());
  // One chunk: ZB-H1's min(m, p) on every rank (1F1B's peak, rank 0's), and 1F1B's backward
  // budget min(m, p - r); interleaved 1F1B's min(v m, 2 (p - r - 1) + (v - 1) p + 1) and no
  // backward cap.
  EXPECT_EQ(p.dispatch_cap(0), 4);
  EXPECT_EQ(p.dispatch_cap(3), 4);
  EXPECT_EQ(p.dispatch_backward_cap(0), 4);
  EXPECT_EQ(p.dispatch_backward_cap(3), 1);
  p.micro_batches = 2;
  EXPECT_EQ(p.dispatch_cap(0), 2);
  EXPECT_EQ(p.dispatch_backward_cap(1), 2);
  EXPECT_EQ(p.dispatch_backward_cap(3), 1);
  p.micro_batches = 8;
  p.virtual_stages = 2;
  EXPECT_EQ(p.dispatch_cap(0), 11);
  EXPECT_EQ(p.dispatch_cap(3), 5);
  EXPECT_EQ(p.dispatch_backward_cap(0), 0);
  p.memory_cap = 3;
  EXPECT_EQ(p.dispatch_cap(0), 3);
  p.virtual_stages = 1;
  EXPECT_EQ(p.dispatch_backward_cap(0), 0);  // a cap the user set is the only one
  p.virtual_stages = 2;
  EXPECT_NE(p.describe().find("adaptive"), std::string::npos);
  EXPECT_NE(p.describe().find("cap=3"), std::string::npos);
  // The cap survives a plan file; plans written before it read as 0.
  EXPECT_EQ(plan_from_json(to_json(p)), p);
  nlohmann::json old = to_json(Plan{});
  old.erase("memory_cap");
  EXPECT_EQ(plan_from_json(old).memory_cap, 0);
  // On a V: zb-v's placement and budget (2 pp chunk activations).
  p.memory_cap = 0;
  p.v_shape = true;
  EXPECT_TRUE(p.v_shaped());
  EXPECT_EQ(p.stage_of(0, 1), 7);
  EXPECT_EQ(p.dispatch_cap(0), 8);
  EXPECT_EQ(plan_from_json(to_json(p)), p);
  const ModelConfig llama = ModelConfig::preset("llama-tiny");
  EXPECT_NO_THROW(p.validate(llama, 8, 4));
  EXPECT_THAT(config_error([&] { p.validate(ModelConfig::preset("gpt2-tiny"), 8, 4); }),
              HasSubstr("tied to the embedding"));
  p.virtual_stages = 3;
  EXPECT_THAT(config_error([&] { p.validate(llama, 8, 4); }),
              HasSubstr("v_shape placement places two model chunks"));
  p.virtual_stages = 2;
  p.schedule = ScheduleKind::interleaved_one_f_one_b;
  EXPECT_THAT(config_error([&] { p.validate(llama, 8, 4); }), HasSubstr("remove v_shape"));
}

TEST(Plan, JitRecomputeSurvivesAPlanFileAndNeedsWholeBackwards) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");
  Plan p;
  p.pp = 2;
  p.micro_batches = 4;
  p.jit_recompute = true;
  EXPECT_EQ(plan_from_json(to_json(p)), p);
  EXPECT_NE(p.describe().find("jit-recompute"), std::string::npos);
  EXPECT_NO_THROW(p.validate(c, 4, 2));
  p.schedule = ScheduleKind::zb_h1;
  EXPECT_THAT(config_error([&] { p.validate(c, 4, 2); }), HasSubstr("splits its backward"));
  p.schedule = ScheduleKind::one_f_one_b;
  p.recompute = model::Recompute::full;
  EXPECT_THAT(config_error([&] { p.validate(c, 4, 2); }), HasSubstr("set recompute to none"));
}

}  // namespace
}  // namespace tessel::layout
