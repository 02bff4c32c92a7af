#include "tessel/data/token_source.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "tessel/core/check.h"
#include "tessel/data/megatron_dataset.h"
#include "tessel/data/token_dataset.h"

namespace tessel::data {
namespace {

namespace fs = std::filesystem;

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// First 8 bytes of a file, fewer when it is shorter.
std::string read_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSEL_CHECK(in.good(), IoError, "cannot open dataset file '{}'; check the path and permissions",
               path);
  char buf[8] = {};
  in.read(buf, sizeof(buf));
  return std::string(buf, static_cast<size_t>(in.gcount()));
}

}  // namespace

std::unique_ptr<TokenSource> open_token_source(const std::string& path,
                                               const TokenSourceOptions& options) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    const std::string magic = read_magic(path);
    if (magic == std::string(kTokenFileMagic, 8)) return TokenFile::open(path, options.verify);
    const bool is_idx = ends_with(path, ".idx");
    const bool is_bin = ends_with(path, ".bin");
    if (is_idx || is_bin) {
      // A .bin has no magic of its own; its .idx decides (and open() validates the pair).
      return MegatronDataset::open(path.substr(0, path.size() - 4), options);
    }
    TESSEL_THROW(CorruptDataError,
                 "'{}' is neither a tessel token file (magic \"TSLTOKEN\") nor part of a Megatron "
                 ".bin/.idx pair; convert text with `tessel data prepare`",
                 path);
  }
  if (fs::exists(path + ".idx", ec) || fs::exists(path + ".bin", ec))
    return MegatronDataset::open(path, options);
  TESSEL_THROW(IoError,
               "no dataset at '{}' (looked for that file and for a Megatron pair '{}.bin' + "
               "'{}.idx'); check the path",
               path, path, path);
}

void check_read_range(const TokenSource& source, int64_t offset, int64_t count) {
  TESSEL_CHECK(offset >= 0 && count >= 0 && offset <= source.size() - count, InvalidArgumentError,
               "read of tokens [{}, {}) is outside {} ({} tokens)", offset, offset + count,
               source.describe(), source.size());
}

void throw_bad_token(const TokenSource& source, int64_t position, int64_t id) {
  TESSEL_THROW(CorruptDataError,
               "{}: token at position {} has id {}, outside the vocabulary [0, {}); the data is "
               "damaged or was tokenized for a different vocabulary, re-create it",
               source.describe(), position, id, source.vocab_size());
}

}  // namespace tessel::data
