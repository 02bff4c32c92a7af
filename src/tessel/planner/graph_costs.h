// What one micro-batch costs in each operator of a sharded graph, per pass, on one device (of the
// tensor-parallel axis, or of a 2-axis mesh: mesh_sharding.h), and the per-stage costs the pipeline
// simulator runs (issue 20: the graph planner's step prediction, graph_plan.h). The rates and the
// rules are the layer planner's (cost_model.h), applied per operator, so that a transformer's graph
// and its layers predict the same step:
//   matmul with weights         F, Bi and Bw one GEMM each: the forward's, over the output on one
//                               device (the leading dimensions as rows, the last as columns, the
//                               contraction from the FLOPs), and its two gradients'
//                               (DeviceSpec::gemm_seconds: by shape on the A100 and H100,
//                               gemm_model.h, else the efficiency curve on the FLOPs)
//   conv                        F, Bi and Bw one GEMM of the strategy's FLOPs each (the curve)
//   matmul of two activations   F one batched GEMM (the dimensions before the last two as the
//   (attention's q k^T, p v)    batch), Bi both operands' gradients, no Bw
//   memory-bound operators      stream elements through the device's memory bandwidth, in the
//                               precision's element size, forward; Bi twice that (read the
//                               gradient and the saved input, write the input's gradient):
//     norms, softmax, activation functions, rope, reduce, other   2 per element (read, write)
//     add, mul of two tensors                                      3 (read 2, write 1)
//     gather (embedding)          1 forward (write), no Bi, Bw 2 (scatter-add)
//     loss                        2 per logit forward and again in Bi, in fp32
//   free                          reshape, transpose, split, concat (views, or copies folded into
//                                 their consumer) and a mul by a constant (one input: the
//                                 attention's scale, fused into the softmax as Megatron-LM's
//                                 scale-mask-softmax does); inputs.
//   An operator's elements are those of its output on one device (of its first input for a loss
//   or a reduce): a split tensor's 1/t, a replicated or partial one's all.
// Communication on the tp axis (sharding_ilp.h): each edge's forward layout change on the
// consumer's F, its backward change on the consumer's Bi; a strategy's own collectives once in F
// and once in Bi. The all-reduce of the gradient of a weight a batch split keeps replicated runs
// once per step, after the last micro-batch's backward (as data parallelism's does), so it is
// not a pass's: `step_sync` gets it per node.
// The recompute pass is the forward.
#pragma once

#include <vector>

#include "tessel/planner/cluster.h"
#include "tessel/planner/cost_model.h"
#include "tessel/planner/mesh_sharding.h"
#include "tessel/planner/op_graph.h"
#include "tessel/planner/sharding_ilp.h"
#include "tessel/planner/sharding_programme.h"
#include "tessel/planner/simulator.h"

namespace tessel::planner {

// The tensor-parallel axis's rates for the sharding programme: the device's peak in `precision`
// at its large-GEMM efficiency (ClusterSpec's gemm.max_efficiency, the saturated rate of the cost
// model's curve), the intra-host link's collective bandwidth and latency, elements of the
// precision's size, 16 bytes of training state per weight (fp32: weight, gradient, Adam's m and v;
// mixed: 2-byte weight and gradient, fp32 master copy, m and v), the device's usable memory. Throws
// ConfigError when the device has no rate for the precision.
ShardingCosts sharding_costs(const ClusterSpec& cluster, Precision precision);

// What the pass times need of each node's strategy besides its communication: its FLOPs per
// device and the elements each device holds of its output and of its first input.
struct NodeWork {
  double flops = 0, out_elements = 0, in_elements = 0;
  std::vector<double> out_shape;  // the output's extent on one device, per dimension
};
std::vector<NodeWork> node_work(const OpGraph& graph, const ShardingSolution& sharding, int t);
std::vector<NodeWork> node_work(const OpGraph& graph, const MeshSolution& sharding,
                                const Mesh& mesh);

// Per node, its times per micro-batch (the rules above) from its work and its communication
// (sharding_programme.h's node_comm; its step_sync is not a pass's). Throws InvalidArgumentError
// when sizes disagree and ConfigError when the device has no rate for the precision.
std::vector<PassTimes> operator_times(const OpGraph& graph, const std::vector<NodeWork>& work,
                                      const std::vector<NodeComm>& comm, const ClusterSpec& cluster,
                                      Precision precision);

// The same under a one-axis solution on t devices (its rates: sharding_costs) or a mesh solution
// (its costs), and in *step_sync (when given) per node its once-per-step weight-gradient
// all-reduces. Throws InvalidArgumentError when the solution has no strategy for a node.
std::vector<PassTimes> operator_times(const OpGraph& graph, const ShardingSolution& sharding, int t,
                                      const ClusterSpec& cluster, Precision precision,
                                      std::vector<double>* step_sync = nullptr);
std::vector<PassTimes> operator_times(const OpGraph& graph, const MeshSolution& sharding,
                                      const MeshCosts& costs, const ClusterSpec& cluster,
                                      Precision precision,
                                      std::vector<double>* step_sync = nullptr);

// Per stage (stage_of: per node, in [0, stages); empty puts every node on stage 0): the sums of
// its operators' times; activation_bytes, the outputs of its operators on one device (what its
// backward reads, roughly); output_bytes, the tensors on one device produced at or before the
// stage and read after it (what the boundary carries forward, and their gradients back).
// Throws InvalidArgumentError when sizes disagree or a stage is out of range.
std::vector<StageCosts> graph_stage_costs(const OpGraph& graph, const std::vector<NodeWork>& work,
                                          const std::vector<PassTimes>& times,
                                          const std::vector<int>& stage_of, int stages,
                                          Precision precision);
std::vector<StageCosts> graph_stage_costs(const OpGraph& graph, const ShardingSolution& sharding,
                                          const std::vector<PassTimes>& times,
                                          const std::vector<int>& stage_of, int stages, int t,
                                          Precision precision);

}  // namespace tessel::planner
