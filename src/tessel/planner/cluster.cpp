#include "tessel/planner/cluster.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tessel/core/check.h"

namespace tessel::planner {

std::string_view precision_name(Precision p) {
  switch (p) {
    case Precision::fp32:
      return "fp32";
    case Precision::bf16:
      return "bf16";
    case Precision::fp16:
      return "fp16";
  }
  return "?";
}

Precision parse_precision(std::string_view name) {
  for (auto p : {Precision::fp32, Precision::bf16, Precision::fp16}) {
    if (precision_name(p) == name) return p;
  }
  TESSEL_THROW(ConfigError, "unknown precision '{}' (known: fp32, bf16, fp16)", name);
}

int element_bytes(Precision p) {
  return p == Precision::fp32 ? 4 : 2;
}

double EfficiencyCurve::efficiency(double flops, double peak_flops) const {
  if (flops <= 0) return 0;
  return max_efficiency * flops / (flops + peak_flops * half_time_s);
}

double bus_bandwidth(const BusCurve& curve, double message) {
  TESSEL_CHECK(!curve.empty(), InvalidArgumentError, "bus_bandwidth: an empty curve");
  if (message <= curve.front()[0]) return curve.front()[1];
  if (message >= curve.back()[0]) return curve.back()[1];
  size_t hi = 1;
  while (curve[hi][0] < message) ++hi;
  const auto& a = curve[hi - 1];
  const auto& b = curve[hi];
  const double w = std::log(message / a[0]) / std::log(b[0] / a[0]);
  return std::exp(std::log(a[1]) + w * (std::log(b[1]) - std::log(a[1])));
}

double DeviceSpec::gemm_seconds(const GemmShape& s, Precision p) const {
  if (s.flops() <= 0) return 0;
  if (shape.defined() && p != Precision::fp32 && memory_bandwidth > 0)
    return shape.time(s, peak(p), memory_bandwidth, element_bytes(p));
  return gemm.gemm_time(s.flops(), peak(p));
}

double EfficiencyCurve::gemm_time(double flops, double peak_flops) const {
  if (flops <= 0) return 0;
  return flops / (peak_flops * max_efficiency) + half_time_s / max_efficiency;
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

ClusterSpec dgx(std::string name, std::string device, double fp32, double half, double hbm,
                double nvlink_each_way, double ib_each_way) {
  ClusterSpec c;
  c.name = std::move(name);
  c.hosts = 1;
  c.devices_per_host = 8;
  c.device.name = std::move(device);
  c.device.peak_flops = {fp32, half, half};
  c.device.memory_bytes = int64_t(80 * kGiB);
  c.device.reserved_bytes = int64_t(2 * kGiB);
  c.device.memory_bandwidth = hbm;
  c.device.gemm = EfficiencyCurve{0.7, 10e-6};
  c.device.shape = gemm_model_for(c.device.name);
  // NCCL's all-reduce bus bandwidth reaches ~80% of the NVLink rate and ~90% of the NIC rate;
  // latencies are NCCL's small-message figures.
  c.intra_host = LinkSpec{nvlink_each_way, 5e-6, 0.8 * nvlink_each_way, 15e-6, {}};
  c.inter_host = LinkSpec{ib_each_way, 10e-6, 0.9 * ib_each_way, 30e-6, {}};
  return c;
}

// nccl-tests all_reduce_perf on one host's 8 GPUs (-b 8 -e 8G -f 2 -g 8, float, in-place busbw),
// ND A100 v4 (A100-SXM4-80GB) and ND H100 v5: Azure/AI-benchmarking-guide, Azure_Results/
// ND_A100_v4_results.md and ND_H100_v5_results.md at commit 8fd0c6e1. GB/s by message size.
ClusterSpec with_nvlink_curve(ClusterSpec c, int which) {
  constexpr double kKiB = 1024, kMiB = kKiB * 1024;
  constexpr std::array<double, 17> sizes = {
      kKiB,       32 * kKiB,   256 * kKiB,  kMiB,        2 * kMiB,   4 * kMiB,
      8 * kMiB,   16 * kMiB,   32 * kMiB,   64 * kMiB,   128 * kMiB, 256 * kMiB,
      512 * kMiB, 1024 * kMiB, 2048 * kMiB, 4096 * kMiB, 8192 * kMiB};
  constexpr std::array<std::array<double, 17>, 2> busbw = {
      {{0.04, 1.37, 10.11, 36.22, 53.54, 71.43, 89.99, 109.22, 132.77, 166.63, 174.18, 213.87,
        221.58, 228.10, 230.22, 230.48, 231.58},
       {0.07, 1.71, 10.86, 43.70, 81.93, 128.73, 172.13, 234.45, 295.53, 361.78, 400.61, 423.38,
        438.46, 466.35, 472.36, 475.54, 478.87}}};
  for (size_t i = 0; i < sizes.size(); ++i)
    c.intra_host.bus_curve.push_back({sizes[i], busbw[size_t(which)][i] * 1e9});
  return c;
}

// Collectives across a DGX's InfiniBand by NCCL's model (collective_model.h), on what each rail
// (one NIC per GPU) is measured to reach:
//   A100, 8 x HDR 200 Gb/s: 24 GB/s per rail -- "On an Nvidia DGX-A100 system we have 8x200Gbit/s
//     IB cards and we measure 192GB/s AllReduce BusBW" (NVIDIA's NCCL team, NVIDIA/nccl issue 812,
//     quoted in issue 1576); three HGX A100 hosts with 4 HDR rails each reach 96 GB/s, 24 a rail
//     (NVIDIA/nccl-tests issue 119);
//   H100, 8 x NDR 400 Gb/s: 48 GB/s per rail -- "CX-7 NICs at NDR rate (400Gbps) should achieve up
//     to 48-49GB/s per NIC" (NVIDIA/nccl-tests issue 267); a DGX H100 reaches ~380 GB/s busbw
//     across hosts (NVIDIA's chart in nccl-tests issue 309).
// launch_s is what nccl-tests measures on the same 8 GPUs beyond NCCL's modelled latency at the
// smallest sizes (with_nvlink_curve's data: A100 at 1, 32 and 256 KiB 44.8, 41.9 and 45.4 us
// against a modelled 15.0, 15.7 and 20.2: 27 us; H100 at 1 and 32 KiB 25.6 and 33.5 us against
// 15.0 and 15.4: 14 us). A DGX A100's CPUs are AMD EPYC, a DGX H100's Intel Xeon: NCCL's network
// overhead and LL caps by vendor.
ClusterSpec with_rails(ClusterSpec c, double rail_bus_bandwidth, NcclModel model) {
  c.inter_host.collective_bandwidth = rail_bus_bandwidth;
  c.inter_host.nccl = model;
  return c;
}

ClusterSpec make_preset(std::string_view name) {
  if (name == "dgx-a100")
    return with_rails(
        with_nvlink_curve(dgx("dgx-a100", "A100-SXM4-80GB", 19.5e12, 312e12, 2.039e12, 300e9, 25e9),
                          0),
        24e9, NcclModel{27e-6, 2e-6, 87.7e9, 22.5e9, 19e9});
  if (name == "dgx-h100")
    return with_rails(
        with_nvlink_curve(dgx("dgx-h100", "H100-SXM5-80GB", 67e12, 989e12, 3.35e12, 450e9, 50e9),
                          1),
        48e9, NcclModel{14e-6, 1e-6, 141e9, 39e9, 20.4e9});
  TESSEL_THROW(ConfigError,
               "unknown cluster preset '{}' (known: dgx-a100, dgx-h100, or a YAML file)", name);
}

// Strict reading of one YAML mapping: every key read is recorded, and finish() rejects the rest.
class Section {
 public:
  Section(YAML::Node node, std::string path, const std::string& source)
      : node_(std::move(node)), path_(std::move(path)), source_(source) {
    TESSEL_CHECK(!node_ || node_.IsNull() || node_.IsMap(), ConfigError,
                 "{}: '{}' must be a mapping of keys to values (line {})", source_, path_,
                 node_.Mark().line + 1);
  }

  bool has(const char* key) {
    known_.insert(key);
    return node_ && node_.IsMap() && node_[key];
  }

  template <typename T>
  bool read(const char* key, T& out) {
    if (!has(key)) return false;
    const YAML::Node v = node_[key];
    try {
      out = v.as<T>();
    } catch (const YAML::Exception&) {
      TESSEL_THROW(ConfigError, "{}: cannot read '{}' = {} as {} (line {})", source_, name(key),
                   YAML::Dump(v),
                   std::is_integral_v<T>         ? "an integer"
                   : std::is_floating_point_v<T> ? "a number"
                                                 : "a string",
                   v.Mark().line + 1);
    }
    return true;
  }

  // A number scaled into SI units (e.g. GB/s -> bytes/s).
  bool read_scaled(const char* key, double scale, double& out) {
    double v = 0;
    if (!read(key, v)) return false;
    TESSEL_CHECK(std::isfinite(v) && v >= 0, ConfigError,
                 "{}: '{}' is {}; it must be a non-negative number", source_, name(key), v);
    out = v * scale;
    return true;
  }

  Section section(const char* key) {
    known_.insert(key);
    YAML::Node child = node_ && node_.IsMap() && node_[key] ? node_[key] : YAML::Node();
    return Section(child, name(key), source_);
  }

  void finish() const {
    if (!node_ || !node_.IsMap()) return;
    for (const auto& kv : node_) {
      const auto key = kv.first.as<std::string>();
      if (known_.count(key)) continue;
      std::string allowed;
      for (const auto& k : known_) allowed += (allowed.empty() ? "" : ", ") + k;
      TESSEL_THROW(ConfigError, "{}: unknown key '{}' (line {}); allowed here: {}", source_,
                   name(key), kv.first.Mark().line + 1, allowed);
    }
  }

 private:
  std::string name(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  YAML::Node node_;
  std::string path_;
  const std::string& source_;
  std::set<std::string> known_;
};

void read_link(Section s, LinkSpec& link) {
  // A link described by its rates is that link: the preset's measured curve and model no longer
  // apply.
  if (s.read_scaled("bandwidth_GBps", 1e9, link.bandwidth) |
      s.read_scaled("latency_us", 1e-6, link.latency) |
      s.read_scaled("collective_bandwidth_GBps", 1e9, link.collective_bandwidth) |
      s.read_scaled("collective_latency_us", 1e-6, link.collective_latency)) {
    link.bus_curve.clear();
    link.nccl = {};
  }
  s.finish();
}

void read_bytes(Section& s, const char* gib_key, const char* bytes_key, int64_t& out,
                const std::string& source) {
  double gib = 0;
  const bool has_gib = s.read_scaled(gib_key, kGiB, gib);
  int64_t bytes = 0;
  const bool has_bytes = s.read(bytes_key, bytes);
  TESSEL_CHECK(!(has_gib && has_bytes), ConfigError,
               "{}: give either device.{} or device.{}, not both", source, gib_key, bytes_key);
  if (has_gib) out = int64_t(gib);
  if (has_bytes) out = bytes;
}

void read_device(Section s, DeviceSpec& d, const std::string& source) {
  // A device named anew has the shape model of that name, if any.
  if (const std::string before = d.name; s.read("name", d.name) && d.name != before)
    d.shape = gemm_model_for(d.name);
  read_bytes(s, "memory_gib", "memory_bytes", d.memory_bytes, source);
  read_bytes(s, "reserved_gib", "reserved_bytes", d.reserved_bytes, source);
  s.read_scaled("memory_bandwidth_GBps", 1e9, d.memory_bandwidth);
  {
    Section peak = s.section("peak_tflops");
    for (auto p : {Precision::fp32, Precision::bf16, Precision::fp16})
      peak.read_scaled(std::string(precision_name(p)).c_str(), 1e12, d.peak_flops[size_t(p)]);
    peak.finish();
  }
  // A curve asked for by its parameters is the curve used.
  if (s.read_scaled("gemm_efficiency", 1.0, d.gemm.max_efficiency) |
      s.read_scaled("gemm_half_time_us", 1e-6, d.gemm.half_time_s))
    d.shape = GemmModel{};
  s.finish();
}

}  // namespace

ClusterSpec ClusterSpec::preset(std::string_view name) {
  return make_preset(name);
}

std::vector<std::string> ClusterSpec::preset_names() {
  return {"dgx-a100", "dgx-h100"};
}

ClusterSpec ClusterSpec::with_devices(int devices) const {
  TESSEL_CHECK(devices >= 1, ConfigError, "cluster '{}': the device count is {}; it must be >= 1",
               name, devices);
  ClusterSpec c = *this;
  if (devices <= devices_per_host) {
    c.hosts = 1;
    c.host_capacity = whole_host_devices();
    c.devices_per_host = devices;
  } else {
    TESSEL_CHECK(devices % devices_per_host == 0, ConfigError,
                 "cluster '{}': {} devices is not a whole number of {}-device hosts; use a "
                 "multiple of {} (e.g. {} or {})",
                 name, devices, devices_per_host, devices_per_host,
                 devices / devices_per_host * devices_per_host,
                 (devices / devices_per_host + 1) * devices_per_host);
    c.hosts = devices / devices_per_host;
  }
  return c;
}

void ClusterSpec::validate() const {
  const std::string_view n = name.empty() ? std::string_view("<unnamed>") : name;
  TESSEL_CHECK(hosts >= 1 && devices_per_host >= 1, ConfigError,
               "cluster '{}': hosts ({}) and devices_per_host ({}) must be >= 1", n, hosts,
               devices_per_host);
  TESSEL_CHECK(int64_t(hosts) * devices_per_host <= std::numeric_limits<int>::max(), ConfigError,
               "cluster '{}': {} hosts x {} devices is too many", n, hosts, devices_per_host);
  TESSEL_CHECK(device.peak(Precision::fp32) > 0 || device.peak(Precision::bf16) > 0 ||
                   device.peak(Precision::fp16) > 0,
               ConfigError,
               "cluster '{}': device.peak_tflops gives no positive rate; set fp32, "
               "bf16 or fp16",
               n);
  TESSEL_CHECK(device.memory_bytes > 0, ConfigError,
               "cluster '{}': device memory is {} bytes; set device.memory_gib", n,
               device.memory_bytes);
  TESSEL_CHECK(device.reserved_bytes >= 0 && device.reserved_bytes < device.memory_bytes,
               ConfigError,
               "cluster '{}': device.reserved ({} bytes) must be below the device memory ({} "
               "bytes)",
               n, device.reserved_bytes, device.memory_bytes);
  TESSEL_CHECK(device.gemm.max_efficiency > 0 && device.gemm.max_efficiency <= 1, ConfigError,
               "cluster '{}': device.gemm_efficiency is {}; it must be in (0, 1]", n,
               device.gemm.max_efficiency);
  TESSEL_CHECK(device.gemm.half_time_s >= 0, ConfigError,
               "cluster '{}': device.gemm_half_time_us must be >= 0", n);
  TESSEL_CHECK(devices_per_host == 1 || intra_host.bandwidth > 0, ConfigError,
               "cluster '{}': intra_host.bandwidth_GBps must be positive with {} devices per host",
               n, devices_per_host);
  TESSEL_CHECK(hosts == 1 || inter_host.bandwidth > 0, ConfigError,
               "cluster '{}': inter_host.bandwidth_GBps must be positive with {} hosts", n, hosts);
}

ClusterSpec ClusterSpec::from_yaml(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    TESSEL_THROW(ConfigError, "{}: malformed YAML at line {}, column {}: {}", source,
                 e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  TESSEL_CHECK(root.IsMap(), ConfigError,
               "{}: a cluster spec must be a YAML mapping (hosts:, devices_per_host:, device:, "
               "intra_host:, inter_host:)",
               source);
  Section s(root, "", source);
  ClusterSpec c;
  std::string preset;
  if (s.read("preset", preset)) {
    c = make_preset(preset);
  } else {
    c.name = std::filesystem::path(source).stem().string();
    c.device.gemm = EfficiencyCurve{};
  }
  s.read("name", c.name);
  s.read("hosts", c.hosts);
  s.read("devices_per_host", c.devices_per_host);
  read_device(s.section("device"), c.device, source);
  read_link(s.section("intra_host"), c.intra_host);
  read_link(s.section("inter_host"), c.inter_host);
  s.finish();
  try {
    c.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(source + ": " + e.what());
  }
  return c;
}

ClusterSpec ClusterSpec::load(const std::string& path) {
  std::ifstream in(path);
  TESSEL_CHECK(in.good(), IoError, "cannot read cluster spec '{}': no such file or not readable",
               path);
  std::stringstream buf;
  buf << in.rdbuf();
  return from_yaml(buf.str(), path);
}

ClusterSpec ClusterSpec::resolve(const std::string& name_or_path) {
  for (const auto& n : preset_names()) {
    if (n == name_or_path) return preset(n);
  }
  TESSEL_CHECK(std::filesystem::exists(name_or_path), ConfigError,
               "cluster '{}' is neither a preset ({}) nor an existing YAML file", name_or_path,
               "dgx-a100, dgx-h100");
  return load(name_or_path);
}

namespace {

const nlohmann::json& json_field(const nlohmann::json& doc, const char* key, const char* where) {
  TESSEL_CHECK(doc.is_object() && doc.contains(key), CorruptDataError,
               "profile: {} has no '{}' field", where, key);
  return doc.at(key);
}

double json_number(const nlohmann::json& doc, const char* key, const char* where,
                   bool positive = true) {
  const auto& v = json_field(doc, key, where);
  TESSEL_CHECK(v.is_number() && std::isfinite(v.get<double>()) &&
                   (positive ? v.get<double>() > 0 : v.get<double>() >= 0),
               CorruptDataError, "profile: {}.{} is {}; it must be a {} number", where, key,
               v.dump(), positive ? "positive" : "non-negative");
  return v.get<double>();
}

double json_optional(const nlohmann::json& doc, const char* key, const char* where,
                     double fallback) {
  if (!doc.is_object() || !doc.contains(key)) return fallback;
  return json_number(doc, key, where, false);
}

}  // namespace

ClusterSpec from_profile_json(const nlohmann::json& profile) {
  TESSEL_CHECK(profile.is_object(), CorruptDataError, "profile is {}, not a JSON object",
               profile.type_name());
  ClusterSpec c;
  c.name = profile.contains("name") && profile["name"].is_string()
               ? profile["name"].get<std::string>()
               : "this-machine";
  const double workers = json_number(profile, "workers", "the profile");
  TESSEL_CHECK(workers == std::floor(workers) && workers <= 1 << 20, CorruptDataError,
               "profile: workers is {}; it must be a whole number", workers);
  c.hosts = 1;
  c.devices_per_host = int(workers);
  c.device.name = "worker";
  c.device.memory_bytes = int64_t(json_number(profile, "memory_bytes", "the profile"));
  c.device.reserved_bytes = int64_t(json_optional(profile, "reserved_bytes", "the profile", 0));
  c.device.memory_bandwidth =
      json_optional(profile, "memory_bandwidth_bytes_per_s", "the profile", 0);
  const auto& flops = json_field(profile, "flops", "the profile");
  c.device.peak_flops[size_t(Precision::fp32)] = json_number(flops, "fp32", "flops");
  c.device.peak_flops[size_t(Precision::bf16)] = json_optional(flops, "bf16", "flops", 0);
  c.device.peak_flops[size_t(Precision::fp16)] = json_optional(flops, "fp16", "flops", 0);
  c.device.gemm = EfficiencyCurve{1.0, json_optional(profile, "gemm_half_time_s", "the profile",
                                                     EfficiencyCurve{}.half_time_s)};
  const auto& p2p = json_field(profile, "p2p", "the profile");
  c.intra_host.bandwidth = json_number(p2p, "bandwidth_bytes_per_s", "p2p");
  c.intra_host.latency = json_number(p2p, "latency_s", "p2p", false);
  const auto& ar = json_field(profile, "all_reduce", "the profile");
  c.intra_host.collective_bandwidth = json_number(ar, "bus_bandwidth_bytes_per_s", "all_reduce");
  c.intra_host.collective_latency = json_number(ar, "latency_s", "all_reduce", false);
  c.inter_host = c.intra_host;  // one host: never used
  try {
    c.validate();
  } catch (const ConfigError& e) {
    throw CorruptDataError(std::string("profile: ") + e.what());
  }
  return c;
}

}  // namespace tessel::planner
