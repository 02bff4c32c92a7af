// xxh3-64 checksums as the store writes them: 16 lower-case hex digits (JSON numbers above 2^53
// would lose bits in many readers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tessel::store {

uint64_t xxh3(const void* data, size_t n);
std::string checksum_hex(uint64_t h);
// Parses 16 hex digits; nullopt for anything else.
std::optional<uint64_t> parse_checksum_hex(std::string_view s);

// Incremental xxh3-64 over a byte stream (equal to xxh3() of the concatenation).
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  void* state_;
};

}  // namespace tessel::store
