#include "tessel/layout/state_layout.h"

#include <algorithm>
#include <map>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/layout/zero_split.h"
#include "tessel/model/tp_shard.h"
#include "tessel/tensor/box_copy.h"

namespace tessel::layout {

namespace {

// flat_range_boxes on dims [d, rank) of `shape`, with the leading dims fixed to `prefix_lo`
// (one index each).
void flat_boxes_from(const Shape& shape, size_t d, std::vector<int64_t>& prefix, int64_t begin,
                     int64_t end, std::vector<Box>& out) {
  if (begin >= end) return;
  const size_t rank = shape.rank();
  auto make = [&](int64_t lo0, int64_t hi0) {
    // dims < d fixed by prefix, dim d in [lo0, hi0), dims > d whole
    std::vector<int64_t> lo(rank, 0), hi(shape.dims().begin(), shape.dims().end());
    for (size_t i = 0; i < d; ++i) {
      lo[i] = prefix[i];
      hi[i] = prefix[i] + 1;
    }
    lo[d] = lo0;
    hi[d] = hi0;
    out.emplace_back(std::move(lo), std::move(hi));
  };
  if (d + 1 == rank) {
    make(begin, end);
    return;
  }
  int64_t inner = 1;
  for (size_t i = d + 1; i < rank; ++i) inner *= shape[i];
  int64_t r0 = begin / inner;
  const int64_t r1 = end / inner;
  auto partial = [&](int64_t row, int64_t b, int64_t e) {
    prefix.push_back(row);
    flat_boxes_from(shape, d + 1, prefix, b, e, out);
    prefix.pop_back();
  };
  if (r0 == r1) {  // inside one slice of dim d
    partial(r0, begin % inner, end % inner);
    return;
  }
  if (begin % inner != 0) {
    partial(r0, begin % inner, inner);
    ++r0;
  }
  if (r1 > r0) make(r0, r1);
  if (end % inner != 0) partial(r1, 0, end % inner);
}

}  // namespace

std::vector<Box> flat_range_boxes(const Shape& shape, int64_t begin, int64_t end) {
  TESSEL_CHECK(0 <= begin && end <= shape.numel(), InvalidArgumentError,
               "flat range [{}, {}) leaves an array of shape {} ({} elements)", begin, end,
               shape.str(), shape.numel());
  std::vector<Box> out;
  if (begin >= end) return out;
  if (shape.rank() == 0) {
    out.emplace_back(std::vector<int64_t>{}, std::vector<int64_t>{});
    return out;
  }
  std::vector<int64_t> prefix;
  flat_boxes_from(shape, 0, prefix, begin, end, out);
  return out;
}

StridedRegion StatePiece::region(const Box& sub) const {
  TESSEL_CHECK(global.contains(sub), InvalidArgumentError,
               "box {} is not inside the piece {} of tensor #{}", sub.str(), global.str(), tensor);
  StridedRegion r;
  r.offset = offset;
  for (size_t d = 0; d < global.rank(); ++d) r.offset += (sub.lo(d) - global.lo(d)) * strides[d];
  r.strides = strides;
  r.extents.resize(sub.rank());
  for (size_t d = 0; d < sub.rank(); ++d) r.extents[d] = sub.extent(d);
  return r;
}

namespace {

// One tensor's shard within a chunk's flat space.
struct ShardView {
  int tensor = 0;  // index into the whole model's spec
  Shape local;
  int64_t offset = 0;  // in the chunk's flat space
  std::vector<model::ShardPiece> pieces;
};

struct ChunkLayout {
  std::vector<ShardView> views;
  int64_t numel = 0;
};

ChunkLayout chunk_layout(const model::ModelSpec& whole, const model::StageRange& range, int tp_rank,
                         int tp_size) {
  const model::ModelConfig& config = whole.config();
  ChunkLayout c;
  for (const model::ParamSpec& p : whole.for_stage(range)) {
    ShardView v;
    v.tensor = whole.index_of(p.name);
    v.local = model::tp_local_shape(p, config, tp_rank, tp_size);
    v.offset = c.numel;
    v.pieces = model::tp_shard_pieces(p, config, tp_rank, tp_size);
    c.numel += v.local.numel();
    c.views.push_back(std::move(v));
  }
  return c;
}

size_t state_slot(int tensor, StateKind kind) {
  return size_t(tensor) * 4 + size_t(kind);
}

}  // namespace

StateLayout StateLayout::build(const model::ModelConfig& config, const Plan& plan_in,
                               const std::vector<StateKind>& kinds) {
  config.validate();
  const Plan plan = plan_in.with_defaults(config);
  TESSEL_CHECK(plan.dp >= 1 && plan.tp >= 1 && plan.pp >= 1 && plan.virtual_stages >= 1,
               ConfigError, "plan: dp {}, tp {}, pp {} and virtual_stages {} must all be >= 1",
               plan.dp, plan.tp, plan.pp, plan.virtual_stages);
  TESSEL_CHECK(plan.zero_stage == 0 || plan.zero_stage == 1, ConfigError,
               "plan: zero_stage is {}; layouts exist for 0 and 1", plan.zero_stage);
  model::validate_tp(config, plan.tp);
  TESSEL_CHECK(!(config.tie_embeddings && plan.pp == 1 && plan.num_stages() > 1), ConfigError,
               "plan: {} stages on pp 1 with tied embeddings would hold the token embedding twice "
               "on one rank; use virtual_stages 1 or pp >= 2",
               plan.num_stages());
  for (size_t i = 0; i < kinds.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      TESSEL_CHECK(kinds[i] != kinds[j], ConfigError, "state kind '{}' listed twice",
                   state_kind_name(kinds[i]));
    }
  }

  StateLayout L;
  L.spec_ = model::ModelSpec::from(config);
  L.plan_ = plan;
  L.kinds_ = kinds;
  const auto ranges = plan.stage_ranges(config);  // throws ConfigError for a bad cut

  std::map<std::pair<int, int>, ChunkLayout> cache;  // (stage, tp rank)
  const int world = plan.world();
  L.buffers_.resize(size_t(world));
  L.rank_begin_.push_back(0);
  L.by_state_.resize(L.spec_.size() * 4);
  for (int rank = 0; rank < world; ++rank) {
    const Coord co = plan.coord_of(rank);
    for (int c = 0; c < plan.virtual_stages; ++c) {
      const int stage = plan.stage_of(co.pp, c);
      auto it = cache.find({stage, co.tp});
      if (it == cache.end()) {
        it = cache
                 .emplace(std::make_pair(stage, co.tp),
                          chunk_layout(L.spec_, ranges[size_t(stage)], co.tp, plan.tp))
                 .first;
      }
      const ChunkLayout& chunk = it->second;
      const int64_t n = chunk.numel;
      for (StateKind kind : kinds) {
        BufferInfo b;
        b.chunk = c;
        b.stage = stage;
        b.kind = kind;
        b.chunk_numel = n;
        b.chunk_begin = 0;
        b.numel = n;
        if (plan.zero_stage == 1 && is_optimizer_state(kind)) {
          const ZeroSplit z = zero_split(n, plan.dp, co.dp);
          b.chunk_begin = z.lo;
          b.numel = z.n_own;
        }
        const int buffer = int(L.buffers_[size_t(rank)].size());
        L.buffers_[size_t(rank)].push_back(b);
        const int64_t lo = b.chunk_begin, hi = b.chunk_begin + b.numel;
        for (const ShardView& v : chunk.views) {
          const int64_t a = std::max(lo, v.offset), e = std::min(hi, v.offset + v.local.numel());
          if (a >= e) continue;
          const std::vector<int64_t> strides = v.local.strides();
          for (const Box& fb : flat_range_boxes(v.local, a - v.offset, e - v.offset)) {
            for (const model::ShardPiece& sp : v.pieces) {
              const Box in_shard = sp.local.intersect(fb);
              if (in_shard.empty()) continue;
              StatePiece p;
              p.tensor = v.tensor;
              p.kind = kind;
              std::vector<int64_t> shift(in_shard.rank());
              for (size_t d = 0; d < shift.size(); ++d) shift[d] = sp.global.lo(d) - sp.local.lo(d);
              p.global = in_shard.translate(shift);
              p.rank = rank;
              p.buffer = buffer;
              p.offset = v.offset - lo;
              for (size_t d = 0; d < strides.size(); ++d) p.offset += in_shard.lo(d) * strides[d];
              p.strides = strides;
              L.pieces_.push_back(std::move(p));
            }
          }
        }
      }
    }
    L.rank_begin_.push_back(L.pieces_.size());
  }
  // Within a buffer, keep the pieces in ascending offset (the qkv pieces of a partial-row box
  // may come out of order otherwise).
  for (int rank = 0; rank < world; ++rank) {
    auto first = L.pieces_.begin() + ptrdiff_t(L.rank_begin_[size_t(rank)]);
    auto last = L.pieces_.begin() + ptrdiff_t(L.rank_begin_[size_t(rank) + 1]);
    std::stable_sort(first, last, [](const StatePiece& a, const StatePiece& b) {
      return std::pair(a.buffer, a.offset) < std::pair(b.buffer, b.offset);
    });
  }
  for (size_t i = 0; i < L.pieces_.size(); ++i) {
    L.by_state_[state_slot(L.pieces_[i].tensor, L.pieces_[i].kind)].push_back(i);
  }
  return L;
}

bool StateLayout::has_kind(StateKind k) const {
  return std::find(kinds_.begin(), kinds_.end(), k) != kinds_.end();
}

const std::vector<BufferInfo>& StateLayout::buffers(int rank) const {
  TESSEL_CHECK(rank >= 0 && rank < world(), InvalidArgumentError,
               "rank {} is outside the layout's {} ranks", rank, world());
  return buffers_[size_t(rank)];
}

int StateLayout::buffer_id(int rank, int chunk, StateKind kind) const {
  const auto& bs = buffers(rank);
  for (size_t i = 0; i < bs.size(); ++i) {
    if (bs[i].chunk == chunk && bs[i].kind == kind) return int(i);
  }
  return -1;
}

std::span<const StatePiece> StateLayout::pieces(int rank) const {
  buffers(rank);  // range check
  return std::span<const StatePiece>(pieces_).subspan(
      rank_begin_[size_t(rank)], rank_begin_[size_t(rank) + 1] - rank_begin_[size_t(rank)]);
}

int64_t StateLayout::numel(int rank) const {
  int64_t n = 0;
  for (const BufferInfo& b : buffers(rank)) n += b.numel;
  return n;
}

std::vector<const StatePiece*> StateLayout::replicas(int tensor, StateKind kind,
                                                     const Box& box) const {
  TESSEL_CHECK(tensor >= 0 && size_t(tensor) < spec_.size(), InvalidArgumentError,
               "tensor #{} is outside model '{}' ({} tensors)", tensor, config().name,
               spec_.size());
  TESSEL_CHECK(has_kind(kind), InvalidArgumentError, "this layout holds no '{}' state",
               state_kind_name(kind));
  std::vector<const StatePiece*> out;
  const bool all = box.rank() == 0 && spec_[size_t(tensor)].shape.rank() != 0;
  for (size_t i : by_state_[state_slot(tensor, kind)]) {
    const StatePiece& p = pieces_[i];
    if (all || !p.global.intersect(box).empty()) out.push_back(&p);
  }
  return out;
}

std::vector<const StatePiece*> StateLayout::replicas(std::string_view tensor, StateKind kind,
                                                     const Box& box) const {
  return replicas(spec_.index_of(spec_.at(tensor).name), kind, box);
}

void StateLayout::fill(int rank, const BoxSource& source,
                       const std::vector<std::span<float>>& buffers) const {
  const auto& infos = this->buffers(rank);
  TESSEL_CHECK(buffers.size() == infos.size(), InvalidArgumentError,
               "rank {} has {} state buffers but {} were given", rank, infos.size(),
               buffers.size());
  for (size_t b = 0; b < infos.size(); ++b) {
    TESSEL_CHECK(int64_t(buffers[b].size()) >= infos[b].numel, InvalidArgumentError,
                 "rank {} buffer {} ({} of chunk {}) needs {} floats, got {}", rank, b,
                 state_kind_name(infos[b].kind), infos[b].chunk, infos[b].numel, buffers[b].size());
  }
  std::vector<float> packed;
  for (const StatePiece& p : pieces(rank)) {
    packed.resize(size_t(p.global.volume()));
    source(spec_[size_t(p.tensor)], p.kind, p.global, packed.data());
    scatter(std::span<const float>(packed), p.region(), buffers[size_t(p.buffer)]);
  }
}

}  // namespace tessel::layout
