#include "tessel/planner/collective_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "tessel/core/check.h"

namespace tessel::planner {
namespace {

// NCCL's constants (src/graph/tuning.cc, ncclTunerConstantsDefaults, commit 5067397c), in
// microseconds, by protocol LL, LL128, Simple.
using ByProtocol = std::array<double, 3>;
constexpr ByProtocol kBaseRing = {6.6, 14.0, 8.4};
constexpr ByProtocol kBaseTree = {6.8, 14.0, 8.4};
constexpr ByProtocol kNvlinkRing = {0.6, 1.9, 3.4};
constexpr ByProtocol kNvlinkTree = {0.6, 1.25, 4.0};
constexpr ByProtocol kNetRing = {2.7, 4.0, 14.0};
constexpr ByProtocol kNetTree = {5.0, 8.5, 14.0};
// The tree all-reduce's bandwidth correction by floor(log2(bytes / 64)), 0..23
// (treeCorrectionFactor): trees fall short of the model for medium sizes.
constexpr std::array<std::array<double, 24>, 3> kTreeCorrection = {{
    {1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7,  .7,  .7,  .6,  .5,
     .4,  .4,  .5,  .6,  .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0},
    {1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7,  .6,  .6,
     .6,  .6,  .6,  .6,  .8,  .9, .9, .9, .9, 1.0, 1.0, 1.0},
    {.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5,
     .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9},
}};
// A DGX's 8 rails at 2 channels each: only decides whether a ring all-reduce across hosts is on
// its Simple plateau (NCCL adds 40% to that latency once each channel's share per rank reaches 64
// bytes), which any message above a few KiB is.
constexpr double kChannels = 16;
constexpr const char* kProtocol[3] = {"LL", "LL128", "Simple"};

}  // namespace

CollectiveTime nccl_collective(Collective c, double bytes, int ranks, int hosts,
                               double bus_bandwidth, const NcclModel& model) {
  TESSEL_CHECK(model.defined(), InvalidArgumentError, "nccl_collective: an undefined model");
  TESSEL_CHECK(ranks >= 1 && hosts >= 1 && ranks % hosts == 0, InvalidArgumentError,
               "nccl_collective: {} ranks do not spread evenly over {} hosts", ranks, hosts);
  TESSEL_CHECK(bus_bandwidth > 0, InvalidArgumentError,
               "nccl_collective: bus bandwidth {} is not positive", bus_bandwidth);
  CollectiveTime best{std::numeric_limits<double>::infinity(), "", ""};
  if (ranks == 1 || bytes <= 0) return {0, "none", "none"};
  const bool all_reduce = c == Collective::all_reduce;
  const int per_host = ranks / hosts;
  const int steps = all_reduce ? 2 * (ranks - 1) : ranks - 1;
  const int net_steps = hosts == 1 ? 0 : all_reduce ? 2 * (hosts - 1) : hosts - 1;
  const double ll_max = hosts == 1   ? model.ll_max_one_host
                        : hosts == 2 ? model.ll_max_2_hosts
                                     : model.ll_max_more_hosts;
  const double us = 1e-6;
  auto consider = [&](double latency_us, double seconds_of_bytes, const char* algorithm, int p) {
    const double t = latency_us * us + seconds_of_bytes;
    if (t < best.seconds) best = {t, algorithm, kProtocol[p]};
  };
  for (int p = 0; p < 3; ++p) {
    // With one rank per host every network hop's latency is exposed: NCCL charges the tree's.
    const double net_hop = per_host == 1 ? kNetTree[size_t(p)] : kNetRing[size_t(p)];

    // Ring: steps hops, the network ones at the network's latency; within a host a hop still pays
    // the network's posting overhead when the ring leaves the host.
    double ring_bw = bus_bandwidth * (p == 0 ? 0.5 : p == 1 ? 0.92 : 1.0);
    if (p == 0) ring_bw = std::min(ring_bw, ll_max);
    double hop = kNvlinkRing[size_t(p)];
    if (hosts > 1) hop = std::max(hop, model.net_overhead_s / us * (p == 2 ? 3 : 1));
    double ring_lat = kBaseRing[size_t(p)] + (steps - net_steps) * hop + net_steps * net_hop;
    if (p == 2 && all_reduce && hosts > 1 && bytes / (kChannels * ranks) >= 64) ring_lat *= 1.4;
    consider(ring_lat, double(steps) / ranks * bytes / ring_bw, "ring", p);

    // Tree (all-reduce only): up and down a chain within each host and a binary tree across.
    if (!all_reduce) continue;
    double tree_bw = bus_bandwidth * 0.92;
    if (p == 0) tree_bw = std::min(tree_bw / 3.8, ll_max);
    if (p == 1) tree_bw *= hosts == 1 ? 7.0 / 9.0 : 120.0 / 128.0;
    const double chunks = std::floor(bytes / 64);
    if (chunks >= 1) {
      const int log_size = int(std::floor(std::log2(chunks)));
      if (log_size < 23) tree_bw *= kTreeCorrection[size_t(p)][size_t(log_size)];
    }
    const double tree_lat = kBaseTree[size_t(p)] + 2 * ((per_host - 1) * kNvlinkTree[size_t(p)] +
                                                        std::floor(std::log2(hosts)) * net_hop);
    consider(tree_lat, 2 * bytes / tree_bw, "tree", p);
  }
  best.seconds += model.launch_s;
  return best;
}

double nccl_bus_bandwidth(double bytes, int ranks, int hosts, double bus_bandwidth,
                          const NcclModel& model) {
  TESSEL_CHECK(bytes > 0 && ranks >= 2, InvalidArgumentError,
               "nccl_bus_bandwidth: {} bytes over {} ranks has no bus bandwidth", bytes, ranks);
  const double t =
      nccl_collective(Collective::all_reduce, bytes, ranks, hosts, bus_bandwidth, model).seconds;
  return 2.0 * (ranks - 1) / ranks * bytes / t;
}

}  // namespace tessel::planner
