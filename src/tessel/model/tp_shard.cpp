#include "tessel/model/tp_shard.h"

#include <algorithm>

#include "tessel/core/check.h"

namespace tessel::model {

void validate_tp(const ModelConfig& config, int tp) {
  const std::string_view n = config.name.empty() ? std::string_view("<unnamed>") : config.name;
  TESSEL_CHECK(tp >= 1, ConfigError, "tensor-parallel size tp is {}; it must be >= 1", tp);
  if (tp == 1) return;
  TESSEL_CHECK(config.n_head % tp == 0, ConfigError,
               "model '{}': tp = {} does not divide n_head = {}; tensor parallelism splits the "
               "attention heads, choose a tp dividing n_head",
               n, tp, config.n_head);
  TESSEL_CHECK(config.ffn_hidden % tp == 0, ConfigError,
               "model '{}': tp = {} does not divide ffn_hidden = {}; choose a tp dividing it", n,
               tp, config.ffn_hidden);
  TESSEL_CHECK(config.padded_vocab() % tp == 0, ConfigError,
               "model '{}': tp = {} does not divide the padded vocabulary {} (a multiple of 128); "
               "choose a power of two tp <= 128",
               n, tp, config.padded_vocab());
  TESSEL_CHECK(config.n_kv_head % tp == 0 || tp % config.n_kv_head == 0, ConfigError,
               "model '{}': tp = {} neither divides n_kv_head = {} (kv heads split) nor is a "
               "multiple of it (kv heads replicated); choose such a tp",
               n, tp, config.n_kv_head);
}

TpHeads tp_heads(const ModelConfig& config, int tp_rank, int tp_size) {
  validate_tp(config, tp_size);
  TESSEL_CHECK(tp_rank >= 0 && tp_rank < tp_size, InvalidArgumentError,
               "tp rank {} is outside [0, {})", tp_rank, tp_size);
  TpHeads h;
  h.q_heads = config.n_head / tp_size;
  h.q_begin = tp_rank * h.q_heads;
  if (config.n_kv_head % tp_size == 0) {
    h.kv_heads = config.n_kv_head / tp_size;
    h.kv_begin = tp_rank * h.kv_heads;
  } else {
    // tp is a multiple of Hkv: the rank's q heads all fall in one group of Hq / Hkv heads, i.e.
    // use one kv head, (q_begin) / (Hq / Hkv) = r Hkv / tp.
    h.kv_heads = 1;
    h.kv_begin = tp_rank * config.n_kv_head / tp_size;
    h.kv_replicated = true;
  }
  return h;
}

TpVocabRange tp_vocab_range(const ModelConfig& config, int tp_rank, int tp_size) {
  validate_tp(config, tp_size);
  TESSEL_CHECK(tp_rank >= 0 && tp_rank < tp_size, InvalidArgumentError,
               "tp rank {} is outside [0, {})", tp_rank, tp_size);
  const int rows = config.padded_vocab() / tp_size;
  return {tp_rank * rows, rows};
}

namespace {

// Rows [lo, hi) of dim 0 with every other dimension whole.
Box row_range(const Shape& shape, int64_t lo, int64_t hi) {
  std::vector<int64_t> blo(shape.rank(), 0), bhi(shape.dims().begin(), shape.dims().end());
  blo[0] = lo;
  bhi[0] = hi;
  return Box(blo, bhi);
}

// The pieces of an even dim-0 split.
std::vector<ShardPiece> dim0_slice(const ParamSpec& spec, int64_t lo, int64_t rows) {
  return {{row_range(spec.shape, lo, lo + rows), row_range(spec.shape, 0, rows)}};
}

void check_divisible(const ParamSpec& spec, size_t dim, int64_t parts) {
  TESSEL_CHECK(spec.shape.rank() > dim && spec.shape[dim] % parts == 0, InvalidArgumentError,
               "tensor '{}' of shape {} cannot be split {} ways along dim {} ({} split)", spec.name,
               spec.shape.str(), parts, dim, tp_split_name(spec.split));
}

}  // namespace

std::vector<ShardPiece> tp_shard_pieces(const ParamSpec& spec, const ModelConfig& config,
                                        int tp_rank, int tp_size) {
  validate_tp(config, tp_size);
  TESSEL_CHECK(tp_rank >= 0 && tp_rank < tp_size, InvalidArgumentError,
               "tp rank {} is outside [0, {})", tp_rank, tp_size);
  const Box whole = Box::of(spec.shape);
  if (tp_size == 1 || spec.split == TpSplit::replicated) return {{whole, whole}};
  const int64_t tp = tp_size, r = tp_rank;
  switch (spec.split) {
    case TpSplit::replicated:
      break;
    case TpSplit::column:
    case TpSplit::vocab: {
      check_divisible(spec, 0, tp);
      const int64_t rows = spec.shape[0] / tp;
      return dim0_slice(spec, r * rows, rows);
    }
    case TpSplit::row: {
      TESSEL_CHECK(spec.shape.rank() == 2, InvalidArgumentError,
                   "row-parallel tensor '{}' must be a matrix, got shape {}", spec.name,
                   spec.shape.str());
      check_divisible(spec, 1, tp);
      const int64_t R = spec.shape[0], cols = spec.shape[1] / tp;
      return {{Box({0, r * cols}, {R, (r + 1) * cols}), Box({0, 0}, {R, cols})}};
    }
    case TpSplit::qkv_fused_per_head: {
      check_divisible(spec, 0, 3 * tp);
      const int64_t section = spec.shape[0] / 3, rows = section / tp;
      std::vector<ShardPiece> pieces;
      for (int64_t s = 0; s < 3; ++s) {
        pieces.push_back(
            {row_range(spec.shape, s * section + r * rows, s * section + (r + 1) * rows),
             row_range(spec.shape, s * rows, (s + 1) * rows)});
      }
      return pieces;
    }
    case TpSplit::kv_heads: {
      const TpHeads h = tp_heads(config, tp_rank, tp_size);
      check_divisible(spec, 0, config.n_kv_head);
      const int64_t D = spec.shape[0] / config.n_kv_head;
      return dim0_slice(spec, int64_t(h.kv_begin) * D, int64_t(h.kv_heads) * D);
    }
  }
  return {{whole, whole}};
}

Shape tp_local_shape(const ParamSpec& spec, const ModelConfig& config, int tp_rank, int tp_size) {
  const std::vector<ShardPiece> pieces = tp_shard_pieces(spec, config, tp_rank, tp_size);
  // The local boxes tile the shard, which starts at the origin: its shape is their bounding box.
  std::vector<int64_t> hi(spec.shape.rank(), 0);
  for (const ShardPiece& p : pieces) {
    for (size_t d = 0; d < hi.size(); ++d) hi[d] = std::max(hi[d], p.local.hi(d));
  }
  return Shape(hi);
}

int tp_copies(const ParamSpec& spec, const ModelConfig& config, int tp_size) {
  validate_tp(config, tp_size);
  if (spec.split == TpSplit::replicated) return tp_size;
  if (spec.split == TpSplit::kv_heads && config.n_kv_head % tp_size != 0) {
    return tp_size / config.n_kv_head;
  }
  return 1;
}

bool tp_is_primary(const ParamSpec& spec, const ModelConfig& config, int tp_rank, int tp_size) {
  TESSEL_CHECK(tp_rank >= 0 && tp_rank < tp_size, InvalidArgumentError,
               "tp rank {} is outside [0, {})", tp_rank, tp_size);
  // Copies of one element sit on consecutive ranks (all ranks when replicated).
  return tp_rank % tp_copies(spec, config, tp_size) == 0;
}

}  // namespace tessel::model
