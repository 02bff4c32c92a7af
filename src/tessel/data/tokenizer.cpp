#include "tessel/data/tokenizer.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include "tessel/core/check.h"
#include "tessel/data/token_dataset.h"

namespace tessel::data {
namespace {

template <typename Int>
std::string decode_impl(std::span<const Int> tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t id = tokens[i];
    if (id >= 0 && id < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else if (id == ByteTokenizer::kEot) {
      text.append(ByteTokenizer::kEotText);
    } else {
      TESSEL_THROW(InvalidArgumentError,
                   "token id {} at position {} is not in the byte tokenizer's vocabulary [0, {})",
                   id, i, ByteTokenizer::kVocabSize);
    }
  }
  return text;
}

}  // namespace

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<uint32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(std::span<const uint32_t> tokens) {
  return decode_impl(tokens);
}
std::string ByteTokenizer::decode(std::span<const int32_t> tokens) {
  return decode_impl(tokens);
}

double entropy_bits(std::span<const int64_t> counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  if (total == 0) return 0.0;
  double h = 0.0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(total);
    h -= p * std::log2(p);
  }
  return h;
}

PrepareStats prepare_dataset(const std::vector<std::string>& inputs, const std::string& output) {
  TESSEL_CHECK(!inputs.empty(), InvalidArgumentError,
               "no input files to prepare into '{}'; pass at least one --input", output);
  // Check every input before creating the output, so a typo in the last path fails fast.
  for (const auto& path : inputs) {
    std::ifstream probe(path, std::ios::binary);
    TESSEL_CHECK(probe.good(), IoError, "cannot open input text file '{}': {}; check the path",
                 path, std::strerror(errno));
  }

  PrepareStats stats;
  int64_t counts[256] = {};
  TokenFileWriter writer(output, ByteTokenizer::kVocabSize, 2);
  std::vector<char> buf(1 << 20);
  std::vector<uint16_t> tokens(buf.size());
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    TESSEL_CHECK(in.good(), IoError, "cannot open input text file '{}': {}; check the path", path,
                 std::strerror(errno));
    if (stats.documents > 0) {
      const uint16_t eot = ByteTokenizer::kEot;
      writer.append(std::span<const uint16_t>(&eot, 1));
    }
    for (;;) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      const auto n = static_cast<size_t>(in.gcount());
      for (size_t i = 0; i < n; ++i) {
        const auto byte = static_cast<unsigned char>(buf[i]);
        tokens[i] = byte;
        ++counts[byte];
      }
      writer.append(std::span<const uint16_t>(tokens.data(), n));
      stats.bytes += static_cast<int64_t>(n);
      if (in.eof()) break;
      // A read error other than end-of-file (e.g. a directory, an I/O fault).
      TESSEL_CHECK(in.good(), IoError,
                   "cannot read input text file '{}'; check that it is a "
                   "readable regular file",
                   path);
    }
    ++stats.documents;
  }
  writer.finish();
  stats.tokens = writer.count();
  stats.entropy_bits = entropy_bits(counts);
  stats.entropy_nats = stats.entropy_bits * std::log(2.0);
  return stats;
}

}  // namespace tessel::data
