// Test helpers for resharding: the whole training state of a small model as flat arrays, and
// buffers of a layout filled from it.
//
// StateUniverse numbers every element of every (tensor, kind) of a model: id = base + flat index.
// It holds two fillings of the state:
//   fresh  what a fresh job would hold: parameters from model init (seed), Adam's moments from a
//          deterministic hash of (tensor, kind, element) (nonzero, unlike a real fresh job, so
//          moving them is visible);
//   ids    float(id): every element distinct (exact below 2^24 elements), so a misplaced element
//          cannot go unnoticed even where `fresh` repeats values (norm weights, padding rows).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "tessel/comm/store.h"
#include "tessel/layout/state_layout.h"
#include "tessel/model/init.h"
#include "tessel/tensor/region_test_util.h"

namespace tessel::reshard::testing {

// A file-store rendezvous under `dir` for `job`'s new generation (1): where these tests' processes
// meet in a transition world.
inline comm::StoreOptions transition_store(const std::filesystem::path& dir, const std::string& job,
                                           std::chrono::milliseconds timeout) {
  comm::StoreOptions o;
  o.path = (dir / "rendezvous").string();
  o.job_id = job;
  o.generation = 1;  // the new world's generation
  o.timeout = timeout;
  return o;
}

using layout::StateKind;
using layout::StateLayout;

// A float in [-1, 1) from 64 hashed bits.
inline float hashed_value(uint64_t key, int64_t index) {
  uint64_t z = key + uint64_t(index) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(int64_t(z >> 40) - (int64_t(1) << 23)) / float(int64_t(1) << 23);
}

// Calls f(row-major flat index in `shape`, k) for the k-th element of `box` in row-major order.
template <typename F>
void for_each_in_box(const Shape& shape, const Box& box, F&& f) {
  if (box.empty()) return;
  const auto strides = shape.strides();
  const size_t rank = box.rank();
  std::vector<int64_t> idx = box.lo();
  for (int64_t k = 0;; ++k) {
    int64_t flat = 0;
    for (size_t d = 0; d < rank; ++d) flat += idx[d] * strides[d];
    f(flat, k);
    size_t d = rank;
    while (d > 0) {
      --d;
      if (++idx[d] < box.hi(d)) break;
      idx[d] = box.lo(d);
      if (d == 0) return;
    }
    if (rank == 0) return;
  }
}

// Flat buffer indices of a region's elements, in packed order.
using tessel::test_util::region_offsets;

class StateUniverse {
 public:
  StateUniverse(const model::ModelConfig& config, uint64_t seed)
      : spec_(model::ModelSpec::from(config)) {
    base_.assign(spec_.size() * 4, -1);
    for (size_t t = 0; t < spec_.size(); ++t) {
      for (StateKind k : layout::kAllStateKinds) {
        base_[t * 4 + size_t(k)] = total_;
        total_ += spec_[t].numel();
      }
    }
    fresh_.resize(size_t(total_));
    ids_.resize(size_t(total_));
    for (size_t t = 0; t < spec_.size(); ++t) {
      const auto& p = spec_[t];
      for (StateKind k : layout::kAllStateKinds) {
        float* out = fresh_.data() + base_[t * 4 + size_t(k)];
        if (k == StateKind::param || k == StateKind::master) {
          model::init_full(p, seed, out);
        } else {
          const uint64_t key = model::init_key(seed + 1000 * uint64_t(k), p.name);
          for (int64_t i = 0; i < p.numel(); ++i) out[i] = hashed_value(key, i);
        }
        for (int64_t i = 0; i < p.numel(); ++i)
          ids_[size_t(base_[t * 4 + size_t(k)] + i)] = float(base_[t * 4 + size_t(k)] + i);
      }
    }
  }

  const model::ModelSpec& spec() const { return spec_; }
  int64_t total() const { return total_; }
  int64_t id(int tensor, StateKind kind, int64_t flat) const {
    return base_[size_t(tensor) * 4 + size_t(kind)] + flat;
  }

  // A StateLayout::BoxSource reading the `ids` (or `fresh`) filling.
  StateLayout::BoxSource source(bool ids) const {
    return [this, ids](const model::ParamSpec& p, StateKind kind, const Box& box, float* out) {
      const float* v = (ids ? ids_ : fresh_).data() + id(spec_.index_of(p.name), kind, 0);
      for_each_in_box(p.shape, box, [&](int64_t flat, int64_t k) { out[k] = v[flat]; });
    };
  }

 private:
  model::ModelSpec spec_;
  std::vector<int64_t> base_;
  int64_t total_ = 0;
  std::vector<float> fresh_, ids_;
};

// One rank's buffers, owned.
struct RankState {
  std::vector<std::vector<float>> buffers;

  std::vector<std::span<float>> spans() {
    std::vector<std::span<float>> s;
    for (auto& b : buffers) s.emplace_back(b);
    return s;
  }
  std::vector<std::span<const float>> const_spans() const {
    std::vector<std::span<const float>> s;
    for (auto& b : buffers) s.emplace_back(b);
    return s;
  }
  bool operator==(const RankState& o) const {
    if (buffers.size() != o.buffers.size()) return false;
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (buffers[i].size() != o.buffers[i].size() ||
          std::memcmp(buffers[i].data(), o.buffers[i].data(), buffers[i].size() * sizeof(float)))
        return false;
    }
    return true;
  }
};

// A NaN with a payload no filling produces: marks elements nobody wrote.
inline float unwritten() {
  const uint32_t bits = 0x7fc0beefu;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Buffers of `rank` sized for the layout, all unwritten().
inline RankState empty_state(const StateLayout& L, int rank) {
  RankState s;
  for (const auto& b : L.buffers(rank)) s.buffers.emplace_back(size_t(b.numel), unwritten());
  return s;
}

inline RankState filled_state(const StateLayout& L, int rank, const StateUniverse& u, bool ids) {
  RankState s = empty_state(L, rank);
  L.fill(rank, u.source(ids), s.spans());
  return s;
}

}  // namespace tessel::reshard::testing
