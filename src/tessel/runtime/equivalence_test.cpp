// The equivalence matrix of 3D-parallel training: for both model families, every (dp, tp, pp)
// layout of the acceptance list, with ZeRO-1 on and off where there is data parallelism and with
// each pipeline schedule where there is pipeline parallelism (zero-bubble ones included: ZB-H1,
// and ZB-V for the untied model, and the adaptive dispatcher), 6 steps on real worker processes
// (`tessel train CONFIG --nproc N`; plus dp 3 x pp 2 with ZeRO-1 on 6):
//   * every step equals one single-process step from the state the run saved before it: the
//     logged loss, the parameters and the Adam moments, within bounds derived from the float32
//     arithmetic (step_check_test_util.h says why step by step; testing/rounding.h derives the
//     bounds), and
//   * the final parameters, reassembled from every rank's shards (every dp replica, every tp
//     shard, both pipeline copies of a tied embedding, every copy of a replicated kv head), are
//     held by the right number of ranks, bit-identical across copies and to the final checkpoint.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "tessel/config/config_test_util.h"
#include "tessel/model/model_spec.h"
#include "tessel/model/tp_shard.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/tensor/box_copy.h"

namespace tessel::runtime {

using checkpoint::checkpoint_step_name;
using config::TrainConfig;
namespace {

using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

constexpr int kSteps = 6;

struct Case {
  std::string preset;
  int dp = 1, tp = 1, pp = 1, virtual_stages = 1;
  int micro_batch = 2;
  std::string schedule = "1f1b";
  int zero_stage = 0;

  int world() const { return dp * tp * pp; }
  std::string name() const {
    auto s = fmt::format("{}_dp{}_tp{}_pp{}", preset, dp, tp, pp);
    if (virtual_stages > 1) s += fmt::format("_v{}", virtual_stages);
    if (pp > 1) s += "_" + schedule;
    if (dp > 1) s += fmt::format("_zero{}", zero_stage);
    for (char& c : s)
      if (c == '-') c = '_';
    return s;
  }
  std::string yaml() const {
    return fmt::format(
        "parallel: {{dp: {}, tp: {}, pp: {}, virtual_stages: {}, micro_batch: {}, schedule: {}, "
        "zero_stage: {}, bucket_mb: 0.01}}\n"
        "output: {{metrics: metrics.jsonl, rank_params: dump}}\n",
        dp, tp, pp, virtual_stages, micro_batch, schedule, zero_stage);
  }
};

// bucket_mb 0.01 (2621 floats) cuts the tiny models' gradients into several buckets, so the dp
// all-reduce really overlaps the last backward bucket by bucket.
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name();
}

// Global batch 12: 12 / dp samples per replica, cut into micro-batches of `micro_batch`.
const std::string kTraining = fmt::format(
    "training: {{steps: {}, global_batch: 12, micro_batch: 2, threads: 1, eval_every: 2, "
    "eval_batches: 3}}\n"
    "optimizer: {{lr: 0.01, warmup_steps: 1}}\n",
    kSteps);

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    out.push_back({.preset = preset});
    // Data parallel, alone and with tensor parallelism: ZeRO-1 off and on.
    for (int z : {0, 1}) {
      out.push_back({.preset = preset, .dp = 2, .zero_stage = z});
      out.push_back({.preset = preset, .dp = 3, .zero_stage = z});
      out.push_back({.preset = preset, .dp = 2, .tp = 2, .zero_stage = z});
    }
    out.push_back({.preset = preset, .tp = 2});
    // Pipelines: each schedule (interleaved with 2 virtual stages per rank).
    struct Pipe {
      int dp, tp, pp;
    };
    // dp 3 x pp 2 (6 workers, ZeRO-1): the tied embedding's dp reduction must give both
    // pipeline ends the same bits (see the identical-copies check below).
    out.push_back({.preset = preset, .dp = 3, .pp = 2, .micro_batch = 2, .zero_stage = 1});
    for (Pipe p : {Pipe{1, 1, 2}, Pipe{1, 1, 4}, Pipe{2, 1, 2}, Pipe{1, 2, 2}}) {
      for (int z : p.dp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0}) {
        // micro-batches per replica: 12 / dp / micro_batch; interleaving needs a multiple of pp.
        const int mb = p.pp == 4 ? 3 : (p.dp == 2 ? 3 : 2);
        Case c{.preset = preset,
               .dp = p.dp,
               .tp = p.tp,
               .pp = p.pp,
               .micro_batch = mb,
               .zero_stage = z};
        for (std::string s : {"gpipe", "1f1b", "zb-h1", "adaptive"}) {
          c.schedule = s;
          out.push_back(c);
        }
        c.schedule = "interleaved-1f1b";
        c.virtual_stages = 2;
        out.push_back(c);
        // ZB-V's V puts the embedding and the head on rank 0: untied models only (llama-tiny).
        if (preset == "llama-tiny") {
          c.schedule = "zb-v";
          out.push_back(c);
        }
      }
    }
  }
  return out;
}

// One shard as written by output.rank_params (parallel_trainer.h).
struct Shard {
  std::string name;
  int tp_rank = 0, tp_size = 1;
  std::vector<float> values;
};

std::vector<Shard> read_dump(const std::filesystem::path& path) {
  std::vector<Shard> out;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path << " was not written";
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream head(line);
    Shard s;
    int64_t numel = 0;
    head >> s.name >> numel >> s.tp_rank >> s.tp_size;
    s.values.resize(size_t(numel));
    in.read(reinterpret_cast<char*>(s.values.data()), std::streamsize(numel * sizeof(float)));
    EXPECT_TRUE(in) << path << ": " << s.name;
    out.push_back(std::move(s));
  }
  return out;
}

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, LossesAndFinalParametersMatchOneProcess) {
  const Case& c = GetParam();
  TempDir dir;
  auto corpus = make_corpus(dir);
  const auto single_cfg = write_config(dir, corpus, kTraining, "single.yaml", c.preset);
  auto cfg =
      write_config(dir, corpus, kTraining + c.yaml() + testing::every_step_checkpoints(kSteps),
                   "parallel.yaml", c.preset);
  std::filesystem::create_directories(dir / "dump");
  auto bin = tessel::testing::tessel_binary();
  ASSERT_TRUE(std::filesystem::exists(bin)) << bin << " is not built; build the `tessel` target";
  const auto args = fmt::format("train {} --nproc {}", cfg, c.world());
  std::string out;
  int rc = tessel::testing::run_command(fmt::format("OMP_NUM_THREADS=1 {} {}", bin.string(), args),
                                        &out);
  ASSERT_EQ(rc, 0) << out;

  const auto losses = testing::read_step_losses(dir / "metrics.jsonl");
  ASSERT_EQ(int64_t(losses.size()), kSteps) << out;
  // Evaluation too, under every layout (eval_every 2: steps 2, 4, ...).
  const auto eval_losses = testing::read_eval_losses(dir / "metrics.jsonl");
  EXPECT_EQ(int64_t(eval_losses.size()), kSteps / 2) << out;
  const auto checked = testing::expect_steps_match_one_process(single_cfg, dir / "steps", losses, 1,
                                                               kSteps, eval_losses);
  EXPECT_EQ(checked.evaluated, kSteps / 2);

  // Every shard of every rank, placed into the whole tensor by its tp pieces, against the final
  // checkpoint.
  ReferenceTrainer final_state(TrainConfig::load(single_cfg));
  final_state.load_checkpoint((dir / "steps" / checkpoint_step_name(kSteps)).string());
  const auto& m = final_state.model();
  const auto& config = m.config();
  const auto spec = model::ModelSpec::from(config);
  const float* ref = m.params().data<float>();
  std::map<std::string, const model::ParamView*> views;
  for (const auto& v : m.param_views()) views[v.name] = &v;
  // Per tensor, how many shards hold each element (counted through packed element indices). Every
  // copy (dp replicas, tp-replicated tensors and kv heads, the tied embedding on both pipeline
  // ends) must be bit-identical, since resharding takes any of them: each equals the checkpoint.
  std::map<std::string, std::vector<int>> held;
  int64_t differing = 0;
  std::string first_differing;
  for (int r = 0; r < c.world(); ++r) {
    for (const Shard& s : read_dump(dir / "dump" / fmt::format("rank{}.params", r))) {
      ASSERT_TRUE(views.count(s.name)) << "rank " << r << " holds unknown " << s.name;
      ASSERT_EQ(s.tp_size, c.tp) << s.name;
      const auto& p = spec.at(s.name);
      const float* whole = ref + views[s.name]->offset;
      const Shape local_shape = model::tp_local_shape(p, config, s.tp_rank, s.tp_size);
      ASSERT_EQ(local_shape.numel(), int64_t(s.values.size())) << s.name;
      std::vector<int32_t> index(size_t(p.numel()));
      for (size_t i = 0; i < index.size(); ++i) index[i] = int32_t(i);
      auto& count = held[s.name];
      count.resize(size_t(p.numel()), 0);
      for (const auto& piece : model::tp_shard_pieces(p, config, s.tp_rank, s.tp_size)) {
        const auto n = size_t(piece.global.volume());
        std::vector<float> got(n), want(n);
        std::vector<int32_t> at(n);
        pack_box(s.values.data(), local_shape, piece.local, got.data(), sizeof(float));
        pack_box(whole, p.shape, piece.global, want.data(), sizeof(float));
        pack_box(index.data(), p.shape, piece.global, at.data(), sizeof(int32_t));
        for (size_t i = 0; i < n; ++i) {
          if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && differing++ == 0)
            first_differing = fmt::format("{} element {} (rank {}): {} vs saved {}", s.name, at[i],
                                          r, got[i], want[i]);
          ++count[size_t(at[i])];
        }
      }
    }
  }
  // Each element of each parameter is held by dp replicas x its tp copies (x 2 for the tied
  // embedding on the two pipeline ends).
  for (const auto& p : spec) {
    ASSERT_TRUE(held.count(p.name)) << p.name << " is on no rank";
    const bool tied_twice =
        c.pp > 1 && config.tie_embeddings &&
        p.name == model::global_param_name(config.family, model::GlobalParam::token_embedding);
    const int want = c.dp * model::tp_copies(p, config, c.tp) * (tied_twice ? 2 : 1);
    const auto& n = held.at(p.name);
    for (size_t i = 0; i < n.size(); ++i)
      ASSERT_EQ(n[i], want) << p.name << " element " << i
                            << " is held by the wrong number of ranks";
  }
  EXPECT_EQ(differing, 0) << "ranks hold other values than the final checkpoint, first: "
                          << first_differing;
}

INSTANTIATE_TEST_SUITE_P(Matrix, Equivalence, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace tessel::runtime
