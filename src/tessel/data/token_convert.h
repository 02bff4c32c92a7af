// Conversion of stored token ids to int32 with the range check every TokenSource::read promises.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tessel/data/little_endian.h"

namespace tessel::data {

// Whether a stored id lies outside [0, vocab). Signed ids go through int64 -> uint64 so that a
// negative id becomes huge and one unsigned comparison covers both ends.
template <typename T>
inline bool token_out_of_range(T v, uint64_t vocab) {
  return static_cast<uint64_t>(static_cast<int64_t>(v)) >= vocab;
}

// Converts `count` little-endian ids of type T at src to int32 and returns the index of the first
// id outside [0, vocab), or -1 when all are valid. vocab must be <= 2^31 so valid ids fit int32.
// The valid case is one branch-free loop (vectorizable); the search runs only on failure.
template <typename T>
int64_t convert_tokens_checked(const std::byte* src, int64_t count, uint64_t vocab, int32_t* out) {
  bool bad = false;
  for (int64_t i = 0; i < count; ++i) {
    T v = load_le<T>(src + i * static_cast<int64_t>(sizeof(T)));
    bad |= token_out_of_range(v, vocab);
    out[i] = static_cast<int32_t>(v);
  }
  if (!bad) return -1;
  for (int64_t i = 0; i < count; ++i)
    if (token_out_of_range(load_le<T>(src + i * static_cast<int64_t>(sizeof(T))), vocab)) return i;
  return -1;
}

}  // namespace tessel::data
