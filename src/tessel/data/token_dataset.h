// tessel's token file format: a fixed 64-byte little-endian header followed by the raw tokens.
//
//   offset size  field
//        0    8  magic "TSLTOKEN"
//        8    4  u32 format version (= 1)
//       12    4  u32 token width in bytes: 2 (uint16) or 4 (uint32)
//       16    8  u64 vocab size: every token id is < vocab (1 <= vocab <= 2^31; <= 65536 for width
//       2) 24    8  u64 token count 32    8  u64 checksum = sum over i of splitmix64_mix(i *
//       0x9e3779b97f4a7c15 + token[i])
//                    (mod 2^64; position-dependent, so swapped or flipped tokens are caught; the
//                    sum form lets writers stream and readers verify in parallel)
//       40   24  reserved, zero
//       64       token[count], each `width` bytes, little-endian
//
// The file size is exactly 64 + count * width; the 64-byte header keeps the tokens aligned.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tessel/core/atomic_file.h"
#include "tessel/core/mapped_file.h"
#include "tessel/data/rng.h"
#include "tessel/data/token_source.h"

namespace tessel::data {

inline constexpr char kTokenFileMagic[8] = {'T', 'S', 'L', 'T', 'O', 'K', 'E', 'N'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr uint64_t kTokenFileHeaderBytes = 64;
inline constexpr uint64_t kMaxVocabSize = uint64_t{1} << 31;  // ids must fit int32

// Streams tokens into a new token file; nothing appears under `path` until finish() succeeds.
class TokenFileWriter {
 public:
  // Throws InvalidArgumentError for a width other than 2/4 or a vocab that is 0, above 2^31, or
  // above 65536 with width 2; IoError when the destination cannot be created.
  TokenFileWriter(const std::string& path, uint64_t vocab_size, int token_width);

  // Throws InvalidArgumentError naming the id when a token is >= vocab_size.
  void append(std::span<const uint32_t> tokens);
  void append(std::span<const uint16_t> tokens);
  // Writes the header, fsyncs and renames into place.
  void finish();

  int64_t count() const { return count_; }

 private:
  template <typename T>
  void append_impl(std::span<const T> tokens);

  AtomicFileWriter file_;
  uint64_t vocab_;
  int width_;
  int64_t count_ = 0;
  uint64_t checksum_ = 0;
};

// Writes `tokens` as a complete token file (see TokenFileWriter for what it throws).
void write_token_file(const std::string& path, std::span<const uint32_t> tokens,
                      uint64_t vocab_size, int token_width);

// A memory-mapped, validated token file.
class TokenFile : public TokenSource {
 public:
  // Maps the file read-only and validates the header: wrong magic, unknown version, token width
  // not 2/4, a bad vocab, nonzero reserved bytes, or a size other than 64 + count * width throw
  // CorruptDataError naming the file. With `verify`, also checks every token < vocab (the error
  // names the file, token offset, id and vocab) and the checksum, in one parallel pass. A missing
  // file throws IoError naming the path.
  static std::unique_ptr<TokenFile> open(const std::string& path, bool verify = true);

  int64_t size() const override { return count_; }
  uint64_t vocab_size() const override { return vocab_; }
  void read(int64_t offset, int64_t count, int32_t* out) const override;
  std::string describe() const override;

  int token_width() const { return width_; }
  uint64_t checksum() const { return checksum_; }
  const std::string& path() const { return file_.path(); }

 private:
  TokenFile() = default;
  void verify_tokens() const;

  MappedFile file_;
  int width_ = 0;
  uint64_t vocab_ = 0;
  int64_t count_ = 0;
  uint64_t checksum_ = 0;
};

// The checksum term of token `id` at position `i` (see the format table above).
inline uint64_t token_checksum_term(uint64_t i, uint64_t id) {
  return splitmix64_mix(i * kGoldenGamma + id);
}

}  // namespace tessel::data
