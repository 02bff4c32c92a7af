#include "tessel/layout/state_layout.h"
#include "tessel/model/local_tp_group_test_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/layout/layout_test_util.h"
#include "tessel/model/init.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/tp_shard.h"
#include "tessel/model/transformer.h"
#include "tessel/tensor/region_test_util.h"

namespace tessel::layout {
namespace {

using model::ModelConfig;
using ::testing::HasSubstr;

using test_util::make_plan;

using tessel::test_util::region_offsets;
using test_util::llama_mqa;

int64_t flat_of(const Shape& s, const std::vector<int64_t>& point) {
  int64_t f = 0;
  const auto st = s.strides();
  for (size_t d = 0; d < point.size(); ++d) f += point[d] * st[d];
  return f;
}

// Row-major flat indices (in `shape`) of the elements of `box`.
std::vector<int64_t> box_indices(const Shape& shape, const Box& box) {
  StridedRegion r;
  r.offset = flat_of(shape, box.lo());
  r.strides = shape.strides();
  for (size_t d = 0; d < box.rank(); ++d) r.extents.push_back(box.extent(d));
  return region_offsets(r);
}

TEST(FlatRangeBoxes, TileExactlyTheRangeInFlatOrder) {
  std::mt19937_64 rng(7);
  const std::vector<Shape> shapes = {Shape{17},   Shape{5, 7}, Shape{3, 4, 5},
                                     Shape{1, 9}, Shape{6, 1}, Shape{2, 3, 1, 4}};
  for (const Shape& s : shapes) {
    const int64_t n = s.numel();
    for (int trial = 0; trial < 60; ++trial) {
      int64_t a = int64_t(rng() % uint64_t(n + 1)), b = int64_t(rng() % uint64_t(n + 1));
      if (a > b) std::swap(a, b);
      if (trial == 0) a = 0, b = n;
      std::vector<int64_t> got;
      const auto boxes = flat_range_boxes(s, a, b);
      for (const Box& bx : boxes) {
        EXPECT_FALSE(bx.empty());
        for (int64_t f : box_indices(s, bx)) got.push_back(f);
      }
      std::vector<int64_t> want(size_t(b - a));
      std::iota(want.begin(), want.end(), a);
      EXPECT_EQ(got, want) << s.str() << " [" << a << ", " << b << ")";
      // Partial leading and trailing blocks per dimension, one run of whole slices.
      EXPECT_LE(boxes.size(), 2 * s.rank() - 1) << s.str();
    }
  }
  EXPECT_TRUE(flat_range_boxes(Shape{4, 4}, 3, 3).empty());
  EXPECT_EQ(flat_range_boxes(Shape{4, 4}, 0, 16), std::vector<Box>{Box({0, 0}, {4, 4})});
  EXPECT_EQ(flat_range_boxes(Shape{4, 4}, 3, 13),
            (std::vector<Box>{Box({0, 3}, {1, 4}), Box({1, 0}, {3, 4}), Box({3, 0}, {3 + 1, 1})}));
  EXPECT_THROW(flat_range_boxes(Shape{4, 4}, 3, 17), InvalidArgumentError);
}

TEST(TrainingState, KindNamesAndScalarBlob) {
  for (StateKind k : kAllStateKinds) EXPECT_EQ(parse_state_kind(state_kind_name(k)), k);
  EXPECT_THROW(parse_state_kind("adam"), ConfigError);
  EXPECT_EQ(state_name("model.norm.weight", StateKind::param), "model.norm.weight");
  EXPECT_EQ(state_name("model.norm.weight", StateKind::adam_v), "model.norm.weight/adam_v");
  EXPECT_TRUE(is_optimizer_state(StateKind::master));
  EXPECT_FALSE(is_optimizer_state(StateKind::param));

  ScalarState s{12, 11, 4096, {1, 2, 3, 250}};
  const auto blob = encode(s);
  EXPECT_EQ(decode_scalar_state(blob.data(), blob.size()), s);
  EXPECT_THROW(decode_scalar_state(blob.data(), blob.size() - 1), CorruptDataError);
  EXPECT_THROW(decode_scalar_state(blob.data(), 5), CorruptDataError);
  auto bad = blob;
  bad[0] ^= 1;
  EXPECT_THROW(decode_scalar_state(bad.data(), bad.size()), CorruptDataError);
}

// Expected number of copies of every element of `tensor` (one kind) over all ranks.
int expected_copies(const StateLayout& L, int tensor, StateKind kind) {
  const auto& spec = L.spec()[size_t(tensor)];
  const auto& c = L.config();
  const Plan& p = L.plan();
  int copies = model::tp_copies(spec, c, p.tp);
  if (!(p.zero_stage == 1 && is_optimizer_state(kind))) copies *= p.dp;
  const auto wte = model::global_param_name(c.family, model::GlobalParam::token_embedding);
  if (c.tie_embeddings && spec.name == wte && p.num_stages() > 1) copies *= 2;
  return copies;
}

// Every buffer is tiled exactly once by its rank's pieces, and every element of every tensor
// state is held exactly expected_copies() times over the ranks.
void check_tiling(const StateLayout& L) {
  std::vector<std::vector<int>> count(L.spec().size() * 4);
  for (size_t t = 0; t < L.spec().size(); ++t) {
    for (StateKind k : L.kinds()) count[t * 4 + size_t(k)].assign(size_t(L.spec()[t].numel()), 0);
  }
  for (int r = 0; r < L.world(); ++r) {
    const auto& bufs = L.buffers(r);
    std::vector<std::vector<int>> cover(bufs.size());
    for (size_t b = 0; b < bufs.size(); ++b) cover[b].assign(size_t(bufs[b].numel), 0);
    int64_t last_buffer = -1, last_offset = -1;
    for (const StatePiece& p : L.pieces(r)) {
      ASSERT_EQ(p.rank, r);
      ASSERT_FALSE(p.global.empty());
      ASSERT_TRUE(Box::of(L.spec()[size_t(p.tensor)].shape).contains(p.global));
      ASSERT_EQ(bufs[size_t(p.buffer)].kind, p.kind);
      ASSERT_TRUE(p.buffer > last_buffer || (p.buffer == last_buffer && p.offset > last_offset))
          << "pieces out of order";
      last_buffer = p.buffer;
      last_offset = p.offset;
      const auto region = p.region();
      ASSERT_LE(region.end(), bufs[size_t(p.buffer)].numel);
      for (int64_t f : region_offsets(region)) ++cover[size_t(p.buffer)][size_t(f)];
      auto& c = count[size_t(p.tensor) * 4 + size_t(p.kind)];
      for (int64_t f : box_indices(L.spec()[size_t(p.tensor)].shape, p.global)) ++c[size_t(f)];
    }
    for (size_t b = 0; b < bufs.size(); ++b) {
      for (size_t i = 0; i < cover[b].size(); ++i) {
        ASSERT_EQ(cover[b][i], 1) << "rank " << r << " buffer " << b << " element " << i;
      }
    }
  }
  for (size_t t = 0; t < L.spec().size(); ++t) {
    for (StateKind k : L.kinds()) {
      const int want = expected_copies(L, int(t), k);
      const auto& c = count[t * 4 + size_t(k)];
      for (size_t i = 0; i < c.size(); ++i) {
        ASSERT_EQ(c[i], want) << L.spec()[t].name << " " << state_kind_name(k) << " element " << i
                              << " under " << L.plan().describe();
      }
    }
  }
}

struct Case {
  ModelConfig config;
  Plan plan;
};

std::vector<Case> layout_cases() {
  const auto gpt = ModelConfig::preset("gpt2-tiny");
  const auto llama = ModelConfig::preset("llama-tiny");
  return {
      {gpt, make_plan(1, 1, 1)},
      {gpt, make_plan(2, 2, 1, 1, 1)},
      {gpt, make_plan(1, 4, 1, 1, 0)},             // vocab shard 3 is all padding
      {gpt, make_plan(3, 1, 1, 1, 1)},             // ZeRO-1 ranges cut a bias mid-way
      {gpt, make_plan(5, 1, 1, 1, 1)},             // n % dp != 0, cuts mid-row
      {gpt, make_plan(1, 1, 3, 1, 0, {1, 6, 1})},  // embedding / head alone, tied copy
      {gpt, make_plan(1, 2, 2, 2, 1, {2, 1, 3, 2}, RankOrder::dp_tp_pp)},
      {gpt, make_plan(2, 1, 2, 2, 1)},
      {llama, make_plan(1, 2, 2, 1, 1)},  // kv heads split
      {llama, make_plan(1, 4, 1, 1, 1)},  // tp 4 > n_kv_head 2: kv heads replicated
      {llama, make_plan(2, 2, 1, 1, 1, {}, RankOrder::dp_tp_pp)},
      {llama_mqa(), make_plan(1, 4, 1)},
      {llama_mqa(), make_plan(2, 2, 1, 1, 1)},
  };
}

TEST(StateLayout, BuffersAreTiledAndEveryElementHasItsReplicas) {
  for (const Case& c : layout_cases()) {
    SCOPED_TRACE(c.config.name + " " + c.plan.describe());
    const auto L = StateLayout::build(c.config, c.plan);
    check_tiling(L);
  }
  // With master weights too.
  const auto L = StateLayout::build(ModelConfig::preset("gpt2-tiny"), make_plan(2, 1, 2, 1, 1),
                                    {StateKind::param, StateKind::master});
  check_tiling(L);
  EXPECT_EQ(L.buffers(0).size(), 2u);
  EXPECT_EQ(L.buffers(0)[1].kind, StateKind::master);
  EXPECT_LT(L.buffers(0)[1].numel, L.buffers(0)[0].numel);
}

// The param buffers are exactly what ParallelTrainer's Transformers hold after init(seed): same
// size, same order, bit for bit (tp shards, tied copies, padding rows included).
TEST(StateLayout, ParamBuffersMatchTheRuntimeModel) {
  auto backend = kernels::make_backend("cpu");
  const uint64_t seed = 1234;
  for (const Case& c : layout_cases()) {
    SCOPED_TRACE(c.config.name + " " + c.plan.describe());
    const auto L = StateLayout::build(c.config, c.plan);
    const auto ranges = L.plan().stage_ranges(c.config);
    auto groups = model::LocalTpGroup::create(c.plan.tp);
    auto init_source = [&](const model::ParamSpec& spec, StateKind kind, const Box& box,
                           float* out) {
      ASSERT_EQ(kind, StateKind::param);
      model::init_box(spec, seed, box, out);
    };
    const auto params_only = StateLayout::build(c.config, c.plan, {StateKind::param});
    for (int r = 0; r < L.world(); ++r) {
      const Coord co = L.plan().coord_of(r);
      ASSERT_EQ(int(L.buffers(r).size()), L.plan().virtual_stages * 3);
      std::vector<std::vector<float>> store;
      std::vector<std::span<float>> spans;
      for (const auto& b : params_only.buffers(r)) store.emplace_back(size_t(b.numel), -7.0f);
      for (auto& s : store) spans.emplace_back(s);
      params_only.fill(r, init_source, spans);
      for (int ch = 0; ch < L.plan().virtual_stages; ++ch) {
        const int stage = L.plan().stage_of(co.pp, ch);
        model::TpGroup* tp = c.plan.tp > 1 ? groups[size_t(co.tp)].get() : nullptr;
        model::Transformer m(c.config, *backend, 1, 2, ranges[size_t(stage)], tp);
        m.init(seed);
        const int b = L.buffer_id(r, ch, StateKind::param);
        const BufferInfo& info = L.buffers(r)[size_t(b)];
        EXPECT_EQ(info.stage, stage);
        ASSERT_EQ(info.chunk_numel, m.num_params());
        ASSERT_EQ(info.numel, m.num_params());
        ASSERT_EQ(std::memcmp(store[size_t(ch)].data(), m.params().data<float>(),
                              size_t(m.num_params()) * sizeof(float)),
                  0)
            << "rank " << r << " chunk " << ch;
        // Optimizer state: ParallelTrainer's owned range under ZeRO-1, the whole chunk otherwise.
        for (StateKind k : {StateKind::adam_m, StateKind::adam_v}) {
          const BufferInfo& o = L.buffers(r)[size_t(L.buffer_id(r, ch, k))];
          const int64_t n = m.num_params(), dp = c.plan.dp, d = co.dp;
          if (c.plan.zero_stage == 1) {
            EXPECT_EQ(o.chunk_begin, d * (n / dp) + std::min(d, n % dp));
            EXPECT_EQ(o.numel, n / dp + (d < n % dp));
          } else {
            EXPECT_EQ(o.chunk_begin, 0);
            EXPECT_EQ(o.numel, n);
          }
        }
      }
    }
  }
}

TEST(StateLayout, ZeroRangesCutShardsIntoPartialRows) {
  const auto c = ModelConfig::preset("gpt2-tiny");
  // 90624 parameters over 5 dp ranks: 18125 each (rank 0: 18125), not a multiple of a row.
  const int dp = 5;
  const auto L = StateLayout::build(c, make_plan(dp, 1, 1, 1, 1));
  bool partial_row = false;
  for (int r = 0; r < dp; ++r) {
    for (const StatePiece& p : L.pieces(r)) {
      if (p.kind == StateKind::adam_m && p.global.rank() == 2 && p.global.extent(0) == 1 &&
          p.global.extent(1) < c.n_embd)
        partial_row = true;
    }
  }
  EXPECT_TRUE(partial_row);
  // The ranges are contiguous over dp and cover the chunk.
  int64_t next = 0;
  for (int r = 0; r < dp; ++r) {
    const auto& b = L.buffers(r)[size_t(L.buffer_id(r, 0, StateKind::adam_v))];
    EXPECT_EQ(b.chunk_begin, next);
    next += b.numel;
  }
  EXPECT_EQ(next, c.num_params());
}

TEST(StateLayout, PaddingRowsAreState) {
  const auto c = ModelConfig::preset("gpt2-tiny");  // vocab 257, padded 384
  const auto L = StateLayout::build(c, make_plan(1, 4, 1));
  const auto wte = L.replicas("transformer.wte.weight", StateKind::param);
  ASSERT_EQ(wte.size(), 4u);
  EXPECT_EQ(wte[3]->rank, 3);
  EXPECT_EQ(wte[3]->global, Box({288, 0}, {384, c.n_embd}));  // all padding
  // A box in the padding is found on the rank holding it.
  const auto hits =
      L.replicas("transformer.wte.weight", StateKind::adam_m, Box({300, 0}, {301, 4}));
  ASSERT_EQ(hits.size(), 1u);
  EXPECT_EQ(hits[0]->rank, 3);
}

TEST(StateLayout, ReplicasFindEveryCopyOfABox) {
  const auto c = ModelConfig::preset("llama-tiny");
  const auto L = StateLayout::build(c, make_plan(2, 4, 1, 1, 1));
  const std::string k = "model.layers.2.self_attn.k_proj.weight";
  // k_proj is [2 kv heads x 8, 32]; kv head 1 (rows 8..15) is on tp ranks 2 and 3 of both dp
  // replicas.
  const Box row({9, 0}, {10, c.n_embd});
  for (StateKind kind : {StateKind::param, StateKind::adam_m}) {
    int64_t covered = 0;
    for (const StatePiece* p : L.replicas(k, kind, row))
      covered += p->global.intersect(row).volume();
    EXPECT_EQ(covered, row.volume() * (kind == StateKind::param ? 4 : 2)) << state_kind_name(kind);
  }
  EXPECT_THROW(L.replicas("no.such.tensor", StateKind::param), InvalidArgumentError);
  EXPECT_THROW(L.replicas(k, StateKind::master), InvalidArgumentError);
}

TEST(StateLayout, FillRejectsWrongBuffers) {
  const auto L = StateLayout::build(ModelConfig::preset("gpt2-tiny"), make_plan(1, 1, 1));
  std::vector<float> small(10);
  std::vector<std::span<float>> spans(3, std::span<float>(small));
  auto src = [](const model::ParamSpec&, StateKind, const Box&, float*) {};
  EXPECT_THROW(L.fill(0, src, spans), InvalidArgumentError);
  spans.pop_back();
  EXPECT_THROW(L.fill(0, src, spans), InvalidArgumentError);
}

TEST(StateLayout, RejectsPlansThatCannotLayOutTheModel) {
  const auto gpt = ModelConfig::preset("gpt2-tiny");
  auto error = [&](const Plan& p) {
    try {
      StateLayout::build(gpt, p);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error(make_plan(1, 3, 1)), HasSubstr("n_head"));
  EXPECT_THAT(error(make_plan(1, 1, 1, 2)), HasSubstr("token embedding twice"));
  EXPECT_THAT(error(make_plan(1, 1, 2, 1, 0, {1, 2})), HasSubstr("layers_per_stage"));
  Plan z = make_plan(2, 1, 1);
  z.zero_stage = 2;
  EXPECT_THAT(error(z), HasSubstr("zero_stage"));
  EXPECT_THROW(StateLayout::build(gpt, make_plan(1, 1, 1), {StateKind::param, StateKind::param}),
               ConfigError);
}

}  // namespace
}  // namespace tessel::layout
