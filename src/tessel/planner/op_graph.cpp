#include "tessel/planner/op_graph.h"

#include <fmt/format.h>

#include <queue>
#include <set>

#include "tessel/core/check.h"

namespace tessel::planner {

std::string_view op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::input:
      return "input";
    case OpKind::gather:
      return "gather";
    case OpKind::matmul:
      return "matmul";
    case OpKind::add:
      return "add";
    case OpKind::mul:
      return "mul";
    case OpKind::layer_norm:
      return "layer_norm";
    case OpKind::rms_norm:
      return "rms_norm";
    case OpKind::softmax:
      return "softmax";
    case OpKind::gelu:
      return "gelu";
    case OpKind::silu:
      return "silu";
    case OpKind::rope:
      return "rope";
    case OpKind::reshape:
      return "reshape";
    case OpKind::transpose:
      return "transpose";
    case OpKind::split:
      return "split";
    case OpKind::concat:
      return "concat";
    case OpKind::reduce:
      return "reduce";
    case OpKind::conv:
      return "conv";
    case OpKind::loss:
      return "loss";
    case OpKind::other:
      return "other";
  }
  return "other";
}

int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int OpGraph::add(OpNode node) {
  nodes_.push_back(std::move(node));
  return int(nodes_.size()) - 1;
}

std::vector<int> OpGraph::validate() const {
  const int n = size();
  std::vector<int> waiting(size_t(n), 0);
  std::vector<std::vector<int>> readers(static_cast<size_t>(n));
  for (int id = 0; id < n; ++id) {
    for (int in : nodes_[size_t(id)].inputs) {
      TESSEL_CHECK(in >= 0 && in < n, CorruptDataError,
                   "operator graph: node {} ('{}') reads node {}, which does not exist ({} nodes)",
                   id, nodes_[size_t(id)].name, in, n);
      readers[size_t(in)].push_back(id);
      ++waiting[size_t(id)];
    }
    const int tied = nodes_[size_t(id)].weights_of;
    TESSEL_CHECK(tied < n && (tied < 0 || !nodes_[size_t(tied)].weights.empty()), CorruptDataError,
                 "operator graph: node {} ('{}') reads the weights of node {}, which has none", id,
                 nodes_[size_t(id)].name, tied);
  }
  // Kahn's algorithm; lower ids first among the ready, so a graph added in order keeps it.
  std::priority_queue<int, std::vector<int>, std::greater<>> ready;
  for (int id = 0; id < n; ++id)
    if (waiting[size_t(id)] == 0) ready.push(id);
  std::vector<int> order;
  order.reserve(size_t(n));
  while (!ready.empty()) {
    const int id = ready.top();
    ready.pop();
    order.push_back(id);
    for (int r : readers[size_t(id)])
      if (--waiting[size_t(r)] == 0) ready.push(r);
  }
  if (int(order.size()) < n) {
    // Every node left waits on another left: follow inputs until one repeats, which is a cycle.
    int at = 0;
    while (waiting[size_t(at)] == 0) ++at;
    std::vector<int> seen(size_t(n), -1);
    std::vector<int> path;
    while (seen[size_t(at)] < 0) {
      seen[size_t(at)] = int(path.size());
      path.push_back(at);
      for (int in : nodes_[size_t(at)].inputs)
        if (waiting[size_t(in)] > 0) {
          at = in;
          break;
        }
    }
    std::string cycle;
    for (size_t i = size_t(seen[size_t(at)]); i < path.size(); ++i)
      cycle += fmt::format("{}'{}' <- ", cycle.empty() ? "" : "", nodes_[size_t(path[i])].name);
    cycle += fmt::format("'{}'", nodes_[size_t(at)].name);
    TESSEL_THROW(CorruptDataError,
                 "operator graph: {} of {} nodes are on or behind a cycle, e.g. {}; a model's "
                 "forward graph has none",
                 n - int(order.size()), n, cycle);
  }
  return order;
}

std::vector<int> OpGraph::critical_nodes() const {
  return critical_in(validate());
}

std::vector<std::vector<OpGraph::Read>> OpGraph::readers() const {
  std::vector<std::vector<Read>> out(nodes_.size());
  for (int v = 0; v < size(); ++v)
    for (size_t k = 0; k < nodes_[size_t(v)].inputs.size(); ++k)
      out[size_t(nodes_[size_t(v)].inputs[k])].push_back({v, k});
  return out;
}

std::vector<std::vector<int>> OpGraph::segments() const {
  const std::vector<int> order = validate();
  const auto critical = critical_in(order);
  const std::set<int> is_critical(critical.begin(), critical.end());
  std::vector<std::vector<int>> out(1);
  for (int v : order) {
    if (nodes_[size_t(v)].kind == OpKind::input) continue;
    out.back().push_back(v);
    if (is_critical.contains(v)) out.emplace_back();
  }
  if (out.back().empty()) out.pop_back();
  return out;
}

std::vector<int> OpGraph::critical_in(const std::vector<int>& order) const {
  const int n = size();
  std::vector<int> at(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) at[size_t(order[size_t(i)])] = i;
  // furthest[i]: the last position an edge from the computing node at position i reaches.
  std::vector<int> out;
  std::vector<int> furthest(static_cast<size_t>(n), -1);
  for (int v = 0; v < n; ++v)
    for (int u : nodes_[size_t(v)].inputs)
      if (nodes_[size_t(u)].kind != OpKind::input)
        furthest[size_t(at[size_t(u)])] = std::max(furthest[size_t(at[size_t(u)])], at[size_t(v)]);
  bool started = false;
  int reach = -1;  // over the computing nodes before position i
  for (int i = 0; i < n; ++i) {
    const int v = order[size_t(i)];
    if (nodes_[size_t(v)].kind == OpKind::input) continue;
    // Critical: every earlier computing node's edges end at or before it.
    if (started && reach <= i) out.push_back(v);
    started = true;
    reach = std::max(reach, furthest[size_t(i)]);
  }
  return out;
}

double OpGraph::total_flops() const {
  double f = 0;
  for (const auto& node : nodes_) f += node.flops;
  return f;
}

int64_t OpGraph::total_parameters() const {
  int64_t p = 0;
  for (const auto& node : nodes_)
    for (const auto& w : node.weights) p += elements(w);
  return p;
}

}  // namespace tessel::planner
