// A collective's time across hosts by message size and group size (issue 20, point 6): NCCL's
// own performance model, the one it uses to choose an algorithm and a protocol for each call
// (NVIDIA/nccl, src/graph/tuning.cc, ncclTopoTuneModel and ncclTopoGetAlgoTime, commit
// 5067397c), with the plateau it reaches measured.
//
// For each algorithm (ring; tree for an all-reduce across hosts) and protocol (LL, LL128,
// Simple) NCCL predicts
//   time = latency + wire bytes / bus bandwidth,
//   latency   = a base per algorithm and protocol, plus one hop latency per step: a ring
//               all-reduce takes 2 (n - 1) steps of which 2 (hosts - 1) cross the network, a tree
//               2 ((n/hosts - 1) hops within a host + log2(hosts) across); a network hop costs
//               the tree's network latency when each host holds one rank ("fully exposed");
//   bandwidth = the link's Simple bus bandwidth, x 0.5 for LL (capped), x 0.92 for LL128, x 0.92
//               for a tree (x 1/3.8 in LL, x 120/128 in LL128), and the tree's measured correction
//               by size for mid-sized messages;
// and takes the fastest. Small messages run on LL at a few microseconds per hop, large ones on
// Simple at the link's rate, and a group spread over many hosts pays a ring's linear or a tree's
// logarithmic latency: no one latency-plus-bandwidth line follows that.
//
// What NCCL's model leaves out, and is measured instead (cluster.cpp cites each):
//   bus_bandwidth  the Simple plateau of the group's links: per 200 Gb/s HDR rail 24 GB/s, as
//                  NVIDIA measures on DGX A100 (192 GB/s all-reduce busbw over 8 rails);
//   launch_s       the per-call time nccl-tests measures beyond the modelled latency (kernel
//                  launch, the host's share): its small-message times on 8 GPUs minus the model's
//                  for them.
// Checked (collective_model_test.cpp) against nccl-tests on one 8-GPU A100 host (Azure's
// ND A100 v4, every size from 1 KiB to 8 GiB within 35%) and on three 8-GPU A100 hosts with four
// HDR rails each (the average and peak busbw an nccl-tests run reported, within 15%).
#pragma once

namespace tessel::planner {

enum class Collective { all_reduce, reduce_scatter, all_gather };

struct NcclModel {
  double launch_s = 0;  // per call; 0: no model (the link's latency + bandwidth apply)
  // Extra per network step (NCCL's getNetOverhead): 1 us on Intel hosts, 2 us on AMD.
  double net_overhead_s = 1e-6;
  // LL's cap on bus bandwidth within one host (NCCL's llMaxBws by GPU: Ampere 87.7 GB/s, Hopper
  // 141), across 2 hosts and across more (by CPU vendor: Intel 39 and 20.4 GB/s, AMD 22.5 and 19).
  double ll_max_one_host = 87.7e9;
  double ll_max_2_hosts = 39e9;
  double ll_max_more_hosts = 20.4e9;
  bool defined() const { return launch_s > 0; }
};

struct CollectiveTime {
  double seconds = 0;
  const char* algorithm = "";  // "ring" or "tree"
  const char* protocol = "";   // "LL", "LL128" or "Simple"
};

// The fastest of NCCL's choices for a collective of `bytes` (an all-reduce's buffer; a
// reduce-scatter's input, an all-gather's output) over `ranks` spread evenly over `hosts` (1: one
// host's NVLink), whose Simple protocol reaches `bus_bandwidth` (bytes/s). Throws
// InvalidArgumentError for an undefined model, ranks not a multiple of hosts, or a non-positive
// bandwidth.
CollectiveTime nccl_collective(Collective c, double bytes, int ranks, int hosts,
                               double bus_bandwidth, const NcclModel& model);

// The bus bandwidth of that all-reduce for a message of `bytes` (its wire bytes per device,
// 2 (n - 1) / n bytes, over its time): what a measured BusCurve gives at that size.
double nccl_bus_bandwidth(double bytes, int ranks, int hosts, double bus_bandwidth,
                          const NcclModel& model);

}  // namespace tessel::planner
