#include "tessel/model/stage_range.h"

#include "tessel/core/check.h"

namespace tessel::model {

StageRange StageRange::layers(const ModelConfig& config, int begin, int end) {
  return StageRange{begin, end, begin == 0, end == config.n_layer}.resolved(config);
}

StageRange StageRange::resolved(const ModelConfig& config) const {
  StageRange r = *this;
  if (r.layer_end == -1) r.layer_end = config.n_layer;
  const int L = config.n_layer;
  TESSEL_CHECK(0 <= r.layer_begin && r.layer_begin <= r.layer_end && r.layer_end <= L, ConfigError,
               "stage layers [{}, {}) are not a range inside the {} layers of model '{}'; use "
               "0 <= begin <= end <= {}",
               r.layer_begin, r.layer_end, L, config.name, L);
  TESSEL_CHECK(!r.has_embedding || r.layer_begin == 0, ConfigError,
               "a stage holding the embedding must start at layer 0, not {}", r.layer_begin);
  TESSEL_CHECK(!r.has_head || r.layer_end == L, ConfigError,
               "a stage holding the head must end at the last layer ({}), not {}", L, r.layer_end);
  TESSEL_CHECK(r.num_layers() > 0 || r.has_embedding || r.has_head, ConfigError,
               "stage [{}, {}) of model '{}' holds nothing: give it layers, the embedding or the "
               "head",
               r.layer_begin, r.layer_end, config.name);
  return r;
}

bool StageRange::is_whole(const ModelConfig& config) const {
  const StageRange r = resolved(config);
  return r.layer_begin == 0 && r.layer_end == config.n_layer && r.has_embedding && r.has_head;
}

}  // namespace tessel::model
