// ClusterSpec: the machines a plan is made for — how many hosts, how many devices on each, what one
// device computes and holds, and how fast devices talk within a host and across hosts.
//
// Units are SI throughout: FLOP/s, bytes, bytes/s, seconds. Bandwidths are per device and per
// direction: the rate one device sends at while every device of its host sends at the same time
// (so a host with 8 NICs of 25 GB/s gives each of its 8 devices 25 GB/s across hosts).
//
// Presets (`--gpus N` sets the device count; hosts = N / devices_per_host, or one host with N
// devices when N is smaller than a host):
//   dgx-a100  8 x A100 80GB per host; NVLink 600 GB/s per GPU (300 each way); 8 x 200 Gb/s HDR
//             InfiniBand per host (25 GB/s per GPU each way). Peak 19.5 TFLOP/s fp32, 312 bf16/fp16
//             (dense tensor cores), 2.04 TB/s HBM.
//   dgx-h100  8 x H100 SXM 80GB per host; NVLink 900 GB/s per GPU (450 each way); 8 x 400 Gb/s NDR
//             InfiniBand (50 GB/s per GPU each way). Peak 67 TFLOP/s fp32, 989 bf16/fp16, 3.35
//             TB/s.
//   Both: 16-bit GEMMs timed by shape (gemm_model.h) and NVLink collectives by message size
//   (BusCurve below), each from published kernel-level measurements.
//
// YAML (every key optional except where a preset does not supply it; unknown keys are errors):
//   preset: dgx-a100            # start from a preset and override what follows
//   name: my-cluster
//   hosts: 4
//   devices_per_host: 8
//   device:
//     name: A100-80GB
//     memory_gib: 80            # or memory_bytes
//     reserved_gib: 2           # or reserved_bytes: runtime context, comm buffers, fragmentation
//     memory_bandwidth_GBps: 2039
//     peak_tflops: {fp32: 19.5, bf16: 312, fp16: 312}
//     gemm_efficiency: 0.7      # fraction of peak a large GEMM reaches (see EfficiencyCurve)
//     gemm_half_time_us: 10     # a GEMM this long at peak reaches half of gemm_efficiency
//                               (either of the two: the curve, not the A100/H100 shape model)
//   intra_host: {bandwidth_GBps: 300, latency_us: 5}
//   inter_host: {bandwidth_GBps: 25, latency_us: 10,
//                collective_bandwidth_GBps: 23, collective_latency_us: 30}   # optional
//
// `collective_*` are the bus bandwidth and per-call latency of collectives (all-reduce,
// reduce-scatter, all-gather); they default to the point-to-point values.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessel/planner/collective_model.h"
#include "tessel/planner/gemm_model.h"

namespace tessel::planner {

// The arithmetic a training run computes in.
//   fp32: everything in fp32 (4-byte params, grads, activations; Adam m, v).
//   bf16 / fp16: mixed precision (16-bit params, grads and activations; fp32 master weights and
//   Adam m, v in the optimizer).
enum class Precision { fp32, bf16, fp16 };
// "fp32" / "bf16" / "fp16".
std::string_view precision_name(Precision p);
// Throws ConfigError listing the known names.
Precision parse_precision(std::string_view name);
// Bytes of one parameter, gradient or activation element in this precision.
int element_bytes(Precision p);

// Achieved GEMM speed as a function of size: a GEMM of f FLOPs on a device of peak P runs at
//   efficiency(f) = max_efficiency * f / (f + P * half_time_s),
// i.e. it rises with size and saturates at max_efficiency. Its time is then
//   f / (P * efficiency(f)) = f / (P * max_efficiency) + half_time_s / max_efficiency:
// a per-call overhead plus the FLOPs at the saturated rate.
struct EfficiencyCurve {
  double max_efficiency = 0.7;
  double half_time_s = 10e-6;

  double efficiency(double flops, double peak_flops) const;
  // Seconds for one GEMM (or batched GEMM call) of `flops` on a device of `peak_flops`.
  double gemm_time(double flops, double peak_flops) const;
};

struct DeviceSpec {
  std::string name;
  std::array<double, 3> peak_flops{};  // by Precision; 0 = not supported
  int64_t memory_bytes = 0;
  int64_t reserved_bytes = 0;   // not available to the model (context, buffers, fragmentation)
  double memory_bandwidth = 0;  // bytes/s; 0 = elementwise and optimizer time not modelled
  EfficiencyCurve gemm;
  // A GEMM's time by its shape (gemm_model.h), for the 16-bit precisions on the devices whose
  // kernels were measured (the presets' A100 and H100; a YAML device named so, unless it sets
  // gemm_efficiency or gemm_half_time_us). Undefined: the curve above, by FLOPs alone.
  GemmModel shape;

  double peak(Precision p) const { return peak_flops[size_t(p)]; }
  // What a plan trains in unless told: bf16 where the device has it, else fp32.
  Precision default_precision() const {
    return peak(Precision::bf16) > 0 ? Precision::bf16 : Precision::fp32;
  }
  int64_t usable_bytes() const { return memory_bytes - reserved_bytes; }
  // Seconds for one GEMM call: by its shape where the device has a shape model for `p` (fp32 has
  // no measurements behind it), else the curve on its FLOPs.
  double gemm_seconds(const GemmShape& s, Precision p) const;
};

// A collective's measured bus bandwidth by message size (nccl-tests' busbw: a ring all-reduce of
// S bytes over n devices moves 2 (n - 1) / n S per device, and busbw is that over the time), as
// (message bytes, bytes/s) ascending. Small messages run far below the link's rate: latency and
// the protocols NCCL switches between, which no latency-plus-bandwidth line follows.
using BusCurve = std::vector<std::array<double, 2>>;
// The curve's bus bandwidth at a message size: interpolated log-log between its points, the end
// points' beyond them.
double bus_bandwidth(const BusCurve& curve, double message_bytes);

struct LinkSpec {
  double bandwidth = 0;             // bytes/s per device per direction, point to point
  double latency = 0;               // seconds per message
  double collective_bandwidth = 0;  // bus bandwidth of collectives; 0 = bandwidth
  double collective_latency = 0;    // seconds per collective call; 0 = latency
  // Collectives by message size where measured (the presets' NVLink: nccl-tests all-reduce on
  // 8 GPUs; a YAML link that sets any of its rates drops it). Empty: latency + bytes /
  // collective bandwidth.
  BusCurve bus_curve = {};
  // Collectives across hosts by message and group size (the presets' InfiniBand: NCCL's model,
  // collective_model.h, on collective_bandwidth per rail; dropped like bus_curve). Undefined:
  // latency + bytes / collective bandwidth.
  NcclModel nccl = {};

  double coll_bandwidth() const {
    return collective_bandwidth > 0 ? collective_bandwidth : bandwidth;
  }
  double coll_latency() const { return collective_latency > 0 ? collective_latency : latency; }
};

struct ClusterSpec {
  std::string name;
  int hosts = 1;
  int devices_per_host = 1;
  // The devices a whole host of this kind has, when this cluster uses only part of one
  // (with_devices below a host); 0: devices_per_host. A cluster grows by whole hosts.
  int host_capacity = 0;
  DeviceSpec device;
  LinkSpec intra_host;
  LinkSpec inter_host;

  int num_devices() const { return hosts * devices_per_host; }
  int whole_host_devices() const { return std::max(devices_per_host, host_capacity); }
  // The host of global device index d (devices are numbered host by host).
  int host_of(int device) const { return device / devices_per_host; }

  // This cluster resized to `devices` in all: one host of `devices` when it is at most a host
  // (host_capacity keeps the host's size), else devices / devices_per_host hosts. Throws
  // ConfigError when `devices` is not positive or not a multiple of devices_per_host.
  ClusterSpec with_devices(int devices) const;

  // Throws ConfigError naming the field and the fix.
  void validate() const;

  // "dgx-a100", "dgx-h100" with one host; throws ConfigError listing the names.
  static ClusterSpec preset(std::string_view name);
  static std::vector<std::string> preset_names();

  // Parses YAML text (see the header comment); `source` names it in messages. Throws ConfigError
  // for malformed YAML, unknown keys (naming the key and the allowed ones) and bad values.
  static ClusterSpec from_yaml(const std::string& text, const std::string& source = "<yaml>");
  // Reads a YAML file; IoError when it cannot be read.
  static ClusterSpec load(const std::string& path);
  // A preset name or a YAML file path.
  static ClusterSpec resolve(const std::string& name_or_path);
};

// The cluster `this-machine` from measured numbers (`tessel profile` writes them). Schema:
//   {
//     "workers": 4,                       // devices: worker processes on this machine (1 host)
//     "name": "this-machine",             // optional
//     "memory_bytes": 68719476736,        // usable by one worker
//     "reserved_bytes": 0,                // optional
//     "memory_bandwidth_bytes_per_s": 2e10,  // optional, one worker's streaming bandwidth
//     "flops": {"fp32": 3.2e11, "bf16": 0, "fp16": 0},  // achieved GEMM FLOP/s of one worker
//                                         // on large GEMMs; fp32 required, others optional
//     "gemm_half_time_s": 2e-5,           // optional (default 10 us)
//     "p2p": {"bandwidth_bytes_per_s": 4e9, "latency_s": 3e-5},
//     "all_reduce": {"bus_bandwidth_bytes_per_s": 1.5e9, "latency_s": 8e-5},
//     "layer_times": {...}                // optional, read by compute_profile_from_json
//   }
// Because "flops" are achieved rates, the efficiency curve saturates at 1.0. Keys other than
// these are ignored (the profile carries more). Throws CorruptDataError naming a missing or
// malformed field.
ClusterSpec from_profile_json(const nlohmann::json& profile);

}  // namespace tessel::planner
