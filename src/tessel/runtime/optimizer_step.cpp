#include "tessel/runtime/optimizer_step.h"

#include <algorithm>
#include <cmath>

namespace tessel::runtime {

OptimizerStep::OptimizerStep(Stage& stage, const layout::Plan& plan, comm::ProcessGroups& groups,
                             kernels::Backend& backend, double bucket_mb)
    : stage_(stage), plan_(plan), groups_(groups), backend_(backend) {
  if (plan.dp > 1 && plan.zero_stage == 0) {
    const auto bucket = std::max<int64_t>(1, int64_t(bucket_mb * (1 << 20) / sizeof(float)));
    grad_reduce_ = std::make_unique<comm::BucketedAllReduce>(*groups.dp_grad, bucket);
    for (auto& ch : stage.chunks())
      bucket_ids_.push_back(
          grad_reduce_->add_buffer(ch.model->grads().data<float>(), ch.model->num_params()));
  }
}

model::Transformer::GradsReady OptimizerStep::on_last_backward(int chunk) {
  if (!grad_reduce_) return {};
  const int id = bucket_ids_[size_t(chunk)];
  return [this, id](int64_t from) { grad_reduce_->ready_from(id, from); };
}

double OptimizerStep::reduce_gradients() {
  // Each replica's loss gradient is already divided by the global count of valid tokens, so the
  // sum over dp is the global mean's gradient.
  const bool zero = plan_.zero_stage == 1;
  if (grad_reduce_) grad_reduce_->finish();
  double sq = 0;
  for (auto& ch : stage_.chunks()) {
    float* grads = ch.model->grads().data<float>();
    const auto& views = ch.model->param_views();
    if (zero) {
      if (ch.tied_view >= 0) {
        const auto& v = views[size_t(ch.tied_view)];
        float* g = grads + v.offset;
        groups_.embed->all_reduce_sum(g, size_t(v.numel));
        // The two pipeline ends hold the tied embedding at different offsets of their flat
        // buffers, so the reduce-scatter below would add its dp contributions in different orders
        // on the two (dp >= 3) and the copies would drift apart in the last bits. Reduce it over
        // dp on its own instead (the same ring on both ends, so the same bits) and leave only dp
        // rank 0's sum in the buffer: adding zeros is exact in any order. (With dp 2 both orders
        // are a + b = b + a, exact: nothing to do.)
        if (plan_.dp >= 3) {
          groups_.dp->all_reduce_sum(g, size_t(v.numel));
          if (groups_.coord.dp != 0) std::fill(g, g + v.numel, 0.0f);
        }
      }
      groups_.dp->reduce_scatter_sum(grads, ch.dp_counts);
    } else if (ch.tied_view >= 0) {
      const auto& v = views[size_t(ch.tied_view)];
      groups_.embed->all_reduce_sum(grads + v.offset, size_t(v.numel));
    }
    const int64_t lo = ch.own_lo, hi = ch.own_lo + ch.own_n;
    for (size_t i = 0; i < views.size(); ++i) {
      if (!views[i].tp_primary || (ch.tied_copy && int(i) == ch.tied_view)) continue;
      const int64_t a = std::max(lo, views[i].offset);
      const int64_t b = std::min(hi, views[i].offset + views[i].numel);
      if (b > a) sq += backend_.sum_of_squares(grads + a, b - a);
    }
  }
  // With ZeRO-1 each dp rank counted a distinct range, so the norm also sums over dp.
  if (zero) groups_.dp->all_reduce_sum(&sq, 1);
  groups_.tp->all_reduce_sum(&sq, 1);
  groups_.pp->all_reduce_sum(&sq, 1);
  return std::sqrt(sq);
}

void OptimizerStep::apply(kernels::AdamWConfig opt, float weight_decay) {
  const bool zero = plan_.zero_stage == 1;
  updating_ = true;
  for (auto& ch : stage_.chunks()) {
    float* params = ch.model->params().data<float>();
    float* grads = ch.model->grads().data<float>();
    const int64_t lo = ch.own_lo, hi = ch.own_lo + ch.own_n;
    for (const auto& v : ch.model->param_views()) {
      const int64_t a = std::max(lo, v.offset), b = std::min(hi, v.offset + v.numel);
      if (b <= a) continue;
      opt.weight_decay = v.weight_decay ? weight_decay : 0.0f;
      backend_.adamw_update(params + a, grads + a, ch.adam_m.data<float>() + (a - lo),
                            ch.adam_v.data<float>() + (a - lo), b - a, opt);
    }
    if (zero) {
      // The other ranges hold partial sums of the reduce-scatter: clear them for the next step.
      std::fill(grads, grads + ch.model->num_params(), 0.0f);
      groups_.dp->all_gather_v(params + lo, ch.dp_counts, params);
    }
  }
  updating_ = false;
}

}  // namespace tessel::runtime
