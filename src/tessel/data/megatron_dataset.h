// Reader and writer for Megatron-LM indexed datasets (a `prefix.bin` + `prefix.idx` pair), so
// corpora tokenized with Megatron's preprocess_data.py train unchanged.
//
// prefix.idx, little-endian, packed (no padding):
//   9 bytes   magic "MMIDIDX\0\0"
//   u64       version (= 1)
//   u8        dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8
//   uint16 u64       sequence count S u64       document index count D int32     sizes[S] tokens in
//   each sequence int64     pointers[S]    byte offset of each sequence in prefix.bin int64
//   doc_idx[D]     Megatron's document boundaries: 0, then the end sequence of each
//                            document (so D = documents + 1)
// prefix.bin holds the token ids. The token stream presented here is sequence 0, then 1, ... S-1.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessel/core/mapped_file.h"
#include "tessel/data/token_source.h"

namespace tessel::data {

inline constexpr char kMegatronIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kMegatronIndexVersion = 1;

enum class MegatronDType : uint8_t {
  u8 = 1,
  i8 = 2,
  i16 = 3,
  i32 = 4,
  i64 = 5,
  f64 = 6,  // not a token type: rejected with UnsupportedError
  f32 = 7,  // not a token type: rejected with UnsupportedError
  u16 = 8,
};

// Bytes per element; throws CorruptDataError for an unknown code.
size_t megatron_dtype_size(MegatronDType t);
// Lower-case name ("uint16", ...), "unknown" for other codes.
const char* megatron_dtype_name(MegatronDType t);

class MegatronDataset : public TokenSource {
 public:
  // Maps prefix.idx and prefix.bin and validates the index: magic, version, dtype, sizes >= 0,
  // document index, and every sequence lying inside prefix.bin.
  // Problems throw CorruptDataError naming the file; a float dtype throws UnsupportedError;
  // a missing file throws IoError naming it. With options.vocab_size == 0 the vocabulary is
  // inferred (largest id + 1) by scanning the tokens; otherwise options.verify scans them
  // against the given vocabulary (see TokenSourceOptions). Negative ids are always corrupt.
  static std::unique_ptr<MegatronDataset> open(const std::string& prefix,
                                               const TokenSourceOptions& options = {});

  int64_t size() const override { return total_tokens_; }
  uint64_t vocab_size() const override { return vocab_; }
  void read(int64_t offset, int64_t count, int32_t* out) const override;
  std::string describe() const override;

  int64_t num_sequences() const { return num_sequences_; }
  // Documents per Megatron's document index (its entry count minus the leading 0).
  int64_t num_documents() const { return num_doc_index_ > 0 ? num_doc_index_ - 1 : 0; }
  MegatronDType dtype() const { return dtype_; }
  const std::string& prefix() const { return prefix_; }

 private:
  MegatronDataset() = default;
  int32_t sequence_size(int64_t i) const;
  int64_t sequence_pointer(int64_t i) const;
  // Stream position of the first token of sequence i.
  int64_t sequence_start(int64_t i) const;
  void scan_tokens(bool infer_vocab);

  std::string prefix_;
  MappedFile idx_;
  MappedFile bin_;
  MegatronDType dtype_ = MegatronDType::u16;
  size_t item_ = 0;
  int64_t num_sequences_ = 0;
  int64_t num_doc_index_ = 0;
  int64_t total_tokens_ = 0;
  uint64_t vocab_ = 0;
  bool vocab_inferred_ = false;
  const std::byte* sizes_ = nullptr;     // int32[S] inside idx_, possibly unaligned
  const std::byte* pointers_ = nullptr;  // int64[S] inside idx_, possibly unaligned
  // Megatron's builder writes sequences back to back; then the stream is one byte range of .bin
  // starting at pointer 0 and no per-sequence table is needed. Otherwise starts_ holds the
  // stream position of every sequence (S + 1 entries) for binary search.
  bool contiguous_ = true;
  std::vector<int64_t> starts_;
};

// Writes prefix.bin and prefix.idx with each inner vector as one document of one sequence, the
// layout Megatron's builder produces. Each file is written atomically (.bin first), so an
// interrupted write leaves at most a .bin without its .idx, never a half-written file.
// Throws InvalidArgumentError for a float dtype or an id that does not fit the dtype; IoError
// when the files cannot be written.
void write_megatron_dataset(const std::string& prefix,
                            const std::vector<std::vector<int64_t>>& documents,
                            MegatronDType dtype);

}  // namespace tessel::data
