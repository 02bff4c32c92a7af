#include "tessel/planner/collective_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "tessel/core/error.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/cost_model.h"
#include "tessel/planner/sharding_ilp.h"

namespace tessel::planner {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// The arithmetic is a few dozen double operations per size: no rounding moves a ratio by anything
// near the bounds below, on any CPU.
double all_reduce_busbw(double bytes, int ranks, int hosts, double bandwidth, const NcclModel& m) {
  return nccl_bus_bandwidth(bytes, ranks, hosts, bandwidth, m);
}

// NCCL's model on one 8-GPU A100 host, its Simple plateau and launch taken from the measurement
// (the largest size's busbw; launch_s from the three smallest sizes, cluster.cpp), follows
// nccl-tests' all-reduce busbw at every other size within 35%: the form -- protocols switching
// from LL to LL128 to Simple, latency by hops -- is what the measurement shows. (Its largest
// miss: 8-32 MiB, where the model's LL128 runs ~30% faster than this VM measured.)
TEST(NcclModel, FollowsTheMeasuredAllReduceOnOneA100HostAtEverySize) {
  const ClusterSpec c = ClusterSpec::preset("dgx-a100");
  const BusCurve& measured = c.intra_host.bus_curve;
  ASSERT_GE(measured.size(), 10u);
  const double plateau = measured.back()[1];
  for (const auto& [bytes, busbw] : measured) {
    const double predicted = all_reduce_busbw(bytes, 8, 1, plateau, c.inter_host.nccl);
    EXPECT_LT(std::abs(std::log(predicted / busbw)), std::log(1.35))
        << bytes << " B: predicted " << predicted / 1e9 << " GB/s, measured " << busbw / 1e9;
  }
  // Small messages are LL's, large ones Simple's.
  EXPECT_STREQ(
      nccl_collective(Collective::all_reduce, 1024, 8, 1, plateau, c.inter_host.nccl).protocol,
      "LL");
  EXPECT_STREQ(
      nccl_collective(Collective::all_reduce, 8192 * kMiB, 8, 1, plateau, c.inter_host.nccl)
          .protocol,
      "Simple");
}

// Held out: three 8-GPU A100 hosts (Intel Xeon 8358) with four HDR rails each, nccl-tests
// all_reduce_perf -b 8 -e 128M with a 1 MiB step over 24 ranks (NVIDIA/nccl-tests issue 119):
// "the average performance is about 84.8GB/s and peak performance reaches about 96GB/s". The
// model on four rails at the preset's 24 GB/s each, with the A100 preset's launch and Intel's
// network constants, gives both within 15%.
TEST(NcclModel, PredictsThreeA100HostsWithFourRailsWithin15Percent) {
  NcclModel intel = ClusterSpec::preset("dgx-a100").inter_host.nccl;
  intel.net_overhead_s = 1e-6;
  intel.ll_max_2_hosts = 39e9;
  intel.ll_max_more_hosts = 20.4e9;
  const double rails = 4 * ClusterSpec::preset("dgx-a100").inter_host.coll_bandwidth();
  double sum = 0, peak = 0;
  int rows = 0;
  for (double bytes = 8; bytes <= 128 * kMiB; bytes += kMiB, ++rows) {
    const double b = all_reduce_busbw(bytes, 24, 3, rails, intel);
    sum += b;
    peak = std::max(peak, b);
  }
  EXPECT_EQ(rows, 128);
  EXPECT_LT(std::abs(std::log(sum / rows / 84.8e9)), std::log(1.15)) << sum / rows / 1e9;
  EXPECT_LT(std::abs(std::log(peak / 96e9)), std::log(1.15)) << peak / 1e9;
}

// Group size: with one rank a host every network hop's latency shows, so a small all-reduce over
// many hosts costs more than over two -- logarithmically, on a tree, not linearly as a ring would
// -- and a large one still reaches the rail's plateau.
TEST(NcclModel, ASmallAllReduceOverManyHostsTakesATreeAndALargeOneTheRailsPlateau) {
  const ClusterSpec c = ClusterSpec::preset("dgx-a100");
  const NcclModel& m = c.inter_host.nccl;
  const double rail = c.inter_host.coll_bandwidth();
  const auto two = nccl_collective(Collective::all_reduce, 4096, 2, 2, rail, m);
  const auto many = nccl_collective(Collective::all_reduce, 4096, 128, 128, rail, m);
  EXPECT_STREQ(many.algorithm, "tree");
  EXPECT_GT(many.seconds, two.seconds);
  // A ring would take 2 x 127 network hops at >= 2.7 us each: over 680 us.
  EXPECT_LT(many.seconds, 300e-6);
  const auto large = nccl_collective(Collective::all_reduce, 1024 * kMiB, 16, 16, rail, m);
  EXPECT_STREQ(large.protocol, "Simple");
  const double busbw = 2.0 * 15 / 16 * 1024 * kMiB / large.seconds;
  EXPECT_GT(busbw, 0.97 * rail);
  EXPECT_LE(busbw, rail);
  // A reduce-scatter moves half an all-reduce's bytes on a ring: between half and the whole time.
  const auto rs = nccl_collective(Collective::reduce_scatter, 1024 * kMiB, 16, 16, rail, m);
  EXPECT_STREQ(rs.algorithm, "ring");
  EXPECT_GT(rs.seconds, 0.45 * large.seconds);
  EXPECT_LT(rs.seconds, 0.55 * large.seconds);
}

// The cost model prices a data-parallel all-reduce across hosts by the model: the group's size
// and its message matter, which a latency + bandwidth line got wrong at both ends.
TEST(NcclModel, TheCostModelsDataParallelSyncAcrossHostsUsesIt) {
  const ClusterSpec c = ClusterSpec::preset("dgx-a100").with_devices(8 * 64);
  const GroupLink two = GroupLink::across(c.inter_host, c.inter_host.coll_bandwidth(), 2, 1);
  const GroupLink many = GroupLink::across(c.inter_host, c.inter_host.coll_bandwidth(), 64, 1);
  EXPECT_EQ(many.hosts, 64);
  EXPECT_GT(CostModel::all_reduce_time(64 * 1024, 64, many),
            1.5 * CostModel::all_reduce_time(64 * 1024, 2, two));
  EXPECT_DOUBLE_EQ(CostModel::all_reduce_time(64 * 1024, 64, many),
                   nccl_collective(Collective::all_reduce, 64 * 1024, 64, 64,
                                   c.inter_host.coll_bandwidth(), c.inter_host.nccl)
                       .seconds);
  // A link described by its rates in YAML has no model: latency + bytes / bandwidth again.
  const GroupLink plain{1e10, 1e-5, true, {}};
  EXPECT_DOUBLE_EQ(CostModel::all_reduce_time(1e6, 2, plain), 1e6 / 1e10 + 1e-5);
}

// The sharding programme's collectives on a mesh axis that leaves the host: the model's bus
// bandwidth for the message, as a measured curve's would be.
TEST(NcclModel, AShardingAxisAcrossHostsIsPricedByIt) {
  const ClusterSpec c = ClusterSpec::preset("dgx-h100");
  ShardingCosts across;
  across.bandwidth = c.inter_host.coll_bandwidth();
  across.nccl = c.inter_host.nccl;
  across.ranks = 4;
  across.hosts = 4;
  const double message = 2 * kMiB;
  EXPECT_DOUBLE_EQ(collective(across, 3 * kMiB, message),
                   3 * kMiB / nccl_bus_bandwidth(message, 4, 4, across.bandwidth, across.nccl));
  across.hosts = 1;  // within a host: the link's latency + bandwidth
  EXPECT_DOUBLE_EQ(collective(across, 3 * kMiB, message),
                   across.latency_s + 3 * kMiB / across.bandwidth);
}

TEST(NcclModel, RefusesAnUndefinedModelAndAnUnevenGroup) {
  const NcclModel m = ClusterSpec::preset("dgx-h100").inter_host.nccl;
  EXPECT_THROW(nccl_collective(Collective::all_reduce, 1e6, 8, 2, 1e10, NcclModel{}),
               InvalidArgumentError);
  EXPECT_THROW(nccl_collective(Collective::all_reduce, 1e6, 6, 4, 1e10, m), InvalidArgumentError);
  EXPECT_THROW(nccl_collective(Collective::all_reduce, 1e6, 8, 2, 0, m), InvalidArgumentError);
  EXPECT_EQ(nccl_collective(Collective::all_gather, 1e6, 1, 1, 1e10, m).seconds, 0);
}

}  // namespace
}  // namespace tessel::planner
