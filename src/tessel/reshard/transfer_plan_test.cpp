// Exactness of resharding (issue 4's property test), run in memory with execute_in_memory (which
// packs and unpacks every message like the networked executor; executor_test.cpp runs the
// network path).
//
// For random pairs (A, B) of valid plans over 1..4 workers (dp / tp / pp / virtual stages /
// ZeRO-1 / rank order / uneven stage cuts) of gpt2-tiny (tied embeddings), llama-tiny (GQA, 2 kv
// heads: tp 4 replicates them) and a multi-query llama (1 kv head), with random process
// identities (survivors, leavers, joiners) on two hosts:
//   - A -> B gives exactly the buffers a fresh B builds from the same seed (bit for bit), and
//     the same holds for the `ids` filling where every element is distinct;
//   - A -> B -> A gives back A bit for bit;
//   - the plan writes every new element exactly once, from an old copy of the same element;
//     sends no element twice to one process and none that the process already holds, so it
//     moves exactly the lower bound; and its statistics add up.
// With some old ranks lost (TransferPlan::kLost), for random (A, B, lost ranks): lost_state()
// lists exactly the elements only lost ranks held (checked element by element), and whenever it
// is empty the plan rebuilds B bit for bit from the survivors' buffers alone, else build throws.
#include "tessel/reshard/transfer_plan.h"

#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "tessel/core/error.h"
#include "tessel/layout/layout_test_util.h"
#include "tessel/model/tp_shard.h"
#include "tessel/reshard/executor.h"
#include "tessel/reshard/reshard_test_util.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/testing/testing.h"

namespace tessel::reshard {
namespace {

using layout::Coord;
using layout::Plan;
using layout::RankOrder;
using layout::ScheduleKind;
using layout::StatePiece;
using model::ModelConfig;
using testing::RankState;
using testing::StateUniverse;

constexpr uint64_t kSeed = 42;

using layout::test_util::make_plan;

using layout::test_util::llama_mqa;

// Every valid plan of `config` on `world` workers (stage cuts: the default and one random one).
std::vector<Plan> valid_plans(const ModelConfig& config, int world, std::mt19937_64& rng) {
  std::vector<Plan> out;
  const int units = config.n_layer + 2;
  for (int tp = 1; tp <= world; ++tp) {
    for (int pp = 1; pp * tp <= world; ++pp) {
      if (world % (tp * pp) != 0) continue;
      const int dp = world / (tp * pp);
      for (int v = 1; v <= 3; ++v) {
        if (v > 1 && pp < 2) continue;
        if (pp * v > units) continue;
        for (int zero = 0; zero <= 1; ++zero) {
          for (RankOrder order : {RankOrder::tp_dp_pp, RankOrder::dp_tp_pp}) {
            for (int cut = 0; cut < 2; ++cut) {
              std::vector<int> lps;
              const int S = pp * v;
              if (cut == 1) {
                if (S == 1) continue;
                std::vector<int> points(size_t(units - 1));
                std::iota(points.begin(), points.end(), 1);
                std::shuffle(points.begin(), points.end(), rng);
                points.resize(size_t(S - 1));
                std::sort(points.begin(), points.end());
                int prev = 0;
                for (int p : points) lps.push_back(p - prev), prev = p;
                lps.push_back(units - prev);
              }
              Plan p = make_plan(dp, tp, pp, v, zero, lps, order);
              try {
                p.validate(config, p.global_batch(), world);
              } catch (const ConfigError&) {
                continue;
              }
              out.push_back(p);
            }
          }
        }
      }
    }
  }
  return out;
}

struct Transition {
  std::vector<int> old_ids, new_ids, old_hosts, new_hosts;
};

// Random identities: a random subset of the old processes survives (at random new ranks), the
// other new ranks are fresh processes; hosts are a fixed function of the process id.
Transition random_transition(int wa, int wb, std::mt19937_64& rng) {
  Transition t;
  std::vector<int> pool(size_t(wa + wb));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  t.old_ids.assign(pool.begin(), pool.begin() + wa);
  std::vector<int> survivors = t.old_ids;
  std::shuffle(survivors.begin(), survivors.end(), rng);
  size_t fresh = size_t(wa);
  const int keep_percent = int(rng() % 101);
  for (int j = 0; j < wb; ++j) {
    if (!survivors.empty() && int(rng() % 100) < keep_percent) {
      t.new_ids.push_back(survivors.back());
      survivors.pop_back();
    } else {
      t.new_ids.push_back(pool[fresh++]);
    }
  }
  auto host = [](int id) { return (id * 7 + 3) % 11 % 2; };
  for (int id : t.old_ids) t.old_hosts.push_back(host(id));
  for (int id : t.new_ids) t.new_hosts.push_back(host(id));
  return t;
}

std::vector<RankState> fill_all(const layout::StateLayout& L, const StateUniverse& u, bool ids) {
  std::vector<RankState> out;
  for (int r = 0; r < L.world(); ++r) out.push_back(testing::filled_state(L, r, u, ids));
  return out;
}

// Executes `plan` from `old_state` into `new_state` (in memory).
void run_into(const TransferPlan& plan, const std::vector<RankState>& old_state,
              std::vector<RankState>& new_state) {
  std::vector<std::vector<std::span<const float>>> olds;
  for (const auto& s : old_state) olds.push_back(s.const_spans());
  std::vector<std::vector<std::span<float>>> news;
  for (auto& s : new_state) news.push_back(s.spans());
  execute_in_memory(plan, olds, news);
}

std::vector<RankState> run(const TransferPlan& plan, const layout::StateLayout& to,
                           const std::vector<RankState>& old_state) {
  std::vector<RankState> fresh;
  for (int j = 0; j < to.world(); ++j) fresh.push_back(testing::empty_state(to, j));
  run_into(plan, old_state, fresh);
  return fresh;
}

// (dense) element ids a layout rank holds.
std::vector<uint8_t> holdings(const layout::StateLayout& L, int rank, const StateUniverse& u) {
  std::vector<uint8_t> held(size_t(u.total()), 0);
  for (const StatePiece& p : L.pieces(rank)) {
    testing::for_each_in_box(
        u.spec()[size_t(p.tensor)].shape, p.global,
        [&](int64_t flat, int64_t) { held[size_t(u.id(p.tensor, p.kind, flat))] = 1; });
  }
  return held;
}

// The plan-level properties, element by element.
void check_plan(const TransferPlan& plan, const layout::StateLayout& from,
                const layout::StateLayout& to, const Transition& t, const StateUniverse& u,
                const std::vector<RankState>& old_ids_state) {
  // Every new element is written exactly once (kept buffers count as written), and each
  // transfer's source region holds exactly the elements of its box.
  std::vector<std::vector<std::vector<int>>> writes(size_t(to.world()));
  for (int j = 0; j < to.world(); ++j) {
    for (size_t b = 0; b < to.buffers(j).size(); ++b) {
      writes[size_t(j)].emplace_back(size_t(to.buffers(j)[b].numel),
                                     plan.kept_from(j, int(b)) >= 0 ? 1 : 0);
    }
  }
  std::vector<float> packed;
  for (const Transfer& tr : plan.transfers()) {
    ASSERT_EQ(tr.src_process, t.old_ids[size_t(tr.src_rank)]);
    ASSERT_EQ(tr.dst_process, t.new_ids[size_t(tr.dst_rank)]);
    ASSERT_EQ(plan.kept_from(tr.dst_rank, tr.dst_buffer), -1);
    for (int64_t f : testing::region_offsets(tr.dst))
      ++writes[size_t(tr.dst_rank)][size_t(tr.dst_buffer)][size_t(f)];
    packed.resize(size_t(tr.numel()));
    gather(
        std::span<const float>(old_ids_state[size_t(tr.src_rank)].buffers[size_t(tr.src_buffer)]),
        tr.src, std::span(packed));
    int64_t wrong = 0;
    testing::for_each_in_box(u.spec()[size_t(tr.tensor)].shape, tr.global,
                             [&](int64_t flat, int64_t k) {
                               wrong += packed[size_t(k)] != float(u.id(tr.tensor, tr.kind, flat));
                             });
    ASSERT_EQ(wrong, 0) << "the source of a transfer of " << u.spec()[size_t(tr.tensor)].name << " "
                        << tr.global.str() << " holds other elements";
  }
  for (int j = 0; j < to.world(); ++j) {
    for (size_t b = 0; b < writes[size_t(j)].size(); ++b) {
      const auto& w = writes[size_t(j)][b];
      const auto bad = std::find_if(w.begin(), w.end(), [](int n) { return n != 1; });
      ASSERT_TRUE(bad == w.end()) << "new rank " << j << " buffer " << b << " element "
                                  << (bad - w.begin()) << " written " << *bad << " times";
    }
  }

  // Nothing sent twice to a process, nothing sent that it holds; the total is the lower bound.
  std::map<int, std::vector<uint8_t>> received;
  int64_t needed_not_held = 0;
  for (int j = 0; j < to.world(); ++j) {
    const int q = t.new_ids[size_t(j)];
    const int i = plan.old_rank_of(q);
    const auto held = i >= 0 ? holdings(from, i, u) : std::vector<uint8_t>(size_t(u.total()), 0);
    const auto needed = holdings(to, j, u);
    for (size_t e = 0; e < needed.size(); ++e) needed_not_held += needed[e] && !held[e];
    auto& got = received[q];
    got.assign(size_t(u.total()), 0);
    for (const Message& m : plan.messages()) {
      if (m.dst_process != q) continue;
      for (int ti : m.transfers) {
        const Transfer& tr = plan.transfers()[size_t(ti)];
        int64_t already_held = 0, twice = 0;
        testing::for_each_in_box(u.spec()[size_t(tr.tensor)].shape, tr.global,
                                 [&](int64_t flat, int64_t) {
                                   const size_t id = size_t(u.id(tr.tensor, tr.kind, flat));
                                   already_held += held[id];
                                   twice += got[id];
                                   got[id] = 1;
                                 });
        ASSERT_EQ(already_held, 0) << "sends elements process " << q << " holds";
        ASSERT_EQ(twice, 0) << "sends elements twice to process " << q;
      }
    }
  }
  const auto& st = plan.stats();
  EXPECT_EQ(st.bytes_moved, needed_not_held * 4);
  EXPECT_EQ(st.min_bytes, st.bytes_moved);

  // Statistics add up.
  std::map<int, int64_t> sent, recv;
  int64_t moved = 0, cross = 0, local = 0, written = 0, kept = 0;
  std::map<int, int> host;
  for (size_t i = 0; i < t.old_ids.size(); ++i) host[t.old_ids[i]] = t.old_hosts[i];
  for (size_t j = 0; j < t.new_ids.size(); ++j) host[t.new_ids[j]] = t.new_hosts[j];
  std::set<std::pair<int, int>> pairs;
  for (const Message& m : plan.messages()) {
    EXPECT_NE(m.src_process, m.dst_process);
    EXPECT_TRUE(pairs.insert({m.src_process, m.dst_process}).second) << "two messages per pair";
    int64_t n = 0;
    for (int ti : m.transfers) n += plan.transfers()[size_t(ti)].numel();
    EXPECT_EQ(n, m.numel);
    moved += m.bytes();
    if (host[m.src_process] != host[m.dst_process]) cross += m.bytes();
    sent[m.src_process] += m.bytes();
    recv[m.dst_process] += m.bytes();
  }
  for (const Transfer& tr : plan.transfers()) {
    if (tr.src_process == tr.dst_process) local += tr.numel() * 4;
    written += tr.numel() * 4;
  }
  for (int j = 0; j < to.world(); ++j) {
    for (size_t b = 0; b < to.buffers(j).size(); ++b)
      if (plan.kept_from(j, int(b)) >= 0) kept += to.buffers(j)[b].numel * 4;
  }
  int64_t max_sent = 0, max_recv = 0;
  for (auto& [p, n] : sent) max_sent = std::max(max_sent, n);
  for (auto& [p, n] : recv) max_recv = std::max(max_recv, n);
  EXPECT_EQ(st.bytes_moved, moved);
  EXPECT_EQ(st.bytes_cross_host, cross);
  // Same-host sources come first, so only what no copy on the receiver's host holds crosses.
  EXPECT_EQ(st.bytes_cross_host, st.min_cross_host_bytes);
  EXPECT_EQ(st.max_send_bytes, max_sent);
  EXPECT_EQ(st.max_recv_bytes, max_recv);
  EXPECT_EQ(st.local_copy_bytes, local);
  EXPECT_EQ(st.kept_bytes, kept);
  EXPECT_EQ(st.messages, int64_t(plan.messages().size()));
  int64_t total = 0;
  for (int j = 0; j < to.world(); ++j) total += to.numel(j) * 4;
  EXPECT_EQ(st.total_bytes, total);
  EXPECT_EQ(written + kept, total);
}

Transition reversed(const Transition& t) {
  return {t.new_ids, t.old_ids, t.new_hosts, t.old_hosts};
}

// One A -> B -> A round trip with every check.
void check_round_trip(const StateUniverse& u, const ModelConfig& config, const Plan& a,
                      const Plan& b, const Transition& t) {
  SCOPED_TRACE("A: " + a.describe() + "  ->  B: " + b.describe());
  const auto A = layout::StateLayout::build(config, a);
  const auto B = layout::StateLayout::build(config, b);
  const auto ab = TransferPlan::build(A, B, t.old_hosts, t.new_hosts, t.old_ids, t.new_ids);
  const Transition back = reversed(t);
  const auto ba =
      TransferPlan::build(B, A, back.old_hosts, back.new_hosts, back.old_ids, back.new_ids);
  for (bool ids : {false, true}) {
    const auto a_state = fill_all(A, u, ids);
    const auto b_fresh = fill_all(B, u, ids);
    const auto b_state = run(ab, B, a_state);
    for (int j = 0; j < B.world(); ++j) {
      ASSERT_TRUE(b_state[size_t(j)] == b_fresh[size_t(j)]) << "A->B differs on new rank " << j;
    }
    const auto a_again = run(ba, A, b_state);
    for (int i = 0; i < A.world(); ++i) {
      ASSERT_TRUE(a_again[size_t(i)] == a_state[size_t(i)]) << "A->B->A differs on rank " << i;
    }
    if (ids) {
      check_plan(ab, A, B, t, u, a_state);
      check_plan(ba, B, A, back, u, b_state);
      // In two parts, as a switch between hosts runs it: the parameters and every copy within a
      // process, then the optimizer state's messages. Together exactly the whole plan.
      auto first_part = [](const Transfer& tr) {
        return tr.kind == StateKind::param || tr.src_process == tr.dst_process;
      };
      const auto first = ab.part(first_part, true);
      const auto second = ab.part([&](const Transfer& tr) { return !first_part(tr); }, false);
      EXPECT_EQ(first.transfers().size() + second.transfers().size(), ab.transfers().size());
      EXPECT_EQ(first.stats().bytes_moved + second.stats().bytes_moved, ab.stats().bytes_moved);
      EXPECT_EQ(second.stats().local_copy_bytes, 0);
      auto b_parts = run(first, B, a_state);
      run_into(second, a_state, b_parts);
      for (int j = 0; j < B.world(); ++j) {
        ASSERT_TRUE(b_parts[size_t(j)] == b_fresh[size_t(j)])
            << "A->B in two parts differs on new rank " << j;
      }
    }
  }
}

class ReshardProperty : public ::testing::TestWithParam<const char*> {};

ModelConfig model_named(const std::string& name) {
  return name == "llama-mqa" ? llama_mqa() : ModelConfig::preset(name);
}

TEST_P(ReshardProperty, RandomPairsAreExact) {
  const ModelConfig config = model_named(GetParam());
  const StateUniverse u(config, kSeed);
  std::mt19937_64 rng(std::hash<std::string>{}(config.name) ^ 0x5eed);
  std::vector<std::vector<Plan>> plans(5);
  for (int w = 1; w <= 4; ++w) plans[size_t(w)] = valid_plans(config, w, rng);
  // Coverage of the generator itself: GQA replication and virtual stages are in the pool.
  bool replicated_kv = false, virtual_stages = false;
  for (int w = 1; w <= 4; ++w) {
    for (const Plan& p : plans[size_t(w)]) {
      replicated_kv |= config.n_kv_head % p.tp != 0;
      virtual_stages |= p.virtual_stages > 1;
    }
  }
  EXPECT_TRUE(virtual_stages);
  if (config.family == model::Family::llama) {
    EXPECT_TRUE(replicated_kv);
  }

  const int pairs = 24;
  for (int trial = 0; trial < pairs; ++trial) {
    const int wa = 1 + int(rng() % 4), wb = 1 + int(rng() % 4);
    const auto& pa = plans[size_t(wa)];
    const auto& pb = plans[size_t(wb)];
    const Plan& a = pa[rng() % pa.size()];
    const Plan& b = pb[rng() % pb.size()];
    check_round_trip(u, config, a, b, random_transition(wa, wb, rng));
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ReshardProperty,
                         ::testing::Values("gpt2-tiny", "llama-tiny", "llama-mqa"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

Transition same_processes(int wa, int wb, std::vector<int> hosts = {}) {
  Transition t;
  for (int i = 0; i < wa; ++i) t.old_ids.push_back(i);
  for (int j = 0; j < wb; ++j) t.new_ids.push_back(j);
  auto host = [&](int id) { return hosts.empty() ? 0 : hosts[size_t(id)]; };
  for (int id : t.old_ids) t.old_hosts.push_back(host(id));
  for (int id : t.new_ids) t.new_hosts.push_back(host(id));
  return t;
}

// Some old ranks lost -------------------------------------------------------------------------

// Marks old ranks `lost` as TransferPlan::kLost; their host entries become junk (ignored).
Transition with_lost(Transition t, const std::vector<int>& lost) {
  for (int r : lost) {
    t.old_ids[size_t(r)] = TransferPlan::kLost;
    t.old_hosts[size_t(r)] = 9;
  }
  return t;
}

std::vector<bool> availability(const Transition& t) {
  std::vector<bool> out;
  for (int id : t.old_ids) out.push_back(id != TransferPlan::kLost);
  return out;
}

// lost_state(from, available), checked element by element against its definition: its boxes are
// disjoint, ordered by (tensor, kind), and cover exactly the elements some unavailable rank holds
// and no available rank does.
std::vector<LostPiece> checked_lost_state(const layout::StateLayout& from,
                                          const std::vector<bool>& available,
                                          const StateUniverse& u) {
  std::vector<uint8_t> on_lost(size_t(u.total()), 0), on_available(size_t(u.total()), 0);
  for (int r = 0; r < from.world(); ++r) {
    const auto held = holdings(from, r, u);
    auto& into = available[size_t(r)] ? on_available : on_lost;
    for (size_t e = 0; e < held.size(); ++e) into[e] |= held[e];
  }
  const auto lost = lost_state(from, available);
  std::vector<int> covered(size_t(u.total()), 0);
  for (size_t i = 0; i < lost.size(); ++i) {
    const LostPiece& p = lost[i];
    EXPECT_TRUE(from.has_kind(p.kind));
    EXPECT_FALSE(p.box.empty());
    if (i > 0) {
      EXPECT_LE(std::make_pair(lost[i - 1].tensor, lost[i - 1].kind),
                std::make_pair(p.tensor, p.kind));
    }
    testing::for_each_in_box(u.spec()[size_t(p.tensor)].shape, p.box, [&](int64_t flat, int64_t) {
      ++covered[size_t(u.id(p.tensor, p.kind, flat))];
    });
  }
  int64_t wrong = 0, twice = 0;
  for (size_t e = 0; e < covered.size(); ++e) {
    wrong += (covered[e] > 0) != (on_lost[e] && !on_available[e]);
    twice += covered[e] > 1;
  }
  EXPECT_EQ(wrong, 0) << "lost_state differs from the elements only lost ranks held";
  EXPECT_EQ(twice, 0) << "lost_state reports elements twice";
  return lost;
}

// The old state with the lost ranks' buffers gone (no buffers at all).
std::vector<RankState> survivors_of(std::vector<RankState> state, const Transition& t) {
  for (size_t i = 0; i < state.size(); ++i) {
    if (t.old_ids[i] == TransferPlan::kLost) state[i] = RankState{};
  }
  return state;
}

// A -> B with the lost ranks of `t` gone: the plan never reads them, and the survivors' buffers
// alone rebuild a fresh B bit for bit; all of check_plan holds.
void check_from_survivors(const StateUniverse& u, const layout::StateLayout& A,
                          const layout::StateLayout& B, const Transition& t) {
  const auto plan = TransferPlan::build(A, B, t.old_hosts, t.new_hosts, t.old_ids, t.new_ids);
  for (int i = 0; i < A.world(); ++i) {
    if (t.old_ids[size_t(i)] != TransferPlan::kLost) continue;
    EXPECT_EQ(plan.process_of_old_rank(i), TransferPlan::kLost);
    for (const Transfer& tr : plan.transfers()) ASSERT_NE(tr.src_rank, i) << "reads lost rank";
  }
  for (int p : plan.processes()) {
    EXPECT_GE(p, 0);
    const int i = plan.old_rank_of(p);
    if (i >= 0) {
      EXPECT_NE(t.old_ids[size_t(i)], TransferPlan::kLost);
    } else {
      EXPECT_GE(plan.new_rank_of(p), 0) << "process " << p << " takes no part";
    }
  }
  for (bool ids : {false, true}) {
    const auto a_state = fill_all(A, u, ids);
    const auto b_fresh = fill_all(B, u, ids);
    const auto b_state = run(plan, B, survivors_of(a_state, t));
    for (int j = 0; j < B.world(); ++j) {
      ASSERT_TRUE(b_state[size_t(j)] == b_fresh[size_t(j)]) << "differs on new rank " << j;
    }
    if (ids) check_plan(plan, A, B, t, u, a_state);
  }
}

// Losing one dp replica loses nothing: every survivor's pp stage still has a copy.
TEST(ReshardLost, OneReplicaLostLosesNothing) {
  for (const ModelConfig& config : {ModelConfig::preset("gpt2-tiny"), llama_mqa()}) {
    const StateUniverse u(config, kSeed);
    for (const Plan& a : {make_plan(2, 1, 1), make_plan(2, 1, 2)}) {
      const auto A = layout::StateLayout::build(config, a);
      for (const Plan& b : {a, make_plan(1, 2, 1), make_plan(2, 1, 1, 1, 1), make_plan(1, 1, 2),
                            make_plan(3, 1, 1)}) {
        const auto B = layout::StateLayout::build(config, b);
        for (int lost = 0; lost < A.world(); ++lost) {
          SCOPED_TRACE(config.name + " A: " + a.describe() + " -> B: " + b.describe() +
                       ", old rank " + std::to_string(lost) + " lost");
          // The lost rank's process (same id) is alive but has no valid state: it rejoins.
          const Transition t = with_lost(same_processes(A.world(), B.world()), {lost});
          EXPECT_TRUE(checked_lost_state(A, availability(t), u).empty());
          check_from_survivors(u, A, B, t);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// ZeRO-1 dp 2: each dp rank alone holds its half of Adam's moments; losing one loses exactly
// that half (and no parameters).
TEST(ReshardLost, ZeroOneRankLostLosesItsOptimizerShard) {
  const auto config = ModelConfig::preset("gpt2-tiny");
  const StateUniverse u(config, kSeed);
  const auto A = layout::StateLayout::build(config, make_plan(2, 1, 1, 1, 1));
  const auto lost = checked_lost_state(A, {true, false}, u);
  ASSERT_FALSE(lost.empty());
  std::map<StateKind, int64_t> volume;
  for (const LostPiece& p : lost) volume[p.kind] += p.box.volume();
  EXPECT_EQ(volume.count(StateKind::param), 0u);
  int64_t optimizer_floats = 0;
  for (StateKind k : {StateKind::adam_m, StateKind::adam_v}) {
    const int64_t n = A.buffers(1)[size_t(A.buffer_id(1, 0, k))].numel;
    EXPECT_GT(n, 0);
    EXPECT_EQ(volume[k], n) << layout::state_kind_name(k);
    optimizer_floats += n;
  }

  // The summary names the count, the size and the first pieces.
  const std::string text = describe(lost, A, 2);
  EXPECT_THAT(text, ::testing::StartsWith(fmt::format("{} pieces, {:.1f} MB: ", lost.size(),
                                                      double(optimizer_floats * 4) / 1e6)));
  EXPECT_THAT(text, ::testing::HasSubstr(
                        fmt::format("{} ({}) {}", A.spec()[size_t(lost[0].tensor)].name,
                                    layout::state_kind_name(lost[0].kind), lost[0].box.str())));
  EXPECT_THAT(text, ::testing::EndsWith(fmt::format(", ... and {} more", lost.size() - 2)));
  EXPECT_EQ(describe({}, A), "nothing");
  EXPECT_THAT(describe({lost[0]}, A), ::testing::StartsWith("1 piece, "));

  // A plan that needs the moments fails, naming what was lost; one that needs only the
  // parameters builds from the survivor.
  const auto B = layout::StateLayout::build(config, make_plan(1, 1, 1));
  const std::string error = tessel::testing::error_of<ConfigError>([&] {
    TransferPlan::build(A, B, {0, 0}, {0}, {0, TransferPlan::kLost}, {0});
  });
  EXPECT_THAT(error, ::testing::HasSubstr("was lost"));
  EXPECT_THAT(error, ::testing::HasSubstr("old rank(s) 1 "));
  EXPECT_THAT(error, ::testing::HasSubstr("(adam_"));
  const auto params = layout::StateLayout::build(config, make_plan(1, 1, 1), {StateKind::param});
  const auto p = TransferPlan::build(A, params, {0, 0}, {0}, {0, TransferPlan::kLost}, {0});
  EXPECT_EQ(p.stats().kept_bytes, p.stats().total_bytes);
}

// tp 2, dp 1: each tp rank alone holds its shards, so losing one loses parameters (the
// tp-replicated tensors survive: checked_lost_state checks every element).
TEST(ReshardLost, TensorParallelRankLostLosesParameters) {
  for (const ModelConfig& config : {ModelConfig::preset("gpt2-tiny"), llama_mqa()}) {
    SCOPED_TRACE(config.name);
    const StateUniverse u(config, kSeed);
    const auto A = layout::StateLayout::build(config, make_plan(1, 2, 1));
    for (int gone = 0; gone < 2; ++gone) {
      std::vector<bool> available(2, true);
      available[size_t(gone)] = false;
      const auto lost = checked_lost_state(A, available, u);
      EXPECT_TRUE(std::any_of(lost.begin(), lost.end(),
                              [](const LostPiece& p) { return p.kind == StateKind::param; }));
      std::vector<int> ids = {0, 1};
      ids[size_t(gone)] = TransferPlan::kLost;
      const std::string error = tessel::testing::error_of<ConfigError>([&] {
        TransferPlan::build(A, A, {0, 0}, {0, 0}, ids, {0, 1});
      });
      EXPECT_THAT(error, ::testing::HasSubstr(fmt::format("old rank(s) {} ", gone)));
    }
    // Both lost: everything is gone, once.
    const auto all = checked_lost_state(A, {false, false}, u);
    int64_t floats = 0;
    for (const LostPiece& p : all) floats += p.box.volume();
    int64_t expect = 0;
    for (const auto& t : A.spec()) expect += t.numel() * int64_t(A.kinds().size());
    EXPECT_EQ(floats, expect);
  }
}

// Random (A, B, lost old ranks) over 1..4 workers: the plan builds exactly when lost_state is
// empty, and then rebuilds B from the survivors alone.
TEST(ReshardLost, RandomLossesBuildExactlyWhenNothingIsLost) {
  for (const ModelConfig& config : {ModelConfig::preset("gpt2-tiny"), llama_mqa()}) {
    SCOPED_TRACE(config.name);
    const StateUniverse u(config, kSeed);
    std::mt19937_64 rng(std::hash<std::string>{}(config.name) ^ 0x1057);
    std::vector<std::vector<Plan>> plans(5);
    for (int w = 1; w <= 4; ++w) plans[size_t(w)] = valid_plans(config, w, rng);
    // Half the old layouts replicate all state over dp (what survives losing a rank).
    std::vector<std::vector<Plan>> replicated(5);
    for (int w = 2; w <= 4; ++w) {
      for (const Plan& p : plans[size_t(w)])
        if (p.dp > 1 && p.zero_stage == 0) replicated[size_t(w)].push_back(p);
    }
    int survived = 0, failed = 0;
    for (int trial = 0; trial < 24; ++trial) {
      const bool pick_replicated = trial % 2 == 0;
      const int wa = pick_replicated ? 2 + int(rng() % 3) : 1 + int(rng() % 4);
      const int wb = 1 + int(rng() % 4);
      const auto& pa = (pick_replicated ? replicated : plans)[size_t(wa)];
      const Plan& a = pa[rng() % pa.size()];
      const Plan& b = plans[size_t(wb)][rng() % plans[size_t(wb)].size()];
      // Mostly one rank lost (what a single failure does), sometimes several.
      std::vector<int> ranks(static_cast<size_t>(wa), 0);
      std::iota(ranks.begin(), ranks.end(), 0);
      std::shuffle(ranks.begin(), ranks.end(), rng);
      ranks.resize(rng() % 3 != 0 ? size_t(1) : 1 + size_t(rng() % uint64_t(wa)));
      const Transition t = with_lost(random_transition(wa, wb, rng), ranks);
      SCOPED_TRACE("A: " + a.describe() + " -> B: " + b.describe() + ", lost old ranks " +
                   fmt::format("{}", fmt::join(ranks, ",")));
      const auto A = layout::StateLayout::build(config, a);
      const auto B = layout::StateLayout::build(config, b);
      const auto lost = checked_lost_state(A, availability(t), u);
      if (lost.empty()) {
        ++survived;
        check_from_survivors(u, A, B, t);
      } else {
        ++failed;
        const std::string error = tessel::testing::error_of<ConfigError>(
            [&] { TransferPlan::build(A, B, t.old_hosts, t.new_hosts, t.old_ids, t.new_ids); });
        EXPECT_THAT(error, ::testing::HasSubstr("was lost"));
      }
      if (HasFatalFailure()) return;
    }
    // Both outcomes occur (the generator is not degenerate).
    EXPECT_GT(survived, 0);
    EXPECT_GT(failed, 0);
  }
}

// The switches the live test of issue 4 makes, and other named cases.
TEST(Reshard, NamedTransitionsAreExact) {
  const auto gpt = ModelConfig::preset("gpt2-tiny");
  const auto llama = ModelConfig::preset("llama-tiny");
  const StateUniverse ug(gpt, kSeed), ul(llama, kSeed);
  for (const auto* u : {&ug, &ul}) {
    const ModelConfig& c = u == &ug ? gpt : llama;
    check_round_trip(*u, c, make_plan(2, 1, 1), make_plan(1, 2, 2), same_processes(2, 4));
    check_round_trip(*u, c, make_plan(1, 2, 2), make_plan(1, 1, 1), same_processes(4, 1));
    check_round_trip(*u, c, make_plan(2, 1, 1, 1, 1), make_plan(4, 1, 1, 1, 1),
                     same_processes(2, 4, {0, 0, 1, 1}));
    check_round_trip(*u, c, make_plan(1, 4, 1, 1, 1), make_plan(2, 1, 2, 2, 1, {1, 3, 2, 2}),
                     same_processes(4, 4));
  }
}

TEST(Reshard, SameLayoutMovesNothing) {
  const auto c = ModelConfig::preset("gpt2-tiny");
  const auto L = layout::StateLayout::build(c, make_plan(2, 2, 1, 1, 1));
  const auto plan = TransferPlan::build(L, L, {0, 0, 1, 1}, {0, 0, 1, 1});
  EXPECT_EQ(plan.stats().bytes_moved, 0);
  EXPECT_EQ(plan.stats().local_copy_bytes, 0);
  EXPECT_EQ(plan.stats().kept_bytes, plan.stats().total_bytes);
  EXPECT_TRUE(plan.transfers().empty());
  // Renumbered processes: rank 0 and 1 swap processes, so their state must move.
  const auto swapped =
      TransferPlan::build(L, L, {0, 0, 1, 1}, {0, 0, 1, 1}, {0, 1, 2, 3}, {1, 0, 2, 3});
  EXPECT_GT(swapped.stats().bytes_moved, 0);
}

// ZeRO-1 dp 2 -> dp 1 on the same process: parameters are kept, the Adam half it had is a
// local copy, the other half arrives; a leaving process only sends.
TEST(Reshard, ShrinkingKeepsWhatItCan) {
  const auto c = ModelConfig::preset("gpt2-tiny");
  const auto A = layout::StateLayout::build(c, make_plan(2, 1, 1, 1, 1));
  const auto B = layout::StateLayout::build(c, make_plan(1, 1, 1, 1, 1));
  const auto plan = TransferPlan::build(A, B, {0, 0}, {0});
  const int64_t n = c.num_params();
  EXPECT_EQ(plan.kept_from(0, B.buffer_id(0, 0, StateKind::param)),
            A.buffer_id(0, 0, StateKind::param));
  EXPECT_EQ(plan.stats().kept_bytes, n * 4);
  EXPECT_EQ(plan.stats().local_copy_bytes, 2 * (n / 2) * 4);
  EXPECT_EQ(plan.stats().bytes_moved, 2 * (n - n / 2) * 4);
  ASSERT_EQ(plan.messages().size(), 1u);
  EXPECT_EQ(plan.messages()[0].src_process, 1);
  EXPECT_EQ(plan.processes(), (std::vector<int>{0, 1}));
  EXPECT_EQ(plan.new_rank_of(1), -1);
}

// Sources on the receiver's host come first; among equals the least-loaded sender.
TEST(Reshard, PrefersTheSameHostThenTheLeastLoadedSender) {
  const auto c = ModelConfig::preset("gpt2-tiny");
  const auto A = layout::StateLayout::build(c, make_plan(2, 1, 1));
  const auto B = layout::StateLayout::build(c, make_plan(3, 1, 1));
  // Old processes 0 (host 0) and 1 (host 1); joining process 2 on host 1: all from process 1.
  const auto near = TransferPlan::build(A, B, {0, 1}, {0, 1, 1});
  EXPECT_EQ(near.stats().bytes_cross_host, 0);
  EXPECT_EQ(near.stats().min_cross_host_bytes, 0);
  ASSERT_EQ(near.messages().size(), 1u);
  EXPECT_EQ(near.messages()[0].src_process, 1);
  // Joining process 2 on a third host: both replicas send, balanced to within the largest piece.
  const auto far = TransferPlan::build(A, B, {0, 1}, {0, 1, 2});
  ASSERT_EQ(far.messages().size(), 2u);
  int64_t largest = 0;
  for (const StatePiece& p : B.pieces(2)) largest = std::max(largest, p.global.volume() * 4);
  const int64_t s0 = far.messages()[0].bytes(), s1 = far.messages()[1].bytes();
  EXPECT_EQ(s0 + s1, far.stats().bytes_moved);
  EXPECT_LE(std::abs(s0 - s1), largest);
  EXPECT_EQ(far.stats().bytes_cross_host, far.stats().bytes_moved);
  EXPECT_EQ(far.stats().min_cross_host_bytes, far.stats().bytes_moved);
  EXPECT_EQ(far.stats().max_send_bytes, std::max(s0, s1));
}

TEST(Reshard, RejectsMismatchedArguments) {
  const auto gpt = ModelConfig::preset("gpt2-tiny");
  const auto A = layout::StateLayout::build(gpt, make_plan(2, 1, 1));
  const auto B = layout::StateLayout::build(gpt, make_plan(1, 1, 1));
  const auto L = layout::StateLayout::build(ModelConfig::preset("llama-tiny"), make_plan(1, 1, 1));
  const auto P = layout::StateLayout::build(gpt, make_plan(1, 1, 1), {StateKind::param});
  EXPECT_THROW(TransferPlan::build(A, L, {0, 0}, {0}), ConfigError);
  EXPECT_THROW(TransferPlan::build(P, B, {0}, {0}), ConfigError);  // no Adam state to move
  EXPECT_NO_THROW(TransferPlan::build(B, P, {0}, {0}));            // dropping it is fine
  EXPECT_THROW(TransferPlan::build(A, B, {0}, {0}), ConfigError);
  EXPECT_THROW(TransferPlan::build(A, B, {0, 0}, {0}, {3, 3}, {3}), ConfigError);
  EXPECT_THROW(TransferPlan::build(A, B, {0, 0}, {0}, {-2, 2}, {2}), ConfigError);
  EXPECT_THROW(TransferPlan::build(A, B, {0, 0}, {0}, {0, 1}, {TransferPlan::kLost}),
               ConfigError);  // only old ranks can be lost
  EXPECT_THROW(TransferPlan::build(A, B, {0, 1}, {0}, {0, 1}, {1}), ConfigError);  // host moves
  EXPECT_THROW(TransferPlan::build(A, B, {0, -1}, {0}), ConfigError);
  const auto ok = TransferPlan::build(A, B, {0, 0}, {0});
  EXPECT_THROW(ok.union_rank(7), InvalidArgumentError);
  EXPECT_THROW(ok.kept_from(1, 0), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::reshard
