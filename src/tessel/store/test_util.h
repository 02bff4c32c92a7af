// Helpers for the store tests: deterministic bytes, raw file surgery.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessel/store/checkpoint_store.h"
#include "tessel/tensor/box_copy.h"

namespace tessel::store::test {

inline std::vector<char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = char(rng());
  return v;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

inline void flip_byte(const std::filesystem::path& p, uint64_t offset) {
  auto s = read_file(p);
  s.at(offset) ^= 0x20;
  write_file(p, s);
}

inline void truncate_by(const std::filesystem::path& p, uint64_t n) {
  std::filesystem::resize_file(p, std::filesystem::file_size(p) - n);
}

inline CheckpointWriterOptions opts(std::string save_id, uint64_t chunk_bytes = uint64_t(1) << 20) {
  CheckpointWriterOptions o;
  o.save_id = std::move(save_id);
  o.chunk_bytes = chunk_bytes;
  return o;
}

// A logical tensor with its contents, and where a test's ranks hold pieces of it.
struct Logical {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<char> data;
  size_t esize() const { return dtype_size(dtype); }
};

struct PieceSpec {
  int rank;
  std::string tensor;
  Box box;
};

// Logical tensors with random contents and their split into pieces over ranks: what a test
// saves, and what every read must give back. Each test's World adds its own tensors and pieces.
struct TensorWorld {
  std::vector<Logical> tensors;
  std::vector<PieceSpec> pieces;

  // Contents seeded by `version` and the tensor's position, so two versions differ everywhere.
  void add(std::string name, DType dtype, Shape shape, uint32_t version) {
    tensors.push_back({std::move(name), dtype, shape,
                       random_bytes(size_t(shape.numel()) * dtype_size(dtype),
                                    version * 100 + uint32_t(tensors.size()))});
  }
  const Logical& get(const std::string& n) const {
    for (const auto& t : tensors)
      if (t.name == n) return t;
    throw std::runtime_error("no " + n);
  }
  // The box of tensor `n`, dense row-major.
  std::vector<char> slice(const std::string& n, const Box& b) const {
    const auto& t = get(n);
    std::vector<char> out(size_t(b.volume()) * t.esize());
    pack_box(t.data.data(), t.shape, b, out.data(), t.esize());
    return out;
  }
};

// A random box of `s` (possibly empty along some dimension).
inline Box random_box(const Shape& s, std::mt19937& rng) {
  std::vector<int64_t> lo(s.rank()), hi(s.rank());
  for (size_t d = 0; d < s.rank(); ++d) {
    std::uniform_int_distribution<int64_t> u(0, s[d]);
    int64_t a = u(rng), b = u(rng);
    lo[d] = std::min(a, b);
    hi[d] = std::max(a, b);
  }
  return Box(lo, hi);
}

}  // namespace tessel::store::test
