#include "tessel/checkpoint/initialised_checkpoint.h"

#include <algorithm>
#include <vector>

#include "tessel/config/model_json.h"
#include "tessel/model/init.h"
#include "tessel/model/model_spec.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::checkpoint {

uint64_t write_initialised_checkpoint(const model::ModelConfig& model, uint64_t seed,
                                      const std::string& out_dir) {
  const model::ModelSpec spec = model::ModelSpec::from(model);
  store::CheckpointWriter writer(out_dir, 0);
  uint64_t bytes = 0;
  // One scratch buffer for every parameter (the writer produces them one after another): a
  // buffer per producer would live as long as the writer, one chunk per parameter in all.
  std::vector<float> buf;
  for (const auto& p : spec) {
    const int64_t rows = p.shape.rank() == 0 ? 1 : p.shape[0];
    const int64_t row = p.numel() / std::max<int64_t>(1, rows);
    writer.add_streamed(
        p.name, DType::f32, p.shape, Box::of(p.shape),
        [&p, seed, row, &buf](uint64_t offset, uint64_t n, void* out) {
          // Whole rows around elements [e0, e1): init_box generates any box alone, bit-exactly.
          const int64_t e0 = int64_t(offset / sizeof(float)), e1 = e0 + int64_t(n / sizeof(float));
          const int64_t r0 = e0 / row, r1 = (e1 + row - 1) / row;
          std::vector<int64_t> lo(p.shape.rank(), 0), hi = p.shape.dims();
          if (!lo.empty()) lo[0] = r0, hi[0] = r1;
          buf.resize(size_t((r1 - r0) * row));
          model::init_box(p, seed, Box(lo, hi), buf.data());
          std::copy_n(buf.data() + (e0 - r0 * row), n / sizeof(float), static_cast<float*>(out));
        });
    bytes += uint64_t(p.numel()) * sizeof(float);
  }
  writer.write_rank_file();
  writer.commit(1, {{"model", config::to_json(model)},
                    {"step", 0},
                    {"source", {{"format", "init"}, {"seed", seed}}}});
  return bytes;
}

}  // namespace tessel::checkpoint
