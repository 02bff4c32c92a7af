#include "tessel/planner/graph_costs.h"

#include "tessel/core/check.h"
#include "tessel/core/error.h"

namespace tessel::planner {

namespace {

double on_device(const std::vector<int64_t>& shape, const Shard& layout, int t) {
  const double n = double(elements(shape));
  return layout.kind == Shard::Kind::split ? n / t : n;
}

}  // namespace

ShardingCosts sharding_costs(const ClusterSpec& cluster, Precision precision) {
  const double peak = cluster.device.peak(precision);
  TESSEL_CHECK(peak > 0, ConfigError, "{} has no {} rate; choose another --precision",
               cluster.device.name, precision_name(precision));
  ShardingCosts c;
  c.flops_per_s = peak * cluster.device.gemm.max_efficiency;
  c.bandwidth = cluster.intra_host.coll_bandwidth();
  c.latency_s = cluster.intra_host.coll_latency();
  c.bytes_per_element = element_bytes(precision);
  // Parameter, gradient, Adam m and v (and the fp32 master copy in mixed precision).
  c.state_bytes_per_weight = precision == Precision::fp32 ? 16 : 2 + 2 + 12;
  c.memory_bytes = double(cluster.device.usable_bytes());
  return c;
}

std::vector<PassTimes> operator_times(const OpGraph& g, const ShardingSolution& sharding, int t,
                                      const ClusterSpec& cluster, Precision precision,
                                      std::vector<double>* step_sync) {
  TESSEL_CHECK(sharding.chosen.size() == size_t(g.size()), InvalidArgumentError,
               "operator_times: a sharding of {} nodes for a graph of {}", sharding.chosen.size(),
               g.size());
  const ShardingCosts rates = sharding_costs(cluster, precision);
  const double peak = cluster.device.peak(precision);
  const double bandwidth = cluster.device.memory_bandwidth;
  const double act_bytes = element_bytes(precision);
  auto gemm = [&](double flops) {
    return flops > 0 ? cluster.device.gemm.gemm_time(flops, peak) : 0.0;
  };
  auto stream = [&](double elements, double bytes) {
    return bandwidth > 0 ? elements * bytes / bandwidth : 0.0;
  };
  const auto readers = g.readers();
  std::vector<PassTimes> out(size_t(g.size()));
  if (step_sync != nullptr) step_sync->assign(size_t(g.size()), 0);
  for (int v = 0; v < g.size(); ++v) {
    const OpNode& node = g.node(v);
    const OpStrategy& s = sharding.chosen[size_t(v)];
    PassTimes& p = out[size_t(v)];
    const double el = on_device(node.shape, s.out, t);
    auto memory_bound = [&](double per_element) {
      p.forward = stream(per_element * el, act_bytes);
      p.backward_input = 2 * p.forward;
    };
    switch (node.kind) {
      case OpKind::matmul:
      case OpKind::conv:
        p.forward = gemm(s.flops);
        if (!g.weights_used_by(v).empty() || node.kind == OpKind::conv) {
          p.backward_input = p.backward_weight = p.forward;
        } else {
          p.backward_input = 2 * p.forward;
        }
        break;
      case OpKind::gather:
        p.forward = stream(el, act_bytes);
        p.backward_weight = 2 * p.forward;
        break;
      case OpKind::add:
      case OpKind::mul:
        if (node.inputs.size() >= 2) memory_bound(3);
        break;  // by a constant: fused
      case OpKind::loss:
        p.forward = p.backward_input =
            stream(2 * on_device(g.node(node.inputs.at(0)).shape, s.in.at(0), t), 4);
        break;
      case OpKind::reduce:
        p.forward =
            stream(2 * on_device(g.node(node.inputs.at(0)).shape, s.in.at(0), t), act_bytes);
        p.backward_input = 2 * p.forward;
        break;
      case OpKind::layer_norm:
      case OpKind::rms_norm:
      case OpKind::softmax:
      case OpKind::gelu:
      case OpKind::silu:
      case OpKind::rope:
      case OpKind::other:
        memory_bound(2);
        break;
      case OpKind::input:
      case OpKind::reshape:
      case OpKind::transpose:
      case OpKind::split:
      case OpKind::concat:
        break;
    }
    const double inside = inside_cost(s, rates);
    p.forward += inside;
    p.backward_input += inside;
    if (step_sync != nullptr) (*step_sync)[size_t(v)] = weight_sync_cost(g, v, s, t, rates);
    for (size_t k = 0; k < node.inputs.size(); ++k) {
      const int u = node.inputs[k];
      p.forward += edge_costs(g, u, sharding.chosen[size_t(u)], v, k, s, t, rates).forward;
    }
    p.backward_input += backward_gradient_cost(g, v, readers[size_t(v)], sharding.chosen, t, rates);
    p.recompute = p.forward;
  }
  return out;
}

std::vector<StageCosts> graph_stage_costs(const OpGraph& g, const ShardingSolution& sharding,
                                          const std::vector<PassTimes>& times,
                                          const std::vector<int>& stage_of, int stages, int t,
                                          Precision precision) {
  const size_t n = size_t(g.size());
  TESSEL_CHECK(stages >= 1 && times.size() == n && sharding.chosen.size() == n &&
                   (stage_of.empty() || stage_of.size() == n),
               InvalidArgumentError,
               "graph_stage_costs: {} stages, {} times, {} strategies and {} stage entries for {} "
               "nodes",
               stages, times.size(), sharding.chosen.size(), stage_of.size(), n);
  auto stage = [&](int v) { return stage_of.empty() ? 0 : stage_of[size_t(v)]; };
  const double bytes = element_bytes(precision);
  std::vector<StageCosts> out(size_t(stages), StageCosts{0, 0, 0, 0, 0, 0});
  // The last stage each node's output is read on.
  std::vector<int> read_until(n, -1);
  for (int v = 0; v < g.size(); ++v) {
    TESSEL_CHECK(stage(v) >= 0 && stage(v) < stages, InvalidArgumentError,
                 "graph_stage_costs: node '{}' on stage {} of {}", g.node(v).name, stage(v),
                 stages);
    for (int u : g.node(v).inputs)
      read_until[size_t(u)] = std::max(read_until[size_t(u)], stage(v));
  }
  for (int v = 0; v < g.size(); ++v) {
    StageCosts& c = out[size_t(stage(v))];
    const PassTimes& p = times[size_t(v)];
    c.forward += p.forward;
    c.backward_input += p.backward_input;
    c.backward_weight += p.backward_weight;
    c.backward += p.backward();
    const OpNode& node = g.node(v);
    if (node.kind == OpKind::input) continue;
    const double held = on_device(node.shape, sharding.chosen[size_t(v)].out, t) * bytes;
    c.activation_bytes += held;
    // Data entering the graph is loaded where it is read; a computed tensor crosses every
    // boundary between its stage and its last reader's.
    for (int b = stage(v); b < read_until[size_t(v)]; ++b) out[size_t(b)].output_bytes += held;
  }
  return out;
}

}  // namespace tessel::planner
