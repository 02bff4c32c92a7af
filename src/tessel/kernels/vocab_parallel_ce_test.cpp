#include "tessel/kernels/vocab_parallel_ce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/cross_entropy.h"
#include "tessel/kernels/cross_entropy_test_data.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using test_data::kIgnore;
using test_data::make_logits;
constexpr double u = testing::kUnitRoundoff;
using testing::random_normal;

// The shared targets, with one of them the last real class, so that the shard holding the
// vocabulary's end owns a target.
std::vector<int32_t> make_targets(int N, int V, uint64_t seed) {
  auto t = test_data::make_targets(N, V, seed);
  t[0] = V - 1;
  return t;
}

struct Dims {
  int N, V, Vp;
};

// The kernels of one namespace, so that a test runs the same steps for ref:: and cpu::.
struct VpKernels {
  decltype(&ref::vp_ce_local_max) local_max;
  decltype(&ref::vp_ce_local_sums) local_sums;
  decltype(&ref::vp_ce_finish) finish;
};
constexpr VpKernels kRef = {&ref::vp_ce_local_max, &ref::vp_ce_local_sums, &ref::vp_ce_finish};
constexpr VpKernels kCpu = {&cpu::vp_ce_local_max, &cpu::vp_ce_local_sums, &cpu::vp_ce_finish};

struct ShardedResult {
  std::vector<CrossEntropyResult> results;  // per rank
  std::vector<std::vector<float>> losses;   // per rank
  std::vector<float> dlogits;               // [N, Vp], the shards' dlogits put back together
  std::vector<std::vector<float>> row_max;  // per rank, before the reduction
};

// Runs the three steps on tp column shards of the [N, Vp] logits, doing the all-reduces by hand
// in rank order (as LocalTpGroup does), and reassembles the shards' dlogits.
ShardedResult run_sharded(const VpKernels& k, const std::vector<float>& logits,
                          const std::vector<int32_t>& targets, Dims d, int tp, float grad_scale,
                          bool in_place = false) {
  const int N = d.N, rows = d.Vp / tp;
  std::vector<std::vector<float>> shard(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    shard[size_t(r)].resize(size_t(N) * rows);
    for (int n = 0; n < N; ++n) {
      for (int v = 0; v < rows; ++v) {
        shard[size_t(r)][size_t(n) * rows + v] = logits[size_t(n) * d.Vp + size_t(r) * rows + v];
      }
    }
  }
  ShardedResult out;
  out.row_max.assign(size_t(tp), std::vector<float>(size_t(N)));
  for (int r = 0; r < tp; ++r) {
    k.local_max(out.row_max[size_t(r)].data(), shard[size_t(r)].data(), targets.data(), N, d.V,
                r * rows, rows, kIgnore);
  }
  std::vector<float> gmax = out.row_max[0];
  for (int r = 1; r < tp; ++r) {
    for (int n = 0; n < N; ++n)
      gmax[size_t(n)] = std::fmax(gmax[size_t(n)], out.row_max[size_t(r)][size_t(n)]);
  }
  std::vector<std::vector<float>> sums(size_t(tp), std::vector<float>(2 * size_t(N)));
  for (int r = 0; r < tp; ++r) {
    k.local_sums(sums[size_t(r)].data(), shard[size_t(r)].data(), gmax.data(), targets.data(), N,
                 d.V, r * rows, rows, kIgnore);
  }
  std::vector<float> gsums = sums[0];
  for (int r = 1; r < tp; ++r) {
    for (size_t i = 0; i < gsums.size(); ++i) gsums[i] += sums[size_t(r)][i];
  }
  out.dlogits.assign(size_t(N) * d.Vp, -9.0f);
  out.losses.assign(size_t(tp), std::vector<float>(size_t(N), -9.0f));
  for (int r = 0; r < tp; ++r) {
    std::vector<float> dl(size_t(N) * rows, 7.0f);  // garbage: dlogits is overwritten
    float* dst = in_place ? shard[size_t(r)].data() : dl.data();
    out.results.push_back(k.finish(dst, out.losses[size_t(r)].data(), shard[size_t(r)].data(),
                                   gmax.data(), gsums.data(), targets.data(), N, d.V, r * rows,
                                   rows, kIgnore, grad_scale));
    for (int n = 0; n < N; ++n) {
      for (int v = 0; v < rows; ++v) {
        out.dlogits[size_t(n) * d.Vp + size_t(r) * rows + v] = dst[size_t(n) * rows + v];
      }
    }
  }
  return out;
}

// tp shards of one problem reproduce the unsharded reference cross-entropy: the same loss on every
// rank, and shard dlogits that put together equal the full dlogits. Vp = 384 splits 1..4 ways;
// with V = 257 the last shard at tp = 4 is padding only and at tp = 3 holds one real column.
TEST(VocabParallelCe, ShardsReproduceUnshardedCrossEntropy) {
  for (auto d : {Dims{1, 1, 12}, Dims{6, 10, 12}, Dims{9, 257, 384}, Dims{4, 1000, 1032},
                 Dims{3, 50257, 50304}}) {
    auto logits = make_logits(d.N, d.V, d.Vp, 1);
    auto targets = make_targets(d.N, d.V, 2);
    for (float grad_scale : {1.0f, 0.37f}) {
      std::vector<float> dl_ref(logits.size()), loss_ref(size_t(d.N));
      const CrossEntropyResult res_ref =
          ref::cross_entropy(dl_ref.data(), loss_ref.data(), logits.data(), targets.data(), d.N,
                             d.V, d.Vp, kIgnore, grad_scale);
      for (int tp = 1; tp <= 4; ++tp) {
        if (d.Vp % tp != 0) continue;
        for (bool use_cpu : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << (use_cpu ? "cpu" : "ref") << " N=" << d.N << " V=" << d.V
                       << " Vp=" << d.Vp << " tp=" << tp << " scale=" << grad_scale);
          ShardedResult s = run_sharded(use_cpu ? kCpu : kRef, logits, targets, d, tp, grad_scale);
          for (int r = 0; r < tp; ++r) {
            // Every rank computes the same loss from the same reduced statistics.
            EXPECT_EQ(s.results[size_t(r)].valid, res_ref.valid);
            EXPECT_EQ(s.results[size_t(r)].loss_sum, s.results[0].loss_sum);
            EXPECT_EQ(s.losses[size_t(r)], s.losses[0]);
          }
          // Each side against the exact values of the float logits
          // (testing::cross_entropy_row_bound): the sharded steps with fast_exp (cpu::) or libm
          // (ref::) and their row sums rounded to float per shard and added in float (tp
          // roundings); the unsharded reference with libm, in double.
          std::vector<double> dl_bound(dl_ref.size(), 0.0), loss_bound(size_t(d.N), 0.0);
          double sum_bound = 0, loss_magnitude = 0;
          for (int n = 0; n < d.N; ++n) {
            if (targets[size_t(n)] == kIgnore) continue;
            const float* x = logits.data() + size_t(n) * d.Vp;
            const auto sharded = testing::cross_entropy_row_bound(x, d.V, targets[size_t(n)],
                                                                  grad_scale, use_cpu, tp);
            const auto unsharded =
                testing::cross_entropy_row_bound(x, d.V, targets[size_t(n)], grad_scale, false, 0);
            for (int v = 0; v < d.V; ++v) {
              dl_bound[size_t(n) * d.Vp + v] =
                  sharded.dlogit_error[size_t(v)] + unsharded.dlogit_error[size_t(v)];
            }
            const double both = sharded.loss_error + unsharded.loss_error;
            loss_bound[size_t(n)] = both + u * (2 * std::fabs(sharded.loss) + both);
            sum_bound += both;
            loss_magnitude += std::fabs(sharded.loss) + both;
          }
          // Both add the rows' double losses in row order: gamma64(N) each.
          sum_bound += 2 * testing::gamma64(d.N) * loss_magnitude;
          EXPECT_TRUE(testing::within_bound(s.results[0].loss_sum, res_ref.loss_sum, sum_bound,
                                            "loss_sum"));
          EXPECT_TRUE(testing::within_bounds(s.losses[0], loss_ref, loss_bound, "losses"));
          EXPECT_TRUE(testing::within_bounds(s.dlogits, dl_ref, dl_bound, "dlogits"));
        }
      }
    }
  }
}

TEST(VocabParallelCe, PaddingOnlyShardAndIgnoredRows) {
  const Dims d{4, 5,
               16};  // tp = 4: shard 0 holds classes 0..3, shard 1 class 4, shards 2-3 padding
  auto logits = make_logits(d.N, d.V, d.Vp, 3);
  std::vector<int32_t> targets = {4, kIgnore, 0, 3};
  for (bool use_cpu : {false, true}) {
    SCOPED_TRACE(use_cpu ? "cpu" : "ref");
    ShardedResult s = run_sharded(use_cpu ? kCpu : kRef, logits, targets, d, 4, 1.0f);
    // Ignored rows contribute nothing anywhere.
    EXPECT_EQ(s.row_max[0][1], -INFINITY);
    EXPECT_EQ(s.row_max[1][1], -INFINITY);
    for (int n = 0; n < d.N; ++n) {
      EXPECT_EQ(s.row_max[2][size_t(n)], -INFINITY) << n;
      EXPECT_EQ(s.row_max[3][size_t(n)], -INFINITY) << n;
      for (int v = d.V; v < d.Vp; ++v) EXPECT_EQ(s.dlogits[size_t(n) * d.Vp + v], 0.0f);
    }
    for (int v = 0; v < d.Vp; ++v) EXPECT_EQ(s.dlogits[size_t(d.Vp) + v], 0.0f);
    EXPECT_EQ(s.losses[0][1], 0.0f);
    EXPECT_EQ(s.results[0].valid, 3);
    // The target held by shard 1 (class 4, its only real column) gets p - 1.
    double p4 = 0, z = 0, mx = -INFINITY;
    for (int v = 0; v < d.V; ++v) mx = std::max(mx, double(logits[size_t(v)]));
    for (int v = 0; v < d.V; ++v) z += std::exp(logits[size_t(v)] - mx);
    p4 = std::exp(logits[4] - mx) / z;
    // The steps' bound for this row (four shards: four float roundings of the sum), plus this
    // double evaluation's own error: gamma64(V + 6) of the terms' sizes.
    const auto b = testing::cross_entropy_row_bound(logits.data(), d.V, 4, 1.0f, use_cpu, 4);
    const double here = testing::gamma64(d.V + 6) * (1 + std::log(z) + std::fabs(std::log(p4)));
    EXPECT_TRUE(testing::within_bound(s.dlogits[4], p4 - 1.0, b.dlogit_error[4] + here, "dlogit"));
    EXPECT_TRUE(testing::within_bound(s.losses[0][0], -std::log(p4),
                                      b.loss_error + u * (b.loss + b.loss_error) + here, "loss"));
  }
}

TEST(VocabParallelCe, InPlaceMatchesSeparateBuffers) {
  const Dims d{9, 517, 520};
  auto logits = make_logits(d.N, d.V, d.Vp, 21);
  auto targets = make_targets(d.N, d.V, 22);
  for (bool use_cpu : {false, true}) {
    SCOPED_TRACE(use_cpu ? "cpu" : "ref");
    const VpKernels& k = use_cpu ? kCpu : kRef;
    ShardedResult separate = run_sharded(k, logits, targets, d, 2, 0.5f, false);
    ShardedResult in_place = run_sharded(k, logits, targets, d, 2, 0.5f, true);
    EXPECT_EQ(in_place.dlogits, separate.dlogits);
    EXPECT_EQ(in_place.losses, separate.losses);
    EXPECT_EQ(in_place.results[0].loss_sum, separate.results[0].loss_sum);
  }
}

TEST(VocabParallelCe, RejectsTargetsOutsideTheVocabularyBeforeAnyReduction) {
  const Dims d{2, 5, 8};
  auto logits = make_logits(d.N, d.V, d.Vp, 41);
  std::vector<float> row_max(static_cast<size_t>(d.N));
  for (int32_t bad : {5, 7, -1}) {  // 5..7 are padding columns, not classes
    std::vector<int32_t> targets = {0, bad};
    for (const VpKernels& k : {kRef, kCpu}) {
      // The second shard does not hold the bad id's column, and still rejects it.
      EXPECT_THROW(
          k.local_max(row_max.data(), logits.data(), targets.data(), d.N, d.V, 0, 4, kIgnore),
          InvalidArgumentError);
    }
  }
}

// The shards' dlogits are the gradient of grad_scale * loss_sum of the sharded computation.
TEST(VocabParallelCe, ReferenceGradientMatchesFiniteDifferences) {
  const Dims d{4, 6, 8};
  const float grad_scale = 0.25f;
  auto logits = make_logits(d.N, d.V, d.Vp, 51, 1.0f);
  auto targets = make_targets(d.N, d.V, 52);
  auto loss = [&] {
    return grad_scale * run_sharded(kRef, logits, targets, d, 2, grad_scale).results[0].loss_sum;
  };
  std::vector<float> dl = run_sharded(kRef, logits, targets, d, 2, grad_scale).dlogits;
  testing::expect_gradient_matches("dlogits", logits, dl, loss);
}

}  // namespace
}  // namespace tessel::kernels
