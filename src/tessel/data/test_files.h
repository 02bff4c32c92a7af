// Byte-level file helpers for the data subsystem's tests (corrupting files on purpose).
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel::data::testing {

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("test: cannot read " + path.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("test: cannot write " + path.string());
}

// Overwrites sizeof(T) bytes at `offset` with v (little-endian host).
template <typename T>
void patch(const std::filesystem::path& path, size_t offset, T v) {
  std::string bytes = read_bytes(path);
  if (offset + sizeof(T) > bytes.size()) throw std::runtime_error("test: patch past end");
  std::memcpy(bytes.data() + offset, &v, sizeof(T));
  write_bytes(path, bytes);
}

// Names of the entries in a directory (to check that failed writes leave nothing behind).
inline std::vector<std::string> list_dir(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename());
  return names;
}

}  // namespace tessel::data::testing
