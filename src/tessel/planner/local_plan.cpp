#include "tessel/planner/local_plan.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tessel/core/check.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/search.h"

namespace tessel::planner {

namespace {

double machine_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? double(pages) * double(size) : 16e9;
}

}  // namespace

layout::Plan plan_for_workers(const LocalPlanRequest& r) {
  const int workers = r.workers;
  TESSEL_CHECK(workers >= 1, ConfigError, "{}: a plan needs at least 1 worker, got {}", r.source,
               workers);
  // Nominal rates of one CPU worker (from `tessel profile` on the development machine, rounded):
  // the planner compares layouts, so the ratios of compute to communication matter, not the
  // absolute numbers.
  nlohmann::json profile = {
      {"name", "local"},
      {"workers", workers},
      {"memory_bytes", machine_memory_bytes() / workers},
      {"flops", {{"fp32", 1.0e11 / workers}}},
      {"p2p", {{"bandwidth_bytes_per_s", 4e9}, {"latency_s", 5e-5}}},
      {"all_reduce", {{"bus_bandwidth_bytes_per_s", 1.5e9}, {"latency_s", 1e-4}}}};
  SearchRequest req;
  req.model = r.model;
  req.cluster = from_profile_json(profile);
  req.global_batch = r.global_batch;
  req.seq = r.seq;
  req.precision = Precision::fp32;
  req.options.recompute = {false};
  req.options.zero_stages = {0, 1};
  req.options.top_k = r.prefer_micro_batch > 0 ? 64 : 1;
  const auto result = search(req);
  TESSEL_CHECK(!result.ranked.empty(), ConfigError,
               "{}: no layout of model '{}' fits {} workers: {}", r.source, r.model.name, workers,
               result.infeasible);
  const auto& best = result.ranked.front();
  // Only the micro-batching may differ from the best layout (a tensor-parallel layout may cost
  // the same, but it holds no replica a later failure could recover from).
  auto same_layout = [&](layout::Plan p) {
    p.micro_batch = best.plan.micro_batch;
    p.micro_batches = best.plan.micro_batches;
    return p == best.plan;
  };
  for (const auto& c : result.ranked)
    if (c.plan.micro_batch == r.prefer_micro_batch && same_layout(c.plan) &&
        c.step_s <= best.step_s * (1 + kKeepMicroBatchSlack))
      return c.plan;
  return best.plan;
}

}  // namespace tessel::planner
