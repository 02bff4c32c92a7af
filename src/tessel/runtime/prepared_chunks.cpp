#include "tessel/runtime/prepared_chunks.h"

#include <algorithm>
#include <string>

#include "tessel/core/check.h"
#include "tessel/layout/zero_split.h"
#include "tessel/runtime/pipeline_executor.h"

namespace tessel::runtime {

using config::TrainConfig;

namespace {

// Stands in for a tensor-parallel group that does not exist yet: it has the rank and size the
// model's shard shapes depend on, and no collective may run through it.
class UnboundTpGroup final : public model::TpGroup {
 public:
  UnboundTpGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(float*, size_t) override { unbound(); }
  void all_reduce_max(float*, size_t) override { unbound(); }

 private:
  [[noreturn]] static void unbound() {
    TESSEL_THROW(InvalidArgumentError,
                 "a model prepared ahead of a switch ran a tensor-parallel collective before the "
                 "switch bound it to its communicators (rebind_tp_group)");
  }
  int rank_, size_;
};

}  // namespace

PreparedChunks prepare_chunks(const TrainConfig& cfg, const layout::Plan& p, int rank,
                              std::shared_ptr<kernels::Backend> backend,
                              const std::vector<bool>& skip) {
  const layout::Plan plan = p.with_defaults(cfg.model);
  const layout::Coord coord = plan.coord_of(rank);
  const auto peaks = activation_slots(plan, coord.pp);
  const auto ranges = plan.stage_ranges(cfg.model);
  PreparedChunks out;
  out.backend = std::move(backend);
  if (plan.tp > 1) out.unbound_tp = std::make_unique<UnboundTpGroup>(coord.tp, plan.tp);
  const auto n_chunks = size_t(plan.virtual_stages);
  out.models.resize(n_chunks);
  out.adam_m.resize(n_chunks);
  out.adam_v.resize(n_chunks);
  for (size_t c = 0; c < n_chunks; ++c) {
    if (c < skip.size() && skip[c]) continue;
    auto m = std::make_unique<model::Transformer>(cfg.model, *out.backend, int(plan.micro_batch),
                                                  int(cfg.data.seq_len),
                                                  ranges[size_t(plan.stage_of(coord.pp, int(c)))],
                                                  out.unbound_tp.get(), peaks[c], plan.recompute);
    if (plan.split_backward()) m->set_split_backward(true);
    int64_t n = m->num_params();
    if (plan.zero_stage == 1) n = layout::zero_split(n, plan.dp, coord.dp).n_own;
    out.adam_m[c] = Tensor::zeros({std::max<int64_t>(n, 1)});
    out.adam_v[c] = Tensor::zeros({std::max<int64_t>(n, 1)});
    out.models[c] = std::move(m);
  }
  return out;
}

}  // namespace tessel::runtime
