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
  c.bus_curve = cluster.intra_host.bus_curve;
  c.bytes_per_element = element_bytes(precision);
  // Parameter, gradient, Adam m and v (and the fp32 master copy in mixed precision).
  c.state_bytes_per_weight = precision == Precision::fp32 ? 16 : 2 + 2 + 12;
  c.memory_bytes = double(cluster.device.usable_bytes());
  return c;
}

std::vector<PassTimes> operator_times(const OpGraph& g, const std::vector<NodeWork>& work,
                                      const std::vector<NodeComm>& comm, const ClusterSpec& cluster,
                                      Precision precision) {
  TESSEL_CHECK(work.size() == size_t(g.size()) && comm.size() == size_t(g.size()),
               InvalidArgumentError, "operator_times: {} works and {} communications for {} nodes",
               work.size(), comm.size(), g.size());
  const double peak = cluster.device.peak(precision);
  TESSEL_CHECK(peak > 0, ConfigError, "{} has no {} rate; choose another --precision",
               cluster.device.name, precision_name(precision));
  const double bandwidth = cluster.device.memory_bandwidth;
  const double act_bytes = element_bytes(precision);
  auto gemm = [&](double flops) {
    return flops > 0 ? cluster.device.gemm.gemm_time(flops, peak) : 0.0;
  };
  auto stream = [&](double elements, double bytes) {
    return bandwidth > 0 ? elements * bytes / bandwidth : 0.0;
  };
  std::vector<PassTimes> out(size_t(g.size()));
  for (int v = 0; v < g.size(); ++v) {
    const OpNode& node = g.node(v);
    const NodeWork& w = work[size_t(v)];
    PassTimes& p = out[size_t(v)];
    const double el = w.out_elements;
    auto memory_bound = [&](double per_element) {
      p.forward = stream(per_element * el, act_bytes);
      p.backward_input = 2 * p.forward;
    };
    switch (node.kind) {
      case OpKind::matmul:
        if (w.out_shape.size() >= 2 && w.flops > 0) {
          const bool weighted = !g.weights_used_by(v).empty();
          GemmShape s{1, w.out_shape.back(), 0, 1};
          // With weights every leading dimension is a row; between activations the one before
          // the last is, and those before it are the batch.
          const size_t lead = w.out_shape.size() - 1;
          const size_t rows_from = weighted ? 0 : lead - 1;
          for (size_t d = 0; d < lead; ++d) (d >= rows_from ? s.m : s.batch) *= w.out_shape[d];
          s.k = std::max(1.0, w.flops / (2 * s.m * s.n * s.batch));
          const auto& d = cluster.device;
          p.forward = d.gemm_seconds(s, precision);
          const double input = d.gemm_seconds(input_gradient_gemm(s), precision);
          const double other = d.gemm_seconds(weight_gradient_gemm(s), precision);
          p.backward_input = weighted ? input : input + other;
          p.backward_weight = weighted ? other : 0;
          break;
        }
        [[fallthrough]];
      case OpKind::conv:
        p.forward = gemm(w.flops);
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
        p.forward = p.backward_input = stream(2 * w.in_elements, 4);
        break;
      case OpKind::reduce:
        p.forward = stream(2 * w.in_elements, act_bytes);
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
    const NodeComm& c = comm[size_t(v)];
    p.forward += c.inside + c.forward_edges;
    p.backward_input += c.inside + c.backward_edges;
    p.recompute = p.forward;
  }
  return out;
}

namespace {

void copy_sync(const std::vector<NodeComm>& comm, std::vector<double>* step_sync) {
  if (step_sync == nullptr) return;
  step_sync->clear();
  for (const NodeComm& c : comm) step_sync->push_back(c.step_sync);
}

}  // namespace

std::vector<NodeWork> node_work(const OpGraph& g, const ShardingSolution& sharding, int t) {
  TESSEL_CHECK(sharding.chosen.size() == size_t(g.size()), InvalidArgumentError,
               "operator_times: a sharding of {} nodes for a graph of {}", sharding.chosen.size(),
               g.size());
  std::vector<NodeWork> out(size_t(g.size()));
  for (int v = 0; v < g.size(); ++v) {
    const OpStrategy& s = sharding.chosen[size_t(v)];
    const OpNode& node = g.node(v);
    out[size_t(v)].flops = s.flops;
    out[size_t(v)].out_elements = on_device(node.shape, s.out, t);
    for (const int64_t d : node.shape) out[size_t(v)].out_shape.push_back(double(d));
    if (s.out.kind == Shard::Kind::split && s.out.dim >= 0 && size_t(s.out.dim) < node.shape.size())
      out[size_t(v)].out_shape[size_t(s.out.dim)] /= t;
    if (!node.inputs.empty() && !s.in.empty())
      out[size_t(v)].in_elements = on_device(g.node(node.inputs[0]).shape, s.in[0], t);
  }
  return out;
}

std::vector<NodeWork> node_work(const OpGraph& g, const MeshSolution& sharding, const Mesh& mesh) {
  TESSEL_CHECK(sharding.chosen.size() == size_t(g.size()), InvalidArgumentError,
               "operator_times: a mesh sharding of {} nodes for a graph of {}",
               sharding.chosen.size(), g.size());
  auto held = [&](const std::vector<int64_t>& shape, const MeshLayout& layout) {
    double n = double(elements(shape));
    for (size_t a = 0; a < layout.size() && a < mesh.sizes.size(); ++a)
      if (layout[a].kind == Shard::Kind::split) n /= mesh.sizes[a];
    return n;
  };
  std::vector<NodeWork> out(size_t(g.size()));
  for (int v = 0; v < g.size(); ++v) {
    const MeshStrategy& s = sharding.chosen[size_t(v)];
    const OpNode& node = g.node(v);
    out[size_t(v)].flops = s.flops;
    if (s.axis.empty()) {  // data entering the graph without a strategy: held whole
      out[size_t(v)].out_elements = double(elements(node.shape));
      continue;
    }
    out[size_t(v)].out_elements = held(node.shape, s.out());
    for (const int64_t d : node.shape) out[size_t(v)].out_shape.push_back(double(d));
    const MeshLayout layout = s.out();
    for (size_t a = 0; a < layout.size() && a < mesh.sizes.size(); ++a)
      if (layout[a].kind == Shard::Kind::split && layout[a].dim >= 0 &&
          size_t(layout[a].dim) < node.shape.size())
        out[size_t(v)].out_shape[size_t(layout[a].dim)] /= mesh.sizes[a];
    if (!node.inputs.empty() && !s.axis[0].in.empty())
      out[size_t(v)].in_elements = held(g.node(node.inputs[0]).shape, s.in(0));
  }
  return out;
}

std::vector<PassTimes> operator_times(const OpGraph& g, const ShardingSolution& sharding, int t,
                                      const ClusterSpec& cluster, Precision precision,
                                      std::vector<double>* step_sync) {
  const auto work = node_work(g, sharding, t);
  const auto comm =
      node_comm(g, *one_axis_space(g, t, sharding_costs(cluster, precision)), sharding.index);
  copy_sync(comm, step_sync);
  return operator_times(g, work, comm, cluster, precision);
}

std::vector<PassTimes> operator_times(const OpGraph& g, const MeshSolution& sharding,
                                      const MeshCosts& costs, const ClusterSpec& cluster,
                                      Precision precision, std::vector<double>* step_sync) {
  const auto work = node_work(g, sharding, costs.mesh);
  const auto comm = node_comm(g, *mesh_space(g, costs), sharding.index);
  copy_sync(comm, step_sync);
  return operator_times(g, work, comm, cluster, precision);
}

std::vector<StageCosts> graph_stage_costs(const OpGraph& g, const std::vector<NodeWork>& work,
                                          const std::vector<PassTimes>& times,
                                          const std::vector<int>& stage_of, int stages,
                                          Precision precision) {
  const size_t n = size_t(g.size());
  TESSEL_CHECK(stages >= 1 && times.size() == n && work.size() == n &&
                   (stage_of.empty() || stage_of.size() == n),
               InvalidArgumentError,
               "graph_stage_costs: {} stages, {} times, {} strategies and {} stage entries for {} "
               "nodes",
               stages, times.size(), work.size(), stage_of.size(), n);
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
    const double held = work[size_t(v)].out_elements * bytes;
    c.activation_bytes += held;
    // Data entering the graph is loaded where it is read; a computed tensor crosses every
    // boundary between its stage and its last reader's.
    for (int b = stage(v); b < read_until[size_t(v)]; ++b) out[size_t(b)].output_bytes += held;
  }
  return out;
}

std::vector<StageCosts> graph_stage_costs(const OpGraph& g, const ShardingSolution& sharding,
                                          const std::vector<PassTimes>& times,
                                          const std::vector<int>& stage_of, int stages, int t,
                                          Precision precision) {
  return graph_stage_costs(g, node_work(g, sharding, t), times, stage_of, stages, precision);
}

}  // namespace tessel::planner
