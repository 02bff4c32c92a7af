// The one read interface the trainer sees for a tokenized corpus, whatever its on-disk format.
//
// A TokenSource is a flat stream of `size()` token ids. Implementations: TokenFile (tessel's own
// format, token_dataset.h) and MegatronDataset (Megatron-LM .bin/.idx pairs, megatron_dataset.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace tessel::data {

class TokenSource {
 public:
  virtual ~TokenSource() = default;

  // Number of tokens in the stream.
  virtual int64_t size() const = 0;
  // Every token id is < vocab_size(); it is at most 2^31 so ids fit int32.
  virtual uint64_t vocab_size() const = 0;
  // Copies tokens [offset, offset + count) into out[0, count). Checks every id: an id outside
  // [0, vocab_size()) throws CorruptDataError naming the source, the position and the id. A range
  // outside [0, size()] throws InvalidArgumentError. Safe to call from several threads at once.
  virtual void read(int64_t offset, int64_t count, int32_t* out) const = 0;
  // One line for logs and errors, e.g. "tessel token file 'a.tok' (1000 tokens, uint16, vocab
  // 257)".
  virtual std::string describe() const = 0;
};

struct TokenSourceOptions {
  // Scan every token once at open (in parallel): tessel files also check their checksum. Turns a
  // damaged file into an error before training starts instead of in the middle of a run.
  bool verify = true;
  // Vocabulary size for formats that do not record one (Megatron). 0 = infer it as the largest
  // id + 1, which costs one scan of the data at open. Ignored for tessel files, whose header is
  // authoritative; the caller checks vocab_size() against the model's vocabulary.
  uint64_t vocab_size = 0;
};

// Opens a token source, choosing the format from the path and the file:
//   "x.idx", "x.bin", or "x" with x.idx and x.bin beside it  -> Megatron pair with prefix x;
//   a file starting with the tessel magic "TSLTOKEN"          -> tessel token file.
// Throws IoError when nothing exists at the path, CorruptDataError when a file is in neither
// format or fails validation (the message names the file and how to fix it).
std::unique_ptr<TokenSource> open_token_source(const std::string& path,
                                               const TokenSourceOptions& options = {});

// Throws InvalidArgumentError unless [offset, offset + count) lies within [0, size). Shared by the
// implementations so every source reports bad ranges the same way.
void check_read_range(const TokenSource& source, int64_t offset, int64_t count);

// Throws the CorruptDataError read() promises for token `id` found at stream position `position`.
[[noreturn]] void throw_bad_token(const TokenSource& source, int64_t position, int64_t id);

}  // namespace tessel::data
