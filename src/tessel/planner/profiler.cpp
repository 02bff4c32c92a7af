// The profile: options resolved, the measurements run in forked children (profile_workers.h,
// through profile_harness.h), and their raw times combined and fitted into the profile document.
#include "tessel/planner/profiler.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <thread>

#include "tessel/core/check.h"
#include "tessel/planner/profile_harness.h"
#include "tessel/planner/profile_workers.h"

namespace tessel::planner {
namespace {

using detail::Clock;
using detail::comm_worker;
using detail::compute_worker;
using detail::median;
using detail::run_children;
using detail::ScratchDir;
using detail::SharedBarrier;
namespace fs = std::filesystem;

std::vector<int64_t> default_sizes(int64_t max_b) {
  std::vector<int64_t> s;
  for (int64_t b = 1; b <= max_b; b *= 2) s.push_back(b);
  if (s.back() != max_b) s.push_back(max_b);
  return s;
}

nlohmann::json points_json(const std::vector<double>& bytes, const std::vector<double>& secs) {
  auto a = nlohmann::json::array();
  for (size_t i = 0; i < bytes.size(); ++i)
    a.push_back({{"bytes", int64_t(bytes[i])}, {"seconds", secs[i]}});
  return a;
}

}  // namespace

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, int(CPU_COUNT(&set)));
  return std::max(1u, std::thread::hardware_concurrency());
}

LinearFit fit_latency_bandwidth(const std::vector<double>& x, const std::vector<double>& t) {
  TESSEL_CHECK(!x.empty() && x.size() == t.size(), InvalidArgumentError,
               "fit_latency_bandwidth: {} sizes and {} times; need the same number, at least one",
               x.size(), t.size());
  double sw = 0, sx = 0, sxx = 0, st = 0, sxt = 0, max_x = 0, min_t = INFINITY;
  for (size_t i = 0; i < x.size(); ++i) {
    TESSEL_CHECK(x[i] > 0 && t[i] > 0 && std::isfinite(x[i]) && std::isfinite(t[i]),
                 InvalidArgumentError,
                 "fit_latency_bandwidth: point {} is ({}, {}); sizes and times must be positive", i,
                 x[i], t[i]);
    const double w = 1.0 / (t[i] * t[i]);
    sw += w;
    sx += w * x[i];
    sxx += w * x[i] * x[i];
    st += w * t[i];
    sxt += w * x[i] * t[i];
    max_x = std::max(max_x, x[i]);
    min_t = std::min(min_t, t[i]);
  }
  LinearFit f;
  const double det = sw * sxx - sx * sx;
  double slope = det > 1e-12 * sw * sxx ? (sw * sxt - sx * st) / det : 0;
  double latency = slope > 0 ? (st - slope * sx) / sw : 0;
  if (slope > 0 && latency < 0) {  // through the origin instead
    latency = 0;
    slope = sxt / sxx;
  }
  if (x.size() == 1) {
    latency = 0;
    slope = t[0] / x[0];
  }
  if (!(slope > 0)) {
    f.latency = st / sw;
    f.bandwidth = max_x / min_t;
    return f;
  }
  f.latency = latency;
  f.bandwidth = 1.0 / slope;
  return f;
}

namespace {

// The options with every default resolved.
struct ProfileSetup {
  ProfileOptions o;
  int seq = 0;
  int cores = 0;
  int threads = 0;      // per worker
  int concurrency = 0;  // compute workers measuring at once
  double oversubscription = 1;
  std::vector<int64_t> sizes;     // micro-batch sizes, ascending
  std::vector<int64_t> messages;  // message bytes
  void progress(const std::string& line) const {
    if (o.progress) o.progress(line);
  }
};

ProfileSetup resolve(const ProfileOptions& opt) {
  ProfileSetup s;
  s.o = opt;
  const ProfileOptions& o = s.o;
  o.model.validate();
  s.seq = o.seq > 0 ? o.seq : o.model.max_seq_len;
  TESSEL_CHECK(s.seq >= 1 && s.seq <= o.model.max_seq_len, ConfigError,
               "profile: sequence length {} is outside model '{}' (1 to max_seq_len {})", s.seq,
               o.model.name, o.model.max_seq_len);
  TESSEL_CHECK(o.workers >= 1 && o.threads >= 0 && o.repeats >= 1 && o.warmup >= 0 &&
                   o.block_group >= 1 && o.max_micro_batch >= 1,
               ConfigError,
               "profile: workers ({}), repeats ({}), block_group ({}) and max micro-batch ({}) "
               "must be >= 1, threads ({}) and warmup ({}) >= 0",
               o.workers, o.repeats, o.block_group, o.max_micro_batch, o.threads, o.warmup);
  s.cores = usable_cores();
  s.threads = o.threads > 0 ? o.threads : std::max(1, s.cores / o.workers);
  // More worker threads than cores: the compute is measured in as many workers as the cores hold
  // and scaled by the oversubscription, the share of a core each worker gets while all compute.
  s.concurrency = std::clamp(s.cores / s.threads, 1, o.workers);
  s.oversubscription = std::max(1.0, double(o.workers) * s.threads / s.cores);
  s.sizes = o.micro_batches.empty() ? default_sizes(o.max_micro_batch) : o.micro_batches;
  std::sort(s.sizes.begin(), s.sizes.end());
  s.sizes.erase(std::unique(s.sizes.begin(), s.sizes.end()), s.sizes.end());
  TESSEL_CHECK(s.sizes.front() >= 1, ConfigError, "profile: micro-batch sizes must be >= 1");
  s.messages = o.message_bytes.empty()
                   ? std::vector<int64_t>{4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20}
                   : o.message_bytes;
  for (int64_t b : s.messages)
    TESSEL_CHECK(b >= 4, ConfigError, "profile: message sizes must be >= 4 bytes, got {}", b);
  return s;
}

// The fields that describe the machine and the run, before anything is measured.
nlohmann::json profile_header(const ProfileSetup& s) {
  nlohmann::json doc;
  doc["format"] = "tessel-profile";
  doc["version"] = 1;
  doc["name"] = "this-machine";
  doc["workers"] = s.o.workers;
  doc["threads_per_worker"] = s.threads;
  doc["cores"] = s.cores;
  doc["cpu_oversubscription"] = s.oversubscription;
  doc["seq"] = s.seq;
  const auto& m = s.o.model;
  doc["model"] = {{"name", m.name},
                  {"family", model::family_name(m.family)},
                  {"n_layer", m.n_layer},
                  {"n_embd", m.n_embd},
                  {"n_head", m.n_head},
                  {"n_kv_head", m.n_kv_head},
                  {"ffn_hidden", m.ffn_hidden},
                  {"vocab_size", m.vocab_size},
                  {"max_seq_len", m.max_seq_len}};
  const double phys = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  doc["memory_bytes"] = int64_t(phys / s.o.workers);
  doc["reserved_bytes"] = 0;
  doc["repeats"] = s.o.repeats;
  return doc;
}

// The median over the compute workers' reports of get(report).
template <typename Get>
double median_over(const std::vector<nlohmann::json>& reports, Get&& get) {
  std::vector<double> v;
  for (const auto& j : reports) v.push_back(get(j));
  return median(v);
}

// The layer_times section from the compute workers' reports: medians over the workers, times
// scaled to all workers computing at once.
nlohmann::json layer_times(const ProfileSetup& s, const std::vector<nlohmann::json>& w) {
  nlohmann::json lt;
  lt["seq"] = s.seq;
  lt["tp"] = 1;
  lt["threads"] = s.threads;
  lt["concurrent_workers"] = s.concurrency;
  lt["cpu_oversubscription"] = s.oversubscription;
  lt["block_group"] = std::max(1, std::min(s.o.block_group, s.o.model.n_layer));
  lt["points"] = nlohmann::json::array();
  for (size_t p = 0; p < s.sizes.size(); ++p) {
    nlohmann::json pt;
    for (const auto& [key, value] : w[0]["points"][p].items()) {
      if (key == "micro_batch") {
        pt[key] = value;
        continue;
      }
      // A plain reference: clang before 16 cannot capture a structured binding (the fuzz build).
      const std::string& name = key;
      const double v = median_over(
          w, [&](const auto& j) { return j["points"][p][name].template get<double>(); });
      pt[key] = key.ends_with("_s") ? v * s.oversubscription : v;
    }
    lt["points"].push_back(pt);
  }
  return lt;
}

// Compute, in all workers at once: the GEMM rate, the optimizer phase, the layer times and the
// peak resident set.
void measure_compute(const ProfileSetup& s, const ScratchDir& scratch, nlohmann::json& doc) {
  const auto t0 = Clock::now();
  const fs::path dir = scratch.path() / "compute";
  fs::create_directories(dir);
  SharedBarrier barrier(s.concurrency);
  const auto outs = run_children(
      s.concurrency, s.o.timeout,
      fmt::format("the compute measurement ({} workers)", s.concurrency), dir, [&](int i) {
        return compute_worker(s.o, s.seq, s.threads, s.sizes, barrier, i, s.concurrency,
                              scratch.path() / "compute-store");
      });
  std::vector<nlohmann::json> w;
  for (const auto& out : outs) w.push_back(nlohmann::json::parse(out));
  const double flops =
      median_over(w, [](const auto& j) { return j["gemm_flops"].template get<double>(); });
  doc["flops"] = {{"fp32", flops / s.oversubscription}};
  doc["gemm_half_time_s"] =
      median_over(w, [](const auto& j) { return j["gemm_half_time_s"].template get<double>(); });
  const double norm_s = median_over(
      w, [](const auto& j) { return j["optimizer"]["grad_norm_s"].template get<double>(); });
  const double adamw_s = median_over(
      w, [](const auto& j) { return j["optimizer"]["adamw_s"].template get<double>(); });
  const int64_t n = w[0]["optimizer"]["elements"].get<int64_t>();
  const double per_param = s.oversubscription * (norm_s + adamw_s) / double(n);
  doc["optimizer"] = {{"elements", n},
                      {"grad_norm_s", norm_s},
                      {"adamw_s", adamw_s},
                      {"seconds_per_param", per_param}};
  doc["memory_bandwidth_bytes_per_s"] = 32.0 / per_param;
  doc["layer_times"] = layer_times(s, w);
  double rss = 0;
  for (const auto& j : w) rss = std::max(rss, j["peak_rss_bytes"].get<double>());
  doc["peak_rss_bytes"] = int64_t(rss);
  s.progress(fmt::format(
      "compute: {} micro-batch sizes on {} worker(s) x {} thread(s) at once{} "
      "in {:.1f} s",
      s.sizes.size(), s.concurrency, s.threads,
      s.oversubscription > 1 ? fmt::format(", times x {:.2f} for {} workers on {} cores",
                                           s.oversubscription, s.o.workers, s.cores)
                             : "",
      seconds_since(t0)));
}

// The p2p section from group 0's ping-pong times (groups of 2).
nlohmann::json p2p_section(const nlohmann::json& r0) {
  std::vector<double> x, t;
  for (const auto& p : r0["p2p"]) {
    x.push_back(p["bytes"].get<double>());
    t.push_back(p["seconds"].get<double>());
  }
  const LinearFit f = fit_latency_bandwidth(x, t);
  return {{"bandwidth_bytes_per_s", f.bandwidth},
          {"latency_s", f.latency},
          {"points", points_json(x, t)}};
}

// The tp_layer_times entry of groups of g measured with procs workers at once: scaled like
// layer_times to all workers busy.
nlohmann::json tp_layer_times(const ProfileSetup& s, int g, int procs, const nlohmann::json& r0) {
  const double over = s.oversubscription / std::max(1.0, double(procs) * s.threads / s.cores);
  nlohmann::json points = nlohmann::json::array();
  for (auto pt : r0["tp_points"]) {
    for (auto& [key, value] : pt.items())
      if (key.ends_with("_s")) value = value.get<double>() * over;
    points.push_back(pt);
  }
  return {{"seq", s.seq},
          {"tp", g},
          {"concurrent_groups", procs / g},
          {"cpu_oversubscription", s.oversubscription},
          {"points", points}};
}

// One communication group size g: as many groups of g at once as the workers form (the dp or tp
// groups of a layout communicate at the same time), group 0's times. Adds the all-reduce points
// (x: the bytes a ring moves, t: seconds) to all_x and all_t for the fit over every group size.
void measure_comm_group(const ProfileSetup& s, const ScratchDir& scratch, int g,
                        nlohmann::json& doc, std::vector<double>& all_x,
                        std::vector<double>& all_t) {
  const auto t0 = Clock::now();
  const fs::path store = scratch.path() / "store";
  const fs::path dir = scratch.path() / fmt::format("comm-{}", g);
  fs::create_directories(dir);
  const int procs = s.o.workers % g == 0 ? s.o.workers : g;
  const auto outs = run_children(
      procs, s.o.timeout,
      fmt::format("the communication measurement ({} group(s) of {})", procs / g, g), dir,
      [&](int i) {
        return comm_worker(s.o, store, s.messages, g, i / g, i % g, s.threads, s.seq, s.sizes);
      });
  const auto r0 = nlohmann::json::parse(outs[0]);
  if (g == 2) doc["p2p"] = p2p_section(r0);
  std::vector<double> bytes, x, t;
  const double factor = 2.0 * (g - 1) / g;
  for (const auto& p : r0["all_reduce"]) {
    bytes.push_back(p["bytes"].get<double>());
    x.push_back(factor * p["bytes"].get<double>());
    t.push_back(p["seconds"].get<double>());
  }
  all_x.insert(all_x.end(), x.begin(), x.end());
  all_t.insert(all_t.end(), t.begin(), t.end());
  const LinearFit f = fit_latency_bandwidth(x, t);
  doc["all_reduce"]["by_group"].push_back({{"ranks", g},
                                           {"bus_bandwidth_bytes_per_s", f.bandwidth},
                                           {"latency_s", f.latency},
                                           {"concurrent_groups", procs / g},
                                           {"points", points_json(bytes, t)}});
  if (r0.contains("tp_points")) doc["tp_layer_times"].push_back(tp_layer_times(s, g, procs, r0));
  s.progress(fmt::format("communication: {} group(s) of {} processes in {:.1f} s", procs / g, g,
                         seconds_since(t0)));
}

// Communication, per group size g in 2..max(2, workers), and the all-reduce fit over all of them.
void measure_comm(const ProfileSetup& s, const ScratchDir& scratch, nlohmann::json& doc) {
  std::vector<double> all_x, all_t;
  doc["all_reduce"]["by_group"] = nlohmann::json::array();
  doc["tp_layer_times"] = nlohmann::json::array();
  for (int g = 2; g <= std::max(2, s.o.workers); ++g)
    measure_comm_group(s, scratch, g, doc, all_x, all_t);
  const LinearFit f = fit_latency_bandwidth(all_x, all_t);
  doc["all_reduce"]["bus_bandwidth_bytes_per_s"] = f.bandwidth;
  doc["all_reduce"]["latency_s"] = f.latency;
}

}  // namespace

nlohmann::json profile(const ProfileOptions& opt) {
  const auto start = Clock::now();
  const ProfileSetup s = resolve(opt);
  ScratchDir scratch;
  nlohmann::json doc = profile_header(s);
  measure_compute(s, scratch, doc);
  if (s.o.measure_comm) measure_comm(s, scratch, doc);
  doc["seconds"] = seconds_since(start);
  return doc;
}

}  // namespace tessel::planner
