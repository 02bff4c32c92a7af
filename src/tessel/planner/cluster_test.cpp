#include "tessel/planner/cluster.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessel/core/error.h"
#include "tessel/planner/cost_model.h"
#include "tessel/testing/testing.h"

namespace tessel::planner {
namespace {

constexpr double GiB = 1024.0 * 1024.0 * 1024.0;

using tessel::testing::error_of;

TEST(Cluster, PresetsDescribeDgxHosts) {
  const auto a = ClusterSpec::preset("dgx-a100");
  EXPECT_EQ(a.hosts, 1);
  EXPECT_EQ(a.devices_per_host, 8);
  EXPECT_DOUBLE_EQ(a.device.peak(Precision::bf16), 312e12);
  EXPECT_DOUBLE_EQ(a.device.peak(Precision::fp32), 19.5e12);
  EXPECT_EQ(a.device.memory_bytes, int64_t(80 * GiB));
  EXPECT_DOUBLE_EQ(a.intra_host.bandwidth, 300e9);  // 600 GB/s NVLink, both directions
  EXPECT_DOUBLE_EQ(a.inter_host.bandwidth, 25e9);   // 200 Gb/s per GPU
  const auto h = ClusterSpec::preset("dgx-h100");
  EXPECT_DOUBLE_EQ(h.device.peak(Precision::bf16), 989e12);
  EXPECT_DOUBLE_EQ(h.intra_host.bandwidth, 450e9);
  EXPECT_DOUBLE_EQ(h.inter_host.bandwidth, 50e9);
  EXPECT_NO_THROW(a.validate());
  EXPECT_NO_THROW(h.validate());
  auto msg = error_of<ConfigError>([] { ClusterSpec::preset("dgx-b200"); });
  EXPECT_NE(msg.find("dgx-a100"), std::string::npos) << msg;
}

TEST(Cluster, GpusSetsTheHostCount) {
  const auto a = ClusterSpec::preset("dgx-a100");
  const auto big = a.with_devices(1024);
  EXPECT_EQ(big.hosts, 128);
  EXPECT_EQ(big.devices_per_host, 8);
  EXPECT_EQ(big.num_devices(), 1024);
  EXPECT_EQ(big.host_of(17), 2);
  const auto small = a.with_devices(4);
  EXPECT_EQ(small.hosts, 1);
  EXPECT_EQ(small.devices_per_host, 4);
  auto msg = error_of<ConfigError>([&] { a.with_devices(12); });
  EXPECT_NE(msg.find("multiple of 8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("16"), std::string::npos) << msg;
  EXPECT_THROW(a.with_devices(0), ConfigError);
}

TEST(Cluster, EfficiencyCurveRisesAndSaturates) {
  EfficiencyCurve c{0.8, 10e-6};
  const double peak = 100e12;
  // Half of the saturated efficiency at f = peak * half_time.
  EXPECT_DOUBLE_EQ(c.efficiency(peak * 10e-6, peak), 0.4);
  EXPECT_LT(c.efficiency(1e9, peak), c.efficiency(1e11, peak));
  EXPECT_NEAR(c.efficiency(1e15, peak), 0.8, 1e-3);
  // Time = FLOPs at the achieved rate.
  const double f = 3e9;
  EXPECT_NEAR(c.gemm_time(f, peak), f / (peak * c.efficiency(f, peak)), 1e-15);
  EXPECT_EQ(c.gemm_time(0, peak), 0);
}

TEST(Cluster, YamlWithAllFields) {
  const auto c = ClusterSpec::from_yaml(R"(
name: lab
hosts: 2
devices_per_host: 4
device:
  name: L40S
  memory_gib: 48
  reserved_gib: 1.5
  memory_bandwidth_GBps: 864
  peak_tflops: {fp32: 91.6, bf16: 362}
  gemm_efficiency: 0.6
  gemm_half_time_us: 20
intra_host: {bandwidth_GBps: 32, latency_us: 8}
inter_host: {bandwidth_GBps: 12.5, latency_us: 12, collective_bandwidth_GBps: 10, collective_latency_us: 40}
)");
  EXPECT_EQ(c.name, "lab");
  EXPECT_EQ(c.num_devices(), 8);
  EXPECT_EQ(c.device.name, "L40S");
  EXPECT_EQ(c.device.memory_bytes, int64_t(48 * GiB));
  EXPECT_EQ(c.device.reserved_bytes, int64_t(1.5 * GiB));
  EXPECT_DOUBLE_EQ(c.device.memory_bandwidth, 864e9);
  EXPECT_DOUBLE_EQ(c.device.peak(Precision::fp32), 91.6e12);
  EXPECT_DOUBLE_EQ(c.device.peak(Precision::bf16), 362e12);
  EXPECT_EQ(c.device.peak(Precision::fp16), 0);
  EXPECT_DOUBLE_EQ(c.device.gemm.max_efficiency, 0.6);
  EXPECT_DOUBLE_EQ(c.device.gemm.half_time_s, 20e-6);
  EXPECT_DOUBLE_EQ(c.intra_host.bandwidth, 32e9);
  EXPECT_DOUBLE_EQ(c.intra_host.coll_bandwidth(), 32e9);  // defaults to point-to-point
  EXPECT_DOUBLE_EQ(c.intra_host.coll_latency(), 8e-6);
  EXPECT_DOUBLE_EQ(c.inter_host.coll_bandwidth(), 10e9);
  EXPECT_DOUBLE_EQ(c.inter_host.coll_latency(), 40e-6);
}

TEST(Cluster, YamlPresetWithOverrides) {
  const auto c = ClusterSpec::from_yaml("preset: dgx-h100\nhosts: 4\ndevice: {memory_gib: 94}\n");
  EXPECT_EQ(c.num_devices(), 32);
  EXPECT_EQ(c.device.memory_bytes, int64_t(94 * GiB));
  EXPECT_DOUBLE_EQ(c.device.peak(Precision::bf16), 989e12);  // kept from the preset
}

// Collectives on the presets' NVLink follow nccl-tests' measured all-reduce bus bandwidth by
// message size, interpolated log-log; a YAML that describes the link by its rates drops the
// curve, and so does one naming another device for the GEMM model.
TEST(Cluster, NvlinkCollectivesFollowTheMeasuredCurve) {
  const auto a100 = ClusterSpec::preset("dgx-a100");
  const BusCurve& curve = a100.intra_host.bus_curve;
  ASSERT_EQ(curve.size(), 17u);
  EXPECT_TRUE(a100.inter_host.bus_curve.empty());
  constexpr double kMiB = 1024 * 1024;
  EXPECT_DOUBLE_EQ(bus_bandwidth(curve, 16 * kMiB), 109.22e9);  // a measured point
  // Halfway between 1 and 2 MiB in log size: the geometric mean of their rates (two logs and an
  // exp, each within an ulp or two: far inside 1e-12).
  EXPECT_NEAR(bus_bandwidth(curve, std::sqrt(2.0) * kMiB), std::sqrt(36.22e9 * 53.54e9),
              1e-12 * 44e9);
  EXPECT_DOUBLE_EQ(bus_bandwidth(curve, 1.0), 0.04e9);                 // below: the first point's
  EXPECT_DOUBLE_EQ(bus_bandwidth(curve, 64 * 1024 * kMiB), 231.58e9);  // above: the last's
  EXPECT_THROW(bus_bandwidth({}, 1.0), InvalidArgumentError);
  // An all-reduce of 16 MiB over 8 GPUs: 2 x 7/8 of it over 109.22 GB/s, no separate latency.
  const GroupLink link{a100.intra_host.coll_bandwidth(), a100.intra_host.coll_latency(), false,
                       curve};
  EXPECT_DOUBLE_EQ(CostModel::all_reduce_time(16 * kMiB, 8, link),
                   2.0 * 7 / 8 * 16 * kMiB / 109.22e9);
  EXPECT_TRUE(ClusterSpec::from_yaml("preset: dgx-a100\nintra_host: {bandwidth_GBps: 100}\n")
                  .intra_host.bus_curve.empty());
  EXPECT_EQ(ClusterSpec::from_yaml("preset: dgx-a100\nhosts: 2\n").intra_host.bus_curve.size(),
            17u);
  // Likewise the InfiniBand's model (collective_model.h).
  EXPECT_TRUE(ClusterSpec::from_yaml("preset: dgx-a100\nhosts: 2\n").inter_host.nccl.defined());
  EXPECT_FALSE(
      ClusterSpec::from_yaml("preset: dgx-a100\nhosts: 2\ninter_host: {bandwidth_GBps: 12}\n")
          .inter_host.nccl.defined());
  EXPECT_TRUE(ClusterSpec::preset("dgx-a100").device.shape.defined());
  EXPECT_FALSE(ClusterSpec::from_yaml("preset: dgx-a100\ndevice: {gemm_efficiency: 0.6}\n")
                   .device.shape.defined());
}

TEST(Cluster, YamlIsStrict) {
  auto msg = error_of<ConfigError>(
      [] { ClusterSpec::from_yaml("preset: dgx-a100\ndevice: {memroy_gib: 40}\n", "c.yaml"); });
  EXPECT_NE(msg.find("c.yaml"), std::string::npos) << msg;
  EXPECT_NE(msg.find("device.memroy_gib"), std::string::npos) << msg;
  EXPECT_NE(msg.find("memory_gib"), std::string::npos) << msg;  // the allowed keys
  msg = error_of<ConfigError>([] { ClusterSpec::from_yaml("preset: dgx-a100\nhost: 2\n"); });
  EXPECT_NE(msg.find("'host'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hosts"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { ClusterSpec::from_yaml("hosts: [1, 2\n", "c.yaml"); });
  EXPECT_NE(msg.find("malformed YAML"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] { ClusterSpec::from_yaml("preset: dgx-a100\nhosts: many\n"); });
  EXPECT_NE(msg.find("hosts"), std::string::npos) << msg;
  msg = error_of<ConfigError>(
      [] { ClusterSpec::from_yaml("devices_per_host: 2\ndevice: {memory_gib: 16}\n"); });
  EXPECT_NE(msg.find("peak_tflops"), std::string::npos) << msg;
  msg = error_of<ConfigError>([] {
    ClusterSpec::from_yaml(
        "devices_per_host: 2\ndevice: {memory_gib: 16, peak_tflops: {fp32: 1}}\n");
  });
  EXPECT_NE(msg.find("intra_host.bandwidth_GBps"), std::string::npos) << msg;
  EXPECT_THROW(ClusterSpec::from_yaml("preset: dgx-a100\ndevice: {peak_tflops: {fp32: -1}}\n"),
               ConfigError);
}

TEST(Cluster, ResolvesPresetsAndFiles) {
  EXPECT_EQ(ClusterSpec::resolve("dgx-h100").name, "dgx-h100");
  testing::TempDir dir;
  std::ofstream(dir / "mine.yaml") << "preset: dgx-a100\nname: mine\nhosts: 3\n";
  const auto c = ClusterSpec::resolve((dir / "mine.yaml").string());
  EXPECT_EQ(c.name, "mine");
  EXPECT_EQ(c.num_devices(), 24);
  auto msg = error_of<ConfigError>([&] { ClusterSpec::resolve((dir / "nope.yaml").string()); });
  EXPECT_NE(msg.find("nope.yaml"), std::string::npos) << msg;
}

nlohmann::json profile_doc() {
  return nlohmann::json::parse(R"({
    "workers": 4,
    "memory_bytes": 17179869184,
    "memory_bandwidth_bytes_per_s": 2e10,
    "flops": {"fp32": 3e11},
    "p2p": {"bandwidth_bytes_per_s": 4e9, "latency_s": 3e-5},
    "all_reduce": {"bus_bandwidth_bytes_per_s": 1.5e9, "latency_s": 8e-5},
    "something_else": [1, 2, 3]
  })");
}

TEST(Cluster, FromProfile) {
  const auto c = from_profile_json(profile_doc());
  EXPECT_EQ(c.name, "this-machine");
  EXPECT_EQ(c.hosts, 1);
  EXPECT_EQ(c.devices_per_host, 4);
  EXPECT_EQ(c.device.memory_bytes, int64_t(16 * GiB));
  EXPECT_DOUBLE_EQ(c.device.peak(Precision::fp32), 3e11);
  EXPECT_EQ(c.device.peak(Precision::bf16), 0);
  EXPECT_DOUBLE_EQ(c.device.gemm.max_efficiency, 1.0);  // measured rates are achieved rates
  EXPECT_DOUBLE_EQ(c.intra_host.bandwidth, 4e9);
  EXPECT_DOUBLE_EQ(c.intra_host.latency, 3e-5);
  EXPECT_DOUBLE_EQ(c.intra_host.coll_bandwidth(), 1.5e9);
  EXPECT_DOUBLE_EQ(c.intra_host.coll_latency(), 8e-5);

  auto doc = profile_doc();
  doc["p2p"].erase("latency_s");
  auto msg = error_of<CorruptDataError>([&] { from_profile_json(doc); });
  EXPECT_NE(msg.find("latency_s"), std::string::npos) << msg;
  doc = profile_doc();
  doc["flops"]["fp32"] = "fast";
  msg = error_of<CorruptDataError>([&] { from_profile_json(doc); });
  EXPECT_NE(msg.find("flops.fp32"), std::string::npos) << msg;
  doc = profile_doc();
  doc["workers"] = 2.5;
  EXPECT_THROW(from_profile_json(doc), CorruptDataError);
}

TEST(Cluster, Precision) {
  EXPECT_EQ(parse_precision("bf16"), Precision::bf16);
  EXPECT_EQ(element_bytes(Precision::fp32), 4);
  EXPECT_EQ(element_bytes(Precision::fp16), 2);
  auto msg = error_of<ConfigError>([] { parse_precision("fp8"); });
  EXPECT_NE(msg.find("fp32, bf16, fp16"), std::string::npos) << msg;
}

}  // namespace
}  // namespace tessel::planner
