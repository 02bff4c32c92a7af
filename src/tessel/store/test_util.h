// Helpers for the store tests: deterministic bytes, raw file surgery.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tessel/store/checkpoint_store.h"

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

}  // namespace tessel::store::test
