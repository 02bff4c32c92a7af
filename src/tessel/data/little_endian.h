// Loads and stores of little-endian integers at any (possibly unaligned) address.
//
// On-disk formats here are little-endian; memcpy keeps unaligned access defined behaviour and
// compiles to a plain load on the little-endian hosts tessel supports.
#pragma once

#include <bit>
#include <cstddef>
#include <cstring>

namespace tessel::data {

static_assert(std::endian::native == std::endian::little,
              "tessel's dataset readers map little-endian files directly; big-endian hosts would "
              "need byte swapping here");

template <typename T>
inline T load_le(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
inline void store_le(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace tessel::data
