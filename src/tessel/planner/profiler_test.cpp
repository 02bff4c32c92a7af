#include "tessel/planner/profiler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "tessel/core/error.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/cost_model.h"

namespace tessel::planner {
namespace {

// A tiny model, two micro-batch sizes, few repeats and small messages: a real profile in well
// under a second of measuring (plus process start-up).
ProfileOptions tiny_options(int workers) {
  ProfileOptions o;
  o.model = model::ModelConfig::preset("gpt2-tiny");
  o.seq = 16;
  o.workers = workers;
  o.micro_batches = {1, 2};
  o.warmup = 0;
  o.repeats = 2;
  o.message_bytes = {4096, 65536};
  o.timeout = std::chrono::milliseconds(60000);
  return o;
}

TEST(Profiler, OutputIsWhatThePlannerReads) {
  std::vector<std::string> lines;
  ProfileOptions o = tiny_options(2);
  o.progress = [&](const std::string& l) { lines.push_back(l); };
  const nlohmann::json doc = profile(o);

  // The cluster: this machine with two workers, measured rates.
  const ClusterSpec c = from_profile_json(doc);
  EXPECT_EQ(c.num_devices(), 2);
  EXPECT_GT(c.device.peak(Precision::fp32), 0);
  EXPECT_GT(c.device.memory_bytes, 0);
  EXPECT_GT(c.device.memory_bandwidth, 0);
  EXPECT_GT(c.intra_host.bandwidth, 0);
  EXPECT_GT(c.intra_host.coll_bandwidth(), 0);
  EXPECT_GE(c.intra_host.latency, 0);
  EXPECT_EQ(doc.at("threads_per_worker").get<int>(), std::max(1, usable_cores() / 2));
  ASSERT_EQ(doc.at("all_reduce").at("by_group").size(), 1u);
  EXPECT_EQ(doc.at("all_reduce").at("by_group")[0].at("ranks").get<int>(), 2);
  EXPECT_EQ(doc.at("p2p").at("points").size(), 2u);
  EXPECT_EQ(doc.at("cpu_oversubscription").get<double>(),
            std::max(1.0, 2.0 * doc.at("threads_per_worker").get<int>() / usable_cores()));

  // gpt2-tiny splits two ways: tensor-parallel stages timed over the group of two, in the
  // layer_times schema.
  ASSERT_EQ(doc.at("tp_layer_times").size(), 1u);
  const auto& tp2 = doc.at("tp_layer_times")[0];
  EXPECT_EQ(tp2.at("tp").get<int>(), 2);
  const ComputeProfile tp_profile =
      compute_profile_from_json(nlohmann::json{{"layer_times", tp2}}, o.model);
  EXPECT_EQ(tp_profile.tp, 2);
  ASSERT_EQ(tp_profile.points.size(), 2u);
  for (const auto& pt : tp_profile.points) {
    EXPECT_GT(pt.block.forward, 0);
    EXPECT_GT(pt.head.backward(), 0);
  }

  // The layer times: one point per micro-batch size, every time measured.
  const ComputeProfile p = compute_profile_from_json(doc, o.model);
  EXPECT_EQ(p.seq, 16);
  EXPECT_EQ(p.tp, 1);
  ASSERT_EQ(p.points.size(), 2u);
  for (const auto& pt : p.points) {
    EXPECT_GT(pt.block.forward, 0) << pt.micro_batch;
    EXPECT_GT(pt.block.backward(), 0) << pt.micro_batch;
    EXPECT_GT(pt.embedding.forward, 0) << pt.micro_batch;
    EXPECT_GT(pt.head.forward, 0) << pt.micro_batch;
    EXPECT_GT(pt.head.backward(), 0) << pt.micro_batch;
  }
  for (const auto& j : doc.at("layer_times").at("points")) {
    EXPECT_GT(j.at("block_activation_bytes").get<double>(), 0);
    EXPECT_GT(j.at("head_activation_bytes").get<double>(), 0);
  }
  // Activations grow with the micro-batch.
  EXPECT_GT(doc["layer_times"]["points"][1]["block_activation_bytes"].get<double>(),
            doc["layer_times"]["points"][0]["block_activation_bytes"].get<double>());
  EXPECT_GT(doc.at("peak_rss_bytes").get<double>(), 0);

  // A cost model built from it serves the measured block times at the profiled shape.
  const CostModel cost(o.model, c, CostOptions{Precision::fp32}, p);
  const PassTimes b2 = cost.block(2, 16, 1);
  EXPECT_DOUBLE_EQ(b2.forward, p.points[1].block.forward);
  EXPECT_DOUBLE_EQ(b2.backward(), p.points[1].block.backward());
  EXPECT_GT(cost.optimizer_step(1e6), 0);
  EXPECT_EQ(lines.size(), 2u);  // compute, one communication group
}

TEST(Profiler, ComputeOnlyProfileOfOneWorker) {
  ProfileOptions o = tiny_options(1);
  o.measure_comm = false;
  o.threads = 1;
  const nlohmann::json doc = profile(o);
  EXPECT_EQ(doc.at("workers").get<int>(), 1);
  EXPECT_EQ(doc.at("threads_per_worker").get<int>(), 1);
  EXPECT_FALSE(doc.contains("p2p"));
  EXPECT_NO_THROW(compute_profile_from_json(doc, o.model));
  // Without the communication fields it describes no cluster.
  EXPECT_THROW(from_profile_json(doc), CorruptDataError);
}

TEST(Profiler, RejectsInvalidOptions) {
  ProfileOptions o = tiny_options(1);
  o.seq = 65;  // gpt2-tiny's max_seq_len is 64
  EXPECT_THROW(profile(o), ConfigError);
  o = tiny_options(0);
  EXPECT_THROW(profile(o), ConfigError);
  o = tiny_options(1);
  o.micro_batches = {0, 2};
  EXPECT_THROW(profile(o), ConfigError);
  o = tiny_options(1);
  o.message_bytes = {2};
  EXPECT_THROW(profile(o), ConfigError);
}

TEST(Profiler, AChildThatFailsIsReportedNotFatal) {
  // A message far too large to allocate: the communication workers' failure comes back as an
  // Error naming the part, and the other worker of the group is killed, not waited for.
  ProfileOptions o = tiny_options(1);
  o.micro_batches = {1};
  o.message_bytes = {int64_t(1) << 50};
  try {
    profile(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("communication measurement"), std::string::npos)
        << e.what();
  }
}

TEST(Profiler, ATimeoutKillsTheWorkers) {
  ProfileOptions o = tiny_options(1);
  o.timeout = std::chrono::milliseconds(1);
  EXPECT_THROW(profile(o), TimeoutError);
}

TEST(FitLatencyBandwidth, RecoversALine) {
  const std::vector<double> x = {1e3, 1e4, 1e5, 1e6, 1e7};
  std::vector<double> t;
  for (double xi : x) t.push_back(5e-5 + xi / 2e9);
  const LinearFit f = fit_latency_bandwidth(x, t);
  EXPECT_NEAR(f.latency, 5e-5, 1e-9);
  EXPECT_NEAR(f.bandwidth, 2e9, 2e9 * 1e-6);
}

TEST(FitLatencyBandwidth, RelativeErrorsWeighSmallAndLargeAlike) {
  // 10% noise on one small and one large point moves the fit by a similar relative amount, where
  // an unweighted fit would let the large point decide the latency.
  const std::vector<double> x = {1e3, 1e4, 1e5, 1e6, 1e7};
  std::vector<double> t;
  for (double xi : x) t.push_back(1e-4 + xi / 1e9);
  t[4] *= 1.1;
  const LinearFit f = fit_latency_bandwidth(x, t);
  EXPECT_NEAR(f.latency, 1e-4, 1e-5);
  EXPECT_NEAR(f.bandwidth, 1e9, 0.15e9);
}

TEST(FitLatencyBandwidth, FlatTimesAndOnePoint) {
  // Times that do not grow: a pure latency, and the bandwidth the data bound from below.
  const LinearFit flat = fit_latency_bandwidth({1e3, 1e6}, {2e-3, 1e-3});
  EXPECT_GT(flat.latency, 1e-3);
  EXPECT_LT(flat.latency, 2e-3);
  EXPECT_DOUBLE_EQ(flat.bandwidth, 1e6 / 1e-3);
  const LinearFit one = fit_latency_bandwidth({1e6}, {1e-3});
  EXPECT_EQ(one.latency, 0);
  EXPECT_DOUBLE_EQ(one.bandwidth, 1e9);
  // A negative intercept is clamped: the line through the origin.
  const LinearFit origin = fit_latency_bandwidth({1e3, 1e6}, {1e-7, 1e-3});
  EXPECT_EQ(origin.latency, 0);
  EXPECT_GT(origin.bandwidth, 0);
  EXPECT_TRUE(std::isfinite(origin.bandwidth));
}

TEST(FitLatencyBandwidth, RejectsBadPoints) {
  EXPECT_THROW(fit_latency_bandwidth({}, {}), InvalidArgumentError);
  EXPECT_THROW(fit_latency_bandwidth({1, 2}, {1}), InvalidArgumentError);
  EXPECT_THROW(fit_latency_bandwidth({1, 2}, {1, 0}), InvalidArgumentError);
  EXPECT_THROW(fit_latency_bandwidth({-1}, {1}), InvalidArgumentError);
  EXPECT_THROW(fit_latency_bandwidth({1}, {std::numeric_limits<double>::infinity()}),
               InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::planner
