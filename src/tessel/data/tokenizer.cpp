#include "tessel/data/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "tessel/core/check.h"
#include "tessel/data/bpe_tokenizer.h"
#include "tessel/data/sentencepiece_tokenizer.h"
#include "tessel/data/token_dataset.h"

namespace tessel::data {
namespace {

template <typename Int>
std::string decode_bytes(std::span<const Int> tokens) {
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

// How often each id occurs: an array for real vocabularies, a map above 2^24 ids (the format
// allows 2^31, which as an array would be 16 GiB).
class IdCounts {
 public:
  explicit IdCounts(uint64_t vocab) : dense_(std::min<uint64_t>(vocab, uint64_t{1} << 24)) {}
  void add(std::span<const uint32_t> ids) {
    for (uint32_t id : ids) {
      if (id < dense_.size())
        ++dense_[id];
      else
        ++sparse_[id];
    }
  }
  std::vector<int64_t> all() const {
    std::vector<int64_t> counts = dense_;
    for (const auto& [id, n] : sparse_) counts.push_back(n);
    return counts;
  }

 private:
  std::vector<int64_t> dense_;
  std::unordered_map<uint32_t, int64_t> sparse_;
};

}  // namespace

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string ByteTokenizer::decode(std::span<const uint32_t> ids) const {
  return decode_bytes(ids);
}
std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  return decode_bytes(ids);
}

std::string ByteTokenizer::describe() const {
  return fmt::format("byte-level (vocab {}, EOT {} = {})", kVocabSize, kEotText, kEot);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return std::make_unique<ByteTokenizer>();
  const fs::path p(path);
  std::error_code ec;
  const auto status = fs::status(p, ec);
  if (fs::is_directory(status)) {
    if (fs::exists(p / "tokenizer.json"))
      return BpeTokenizer::load((p / "tokenizer.json").string());
    if (fs::exists(p / "tokenizer.model"))
      return SentencePieceTokenizer::load((p / "tokenizer.model").string());
    TESSEL_THROW(IoError,
                 "tokenizer directory '{}' has neither tokenizer.json nor tokenizer.model; pass "
                 "the tokenizer file itself",
                 path);
  }
  const auto ext = p.extension().string();
  if (ext == ".json") return BpeTokenizer::load(path);
  if (ext == ".model") return SentencePieceTokenizer::load(path);
  TESSEL_CHECK(fs::exists(status), IoError,
               "tokenizer '{}' does not exist; pass a Hugging Face tokenizer.json, a SentencePiece "
               ".model file, or a directory holding one",
               path);
  TESSEL_THROW(ConfigError,
               "cannot tell what kind of tokenizer '{}' is from its name: tessel reads a Hugging "
               "Face tokenizer.json (*.json), a SentencePiece model (*.model), or a directory "
               "holding tokenizer.json or tokenizer.model",
               path);
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

PrepareStats prepare_dataset(const std::vector<std::string>& inputs, const std::string& output,
                             const Tokenizer& tokenizer) {
  TESSEL_CHECK(!inputs.empty(), InvalidArgumentError,
               "no input files to prepare into '{}'; pass at least one --input", output);
  // Check every input before creating the output, so a typo in the last path fails fast.
  for (const auto& path : inputs) {
    std::ifstream probe(path, std::ios::binary);
    TESSEL_CHECK(probe.good(), IoError, "cannot open input text file '{}': {}; check the path",
                 path, std::strerror(errno));
  }

  PrepareStats stats;
  stats.vocab_size = tokenizer.vocab_size();
  stats.token_width = stats.vocab_size <= 65536 ? 2 : 4;
  const std::optional<uint32_t> eot = tokenizer.eot(), bos = tokenizer.bos();
  IdCounts counts(stats.vocab_size);
  TokenFileWriter writer(output, stats.vocab_size, stats.token_width);
  auto encode = [&](std::string_view text) {
    const std::vector<uint32_t> ids = tokenizer.encode(text);
    counts.add(ids);
    writer.append(std::span<const uint32_t>(ids));
  };
  std::vector<char> buf(1 << 20);
  std::string pending;  // the document's text not encoded yet
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    TESSEL_CHECK(in.good(), IoError, "cannot open input text file '{}': {}; check the path", path,
                 std::strerror(errno));
    if (stats.documents > 0 && eot) writer.append(std::span<const uint32_t>(&*eot, 1));
    if (bos) writer.append(std::span<const uint32_t>(&*bos, 1));
    pending.clear();
    for (;;) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      const auto n = static_cast<size_t>(in.gcount());
      pending.append(buf.data(), n);
      stats.bytes += static_cast<int64_t>(n);
      if (in.eof()) break;
      // A read error other than end-of-file (e.g. a directory, an I/O fault).
      TESSEL_CHECK(in.good(), IoError,
                   "cannot read input text file '{}'; check that it is a "
                   "readable regular file",
                   path);
      if (const size_t cut = tokenizer.safe_cut(pending); cut > 0) {
        encode(std::string_view(pending).substr(0, cut));
        pending.erase(0, cut);
      }
    }
    encode(pending);
    ++stats.documents;
  }
  writer.finish();
  stats.tokens = writer.count();
  stats.entropy_bits = entropy_bits(counts.all());
  stats.entropy_nats = stats.entropy_bits * std::log(2.0);
  return stats;
}

PrepareStats prepare_dataset(const std::vector<std::string>& inputs, const std::string& output) {
  return prepare_dataset(inputs, output, ByteTokenizer());
}

}  // namespace tessel::data
