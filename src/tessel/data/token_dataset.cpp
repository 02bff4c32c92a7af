#include "tessel/data/token_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/data/little_endian.h"
#include "tessel/data/token_convert.h"

namespace tessel::data {
namespace {

constexpr const char* kRemake = "re-create it with `tessel data prepare`";

void check_format(const std::string& path, uint64_t vocab, int width) {
  TESSEL_CHECK(width == 2 || width == 4, InvalidArgumentError,
               "token file '{}': token width {} is not supported; use 2 (uint16) or 4 (uint32)",
               path, width);
  TESSEL_CHECK(vocab >= 1 && vocab <= kMaxVocabSize, InvalidArgumentError,
               "token file '{}': vocab size {} is out of range [1, 2^31]", path, vocab);
  TESSEL_CHECK(width == 4 || vocab <= 65536, InvalidArgumentError,
               "token file '{}': vocab size {} does not fit 2-byte tokens; use token width 4", path,
               vocab);
}

std::array<std::byte, kTokenFileHeaderBytes> encode_header(int width, uint64_t vocab,
                                                           uint64_t count, uint64_t checksum) {
  std::array<std::byte, kTokenFileHeaderBytes> h{};
  std::memcpy(h.data(), kTokenFileMagic, 8);
  store_le<uint32_t>(h.data() + 8, kTokenFileVersion);
  store_le<uint32_t>(h.data() + 12, static_cast<uint32_t>(width));
  store_le<uint64_t>(h.data() + 16, vocab);
  store_le<uint64_t>(h.data() + 24, count);
  store_le<uint64_t>(h.data() + 32, checksum);
  return h;
}

}  // namespace

TokenFileWriter::TokenFileWriter(const std::string& path, uint64_t vocab_size, int token_width)
    : file_((check_format(path, vocab_size, token_width), path)),
      vocab_(vocab_size),
      width_(token_width) {
  auto placeholder = std::array<std::byte, kTokenFileHeaderBytes>{};  // filled in by finish()
  file_.write(placeholder.data(), placeholder.size());
}

template <typename T>
void TokenFileWriter::append_impl(std::span<const T> tokens) {
  // Encode in chunks so a large append does not double its memory.
  constexpr size_t kChunk = 1 << 16;
  std::vector<std::byte> buf(kChunk * static_cast<size_t>(width_));
  for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
    size_t n = std::min(kChunk, tokens.size() - begin);
    for (size_t i = 0; i < n; ++i) {
      uint64_t id = tokens[begin + i];
      TESSEL_CHECK(id < vocab_, InvalidArgumentError,
                   "token file '{}': token id {} at position {} is >= vocab size {}", file_.path(),
                   id, count_, vocab_);
      if (width_ == 2) {
        store_le<uint16_t>(buf.data() + 2 * i, static_cast<uint16_t>(id));
      } else {
        store_le<uint32_t>(buf.data() + 4 * i, static_cast<uint32_t>(id));
      }
      checksum_ += token_checksum_term(static_cast<uint64_t>(count_), id);
      ++count_;
    }
    file_.write(buf.data(), n * static_cast<size_t>(width_));
  }
}

void TokenFileWriter::append(std::span<const uint32_t> tokens) {
  append_impl(tokens);
}
void TokenFileWriter::append(std::span<const uint16_t> tokens) {
  append_impl(tokens);
}

void TokenFileWriter::finish() {
  auto h = encode_header(width_, vocab_, static_cast<uint64_t>(count_), checksum_);
  file_.write_at(0, h.data(), h.size());
  file_.commit();
}

void write_token_file(const std::string& path, std::span<const uint32_t> tokens,
                      uint64_t vocab_size, int token_width) {
  TokenFileWriter writer(path, vocab_size, token_width);
  writer.append(tokens);
  writer.finish();
}

std::unique_ptr<TokenFile> TokenFile::open(const std::string& path, bool verify) {
  std::unique_ptr<TokenFile> tf(new TokenFile());
  tf->file_ = MappedFile::open(path);
  const std::byte* p = tf->file_.data();
  const uint64_t file_size = tf->file_.size();

  TESSEL_CHECK(file_size >= 8 && std::memcmp(p, kTokenFileMagic, 8) == 0, CorruptDataError,
               "'{}' is not a tessel token file (it does not start with \"TSLTOKEN\"); convert "
               "text with `tessel data prepare`, or pass a Megatron .idx/.bin prefix",
               path);
  TESSEL_CHECK(file_size >= kTokenFileHeaderBytes, CorruptDataError,
               "tessel token file '{}' is truncated: {} bytes is shorter than the {}-byte header; "
               "copy it again or {}",
               path, file_size, kTokenFileHeaderBytes, kRemake);
  const uint32_t version = load_le<uint32_t>(p + 8);
  TESSEL_CHECK(version == kTokenFileVersion, CorruptDataError,
               "tessel token file '{}' has format version {}, this build reads version {}; "
               "{} with this build",
               path, version, kTokenFileVersion, kRemake);
  const uint32_t width = load_le<uint32_t>(p + 12);
  TESSEL_CHECK(width == 2 || width == 4, CorruptDataError,
               "tessel token file '{}' has token width {} bytes (only 2 or 4 are valid); the "
               "header is damaged, {}",
               path, width, kRemake);
  const uint64_t vocab = load_le<uint64_t>(p + 16);
  TESSEL_CHECK(vocab >= 1 && vocab <= kMaxVocabSize && (width == 4 || vocab <= 65536),
               CorruptDataError,
               "tessel token file '{}' has vocab size {}, impossible for {}-byte tokens; the "
               "header is damaged, {}",
               path, vocab, width, kRemake);
  for (uint64_t i = 40; i < kTokenFileHeaderBytes; ++i) {
    TESSEL_CHECK(p[i] == std::byte{0}, CorruptDataError,
                 "tessel token file '{}' has nonzero reserved header byte {}; the header is "
                 "damaged, {}",
                 path, i, kRemake);
  }
  const uint64_t count = load_le<uint64_t>(p + 24);
  const uint64_t payload = file_size - kTokenFileHeaderBytes;
  TESSEL_CHECK(count <= payload / width && payload == count * width, CorruptDataError,
               "tessel token file '{}' has {} bytes but its header promises {} tokens of {} "
               "bytes ({} bytes in all); the file is truncated or was not fully written, copy it "
               "again or {}",
               path, file_size, count, width,
               count <= payload / width ? fmt::to_string(kTokenFileHeaderBytes + count * width)
                                        : std::string("more than the file's"),
               kRemake);

  tf->width_ = static_cast<int>(width);
  tf->vocab_ = vocab;
  tf->count_ = static_cast<int64_t>(count);
  tf->checksum_ = load_le<uint64_t>(p + 32);
  if (verify) tf->verify_tokens();
  return tf;
}

void TokenFile::verify_tokens() const {
  const std::byte* base = file_.data() + kTokenFileHeaderBytes;
  const int64_t n = count_;
  const int width = width_;
  const uint64_t vocab = vocab_;
  uint64_t sum = 0;
  int64_t first_bad = std::numeric_limits<int64_t>::max();
#pragma omp parallel for reduction(+ : sum) reduction(min : first_bad) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t id = width == 2 ? load_le<uint16_t>(base + 2 * i) : load_le<uint32_t>(base + 4 * i);
    if (id >= vocab && i < first_bad) first_bad = i;
    sum += token_checksum_term(static_cast<uint64_t>(i), id);
  }
  if (first_bad != std::numeric_limits<int64_t>::max()) {
    uint64_t id = width == 2 ? load_le<uint16_t>(base + 2 * first_bad)
                             : load_le<uint32_t>(base + 4 * first_bad);
    TESSEL_THROW(CorruptDataError,
                 "tessel token file '{}': token {} (byte offset {}) has id {}, which is >= the "
                 "vocab size {} in its header; the file is damaged, {}",
                 path(), first_bad, kTokenFileHeaderBytes + uint64_t(first_bad) * width, id, vocab,
                 kRemake);
  }
  TESSEL_CHECK(sum == checksum_, CorruptDataError,
               "tessel token file '{}': checksum mismatch (header {:#018x}, data {:#018x}); the "
               "tokens were modified or damaged after writing, {}",
               path(), checksum_, sum, kRemake);
}

void TokenFile::read(int64_t offset, int64_t count, int32_t* out) const {
  check_read_range(*this, offset, count);
  const std::byte* src = file_.data() + kTokenFileHeaderBytes + offset * width_;
  int64_t bad = width_ == 2 ? convert_tokens_checked<uint16_t>(src, count, vocab_, out)
                            : convert_tokens_checked<uint32_t>(src, count, vocab_, out);
  if (bad >= 0) {
    uint64_t id = width_ == 2 ? load_le<uint16_t>(src + 2 * bad) : load_le<uint32_t>(src + 4 * bad);
    throw_bad_token(*this, offset + bad, static_cast<int64_t>(id));
  }
}

std::string TokenFile::describe() const {
  return fmt::format("tessel token file '{}' ({} tokens, uint{}, vocab {})", path(), count_,
                     width_ * 8, vocab_);
}

}  // namespace tessel::data
