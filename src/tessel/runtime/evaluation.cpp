#include "tessel/runtime/evaluation.h"

#include <algorithm>
#include <deque>

#include "tessel/core/check.h"
#include "tessel/model/transformer.h"

namespace tessel::runtime {

std::vector<int64_t> eval_samples(int64_t available, int64_t eval_batches, int64_t micro_batch) {
  TESSEL_CHECK(available > 0, ConfigError,
               "no held-out samples to evaluate on; set data.eval_fraction > 0 (or "
               "training.eval_every: 0)");
  std::vector<int64_t> out;
  for (int64_t b = 0; b < eval_batches; ++b) {
    const int64_t first = (b * micro_batch) % available;
    const int64_t count = std::min(micro_batch, available - first);
    for (int64_t i = 0; i < count; ++i) out.push_back(first + i);
  }
  return out;
}

void load_eval_batch(const data::BatchLoader& loader, const std::vector<int64_t>& samples,
                     int64_t j, int64_t batch, int64_t seq_len, int32_t* inputs, int32_t* targets) {
  std::fill(inputs, inputs + batch * seq_len, 0);
  std::fill(targets, targets + batch * seq_len, model::Transformer::kIgnoreIndex);
  for (int64_t i = 0; i < batch && j * batch + i < int64_t(samples.size()); ++i)
    loader.load_eval(samples[size_t(j * batch + i)], 1, inputs + i * seq_len,
                     targets + i * seq_len);
}

EvalSums evaluate_stage(Stage& stage, comm::Communicator& pp, const layout::Plan& plan, int pp_rank,
                        int dp_rank, const std::vector<int64_t>& samples,
                        const data::BatchLoader& loader, int64_t seq_len, int64_t hidden) {
  const int64_t B = plan.micro_batch, T = seq_len;
  const int64_t batches = (int64_t(samples.size()) + B - 1) / B;
  const int stages = plan.num_stages();
  const size_t boundary = size_t(B * T * hidden);
  std::vector<int32_t> inputs(size_t(B * T)), targets(inputs.size());
  std::deque<std::vector<float>> send_buffers;
  std::vector<comm::Request> sends;
  EvalSums sums;
  for (int64_t j = dp_rank; j < batches; j += plan.dp) {
    load_eval_batch(loader, samples, j, B, T, inputs.data(), targets.data());
    for (int c = 0; c < plan.virtual_stages; ++c) {
      Chunk& ch = stage.chunks()[size_t(c)];
      auto& m = *ch.model;
      const int vs = plan.stage_of(pp_rank, c);
      // Tags: (micro-batch, receiving stage); no training transfer is pending between steps.
      const auto tag = uint32_t(j * stages + vs);
      // The turn of zb-v's V: the previous virtual stage is this rank's other chunk, whose
      // output was copied in below.
      const bool local_prev = vs > 0 && plan.pp_rank_of_stage(vs - 1) == pp_rank;
      if (vs > 0 && !local_prev)
        pp.recv(m.input_hidden(0).data<float>(), boundary * sizeof(float),
                plan.pp_rank_of_stage(vs - 1), tag)
            .wait();
      const auto r = m.forward_stage(ch.range.has_embedding ? inputs.data() : nullptr,
                                     ch.range.has_head ? targets.data() : nullptr, std::nullopt, 0);
      if (ch.range.has_head) {
        sums.loss_sum += r.loss_sum;
        sums.valid += r.valid;
      }
      if (vs + 1 < stages && plan.pp_rank_of_stage(vs + 1) == pp_rank) {
        const float* out = m.output_hidden(0).data<float>();
        Chunk& next = stage.chunks()[size_t(plan.chunk_of_stage(vs + 1))];
        std::copy(out, out + boundary, next.model->input_hidden(0).data<float>());
      } else if (vs + 1 < stages) {
        const float* out = m.output_hidden(0).data<float>();
        send_buffers.emplace_back(out, out + boundary);
        sends.push_back(pp.send(send_buffers.back().data(), boundary * sizeof(float),
                                plan.pp_rank_of_stage(vs + 1), uint32_t(j * stages + vs + 1)));
      }
    }
  }
  for (auto& s : sends) s.wait();
  return sums;
}

}  // namespace tessel::runtime
