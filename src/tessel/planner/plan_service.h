// `tessel plan serve`: the graph planner as a service, as TePDist runs it -- any front end posts
// an operator graph and gets the plan back.
//
//   POST
//   /v1/plan?tp=4&stages=2&cluster=dgx-a100&precision=bf16&balance=0.1&dim=batch:8&dim=seq:1024
//           &dp=2&micro_batches=8&schedule=1f1b&outer=2
//        (outer: a 2-axis mesh of outer x tp devices per stage, graph_plan.h)
//        body: the ONNX model (application/octet-stream)
//     200 {"tp", "stages", "status", "time_s", "step", "operators": [...], "cut", "warnings",
//          ...}
//         (graph_plan.h: graph_plan_json, plus the model's producer, opset and warnings)
//     400 {"error": "..."}  a malformed, truncated or cyclic graph, a dimension without a value,
//                           an unknown cluster, a layout that does not fit, a model that
//                           crashes or hangs the ONNX library (in the importer's process)
//     413 / 408 / 503       a model over max_model_bytes, an upload slower than the request
//                           timeout, too many connections (net/guarded_server.h)
//   GET /v1/health  -> {"ok": true}
//
// Served by a GuardedServer on 127.0.0.1 unless a token file allows another address. Plans are
// computed on the server's worker threads, at most `concurrent_plans` at once (each solves its
// integer programmes on one thread) with the ILP time limit of `ilp`; a request beyond that waits
// up to plan_wait for its turn, else 503.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "tessel/net/server_options.h"
#include "tessel/planner/ilp.h"

namespace tessel::planner {

struct PlanServiceOptions {
  net::ServerOptions server;                   // host, port, token file, limits
  size_t max_model_bytes = size_t(256) << 20;  // the ONNX body
  int concurrent_plans = 2;
  std::chrono::milliseconds plan_wait{30'000};
  IlpOptions ilp = {};  // time limit and gap of every programme
  // The importer (a process of its own, onnx_graph.h) is killed after this: a 400.
  std::chrono::milliseconds import_deadline{60'000};
};

class PlanService {
 public:
  // Throws ConfigError for a non-loopback host without a token file, zero limits.
  explicit PlanService(PlanServiceOptions options);
  ~PlanService();
  PlanService(const PlanService&) = delete;
  PlanService& operator=(const PlanService&) = delete;

  // Binds and serves on background threads; returns the port. Throws IoError when the address
  // cannot be bound.
  int start();
  void stop();
  bool requires_token() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::planner
