#include "tessel/planner/plan_service.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "tessel/core/check.h"
#include "tessel/core/error.h"
#include "tessel/net/guarded_server.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/graph_plan.h"
#include "tessel/planner/onnx_graph.h"

namespace tessel::planner {

namespace {

void send_json(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(body.dump() + "\n", "application/json");
}

// A query parameter as a number in [lo, hi]; `fallback` when absent. InvalidArgumentError names
// the parameter.
double number_param(const httplib::Request& req, const char* key, double fallback, double lo,
                    double hi) {
  if (!req.has_param(key)) return fallback;
  const std::string text = req.get_param_value(key);
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TESSEL_CHECK(used == text.size() && !text.empty() && v >= lo && v <= hi, InvalidArgumentError,
               "query parameter {}={} must be a number in [{}, {}]", key, text, lo, hi);
  return v;
}

// The request's cluster: a multipart "cluster" field of YAML, else the `cluster` parameter naming
// a preset (never a path: a client does not read the server's files), else dgx-a100.
ClusterSpec request_cluster(const httplib::Request& req) {
  if (req.is_multipart_form_data() && req.has_file("cluster"))
    return ClusterSpec::from_yaml(req.get_file_value("cluster").content, "the cluster field");
  return ClusterSpec::preset(req.has_param("cluster") ? req.get_param_value("cluster")
                                                      : "dgx-a100");
}

OnnxOptions request_dims(const httplib::Request& req) {
  OnnxOptions o;
  o.dim_syntax = "the query parameter dim={}:VALUE";
  for (size_t i = 0; i < req.get_param_value_count("dim"); ++i) {
    const std::string d = req.get_param_value("dim", i);
    const auto dim = parse_dim(d, ':');
    TESSEL_CHECK(dim.has_value(), InvalidArgumentError,
                 "query parameter dim={} must be NAME:VALUE with a positive VALUE, e.g. "
                 "dim=batch:8",
                 d);
    o.dims[dim->first] = dim->second;
  }
  return o;
}

}  // namespace

struct PlanService::Impl {
  PlanServiceOptions options;
  std::unique_ptr<net::GuardedServer> server;
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;

  // One plan at a time per slot: planning is CPU-bound, so more at once would only slow each.
  bool acquire() {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, options.plan_wait, [&] { return running < options.concurrent_plans; }))
      return false;
    ++running;
    return true;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      --running;
    }
    cv.notify_one();
  }

  void plan(const httplib::Request& req, httplib::Response& res) {
    const std::string& model = req.is_multipart_form_data() && req.has_file("model")
                                   ? req.get_file_value("model").content
                                   : req.body;
    TESSEL_CHECK(!model.empty(), InvalidArgumentError,
                 "the request has no model: POST the ONNX file as the body, or as the multipart "
                 "field 'model'");
    GraphPlanRequest r;
    r.tp = int(number_param(req, "tp", 0, 1, 4096));
    r.stages = int(number_param(req, "stages", 1, 1, 4096));
    r.balance = number_param(req, "balance", 0.1, 0, 100);
    r.dp = int(number_param(req, "dp", 1, 1, 1 << 20));
    r.outer = int(number_param(req, "outer", 1, 1, 4096));
    r.micro_batches = int(number_param(req, "micro_batches", 1, 1, 1 << 20));
    if (req.has_param("schedule")) r.schedule = req.get_param_value("schedule");
    r.ilp = options.ilp;
    const ClusterSpec cluster = request_cluster(req);
    if (r.tp == 0) r.tp = cluster.devices_per_host;
    r.precision = req.has_param("precision") ? parse_precision(req.get_param_value("precision"))
                                             : cluster.device.default_precision();
    OnnxOptions dims = request_dims(req);
    dims.source = "the posted model";
    dims.deadline = options.import_deadline;
    // The importer runs as its own process (onnx_graph.h): what the file does to libonnx stays
    // there.
    const auto imported = read_onnx_bytes(model, dims);
    if (!acquire()) {
      send_json(res, 503,
                {{"error",
                  fmt::format("{} plans are running; try again later", options.concurrent_plans)}});
      return;
    }
    nlohmann::json doc;
    try {
      doc = graph_plan_json(imported.graph, plan_graph(imported.graph, cluster, r));
    } catch (...) {
      release();
      throw;
    }
    release();
    doc["producer"] = imported.producer;
    doc["opset"] = imported.opset;
    doc["cluster"] = cluster.name;
    doc["precision"] = precision_name(r.precision);
    doc["warnings"] = imported.warnings;
    send_json(res, 200, doc);
  }
};

PlanService::PlanService(PlanServiceOptions options) : impl_(std::make_unique<Impl>()) {
  TESSEL_CHECK(options.max_model_bytes > 0 && options.concurrent_plans >= 1, ConfigError,
               "the planning service needs max_model_bytes > 0 and concurrent_plans >= 1");
  impl_->options = std::move(options);
  net::ServerOptions so = impl_->options.server;
  so.name = "the planning service";
  so.token_hint = "a token file (tessel plan serve --token-file FILE)";
  // The model's bytes, plus room for a multipart envelope and a cluster description.
  so.limits.max_body_bytes = impl_->options.max_model_bytes + (size_t(64) << 10);
  impl_->server = std::make_unique<net::GuardedServer>(std::move(so));
  Impl* impl = impl_.get();
  impl_->server->Get("/v1/health", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"ok", true}});
  });
  impl_->server->Post("/v1/plan", [impl](const httplib::Request& req, httplib::Response& res) {
    impl->plan(req, res);
  });
  impl_->server->set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        int status = 500;
        std::string message = "internal error";
        try {
          std::rethrow_exception(ep);
        } catch (const InvalidArgumentError& e) {
          status = 400, message = e.what();
        } catch (const ConfigError& e) {
          status = 400, message = e.what();
        } catch (const CorruptDataError& e) {
          status = 400, message = e.what();
        } catch (const UnsupportedError& e) {
          status = 400, message = e.what();
        } catch (const std::exception& e) {
          message = e.what();
        } catch (...) {
        }
        if (status == 500)
          spdlog::error("planning service: {} {}: {}", req.method, req.path, message);
        send_json(res, status, {{"error", message}});
      });
}

PlanService::~PlanService() {
  stop();
}

int PlanService::start() {
  return impl_->server->start();
}

void PlanService::stop() {
  if (impl_ && impl_->server) impl_->server->stop();
}

bool PlanService::requires_token() const {
  return impl_->server->requires_token();
}

}  // namespace tessel::planner
