#include "tessel/data/megatron_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>

#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/data/little_endian.h"
#include "tessel/data/token_convert.h"
#include "tessel/data/token_dataset.h"

namespace tessel::data {
namespace {

constexpr uint64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr const char* kRemake =
    "re-run Megatron's preprocess_data.py or copy the .bin and .idx again together";

// Calls f with a value of the C++ type stored for dtype t (integer dtypes only).
template <typename F>
decltype(auto) with_token_type(MegatronDType t, F&& f) {
  switch (t) {
    case MegatronDType::u8:
      return f(uint8_t{});
    case MegatronDType::i8:
      return f(int8_t{});
    case MegatronDType::i16:
      return f(int16_t{});
    case MegatronDType::i32:
      return f(int32_t{});
    case MegatronDType::i64:
      return f(int64_t{});
    case MegatronDType::u16:
      return f(uint16_t{});
    default:
      break;
  }
  TESSEL_THROW(UnsupportedError, "Megatron dtype code {} is not an integer token type",
               static_cast<int>(t));
}

bool is_float(MegatronDType t) {
  return t == MegatronDType::f32 || t == MegatronDType::f64;
}

}  // namespace

size_t megatron_dtype_size(MegatronDType t) {
  switch (t) {
    case MegatronDType::u8:
    case MegatronDType::i8:
      return 1;
    case MegatronDType::i16:
    case MegatronDType::u16:
      return 2;
    case MegatronDType::i32:
    case MegatronDType::f32:
      return 4;
    case MegatronDType::i64:
    case MegatronDType::f64:
      return 8;
  }
  TESSEL_THROW(CorruptDataError, "unknown Megatron dtype code {}", static_cast<int>(t));
}

const char* megatron_dtype_name(MegatronDType t) {
  switch (t) {
    case MegatronDType::u8:
      return "uint8";
    case MegatronDType::i8:
      return "int8";
    case MegatronDType::i16:
      return "int16";
    case MegatronDType::i32:
      return "int32";
    case MegatronDType::i64:
      return "int64";
    case MegatronDType::f64:
      return "float64";
    case MegatronDType::f32:
      return "float32";
    case MegatronDType::u16:
      return "uint16";
  }
  return "unknown";
}

std::unique_ptr<MegatronDataset> MegatronDataset::open(const std::string& prefix,
                                                       const TokenSourceOptions& options) {
  TESSEL_CHECK(options.vocab_size <= kMaxVocabSize, InvalidArgumentError,
               "vocab size {} for Megatron dataset '{}' is above 2^31", options.vocab_size, prefix);
  std::unique_ptr<MegatronDataset> ds(new MegatronDataset());
  ds->prefix_ = prefix;
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";
  ds->idx_ = MappedFile::open(idx_path);
  ds->bin_ = MappedFile::open(bin_path);
  const std::byte* p = ds->idx_.data();
  const uint64_t idx_size = ds->idx_.size();

  TESSEL_CHECK(idx_size >= 9 && std::memcmp(p, kMegatronIndexMagic, 9) == 0, CorruptDataError,
               "'{}' is not a Megatron index (it does not start with \"MMIDIDX\\0\\0\"); pass the "
               "prefix of a Megatron .bin/.idx pair or a tessel token file",
               idx_path);
  TESSEL_CHECK(idx_size >= kHeaderBytes, CorruptDataError,
               "Megatron index '{}' is truncated: {} bytes is shorter than its {}-byte header; {}",
               idx_path, idx_size, kHeaderBytes, kRemake);
  const uint64_t version = load_le<uint64_t>(p + 9);
  TESSEL_CHECK(version == kMegatronIndexVersion, CorruptDataError,
               "Megatron index '{}' has version {}, only version {} is supported; {}", idx_path,
               version, kMegatronIndexVersion, kRemake);
  const auto code = load_le<uint8_t>(p + 17);
  TESSEL_CHECK(code >= 1 && code <= 8, CorruptDataError,
               "Megatron index '{}' has unknown dtype code {} (valid: 1-8); the index is damaged; "
               "{}",
               idx_path, code, kRemake);
  ds->dtype_ = static_cast<MegatronDType>(code);
  TESSEL_CHECK(!is_float(ds->dtype_), UnsupportedError,
               "Megatron dataset '{}' stores {} tokens; token ids must be integers, re-tokenize "
               "with an integer dtype",
               prefix, megatron_dtype_name(ds->dtype_));
  ds->item_ = megatron_dtype_size(ds->dtype_);

  const uint64_t seqs = load_le<uint64_t>(p + 18);
  const uint64_t docs = load_le<uint64_t>(p + 26);
  const uint64_t body = idx_size - kHeaderBytes;
  TESSEL_CHECK(seqs <= body / 12 && docs <= body / 8 && body == seqs * 12 + docs * 8,
               CorruptDataError,
               "Megatron index '{}' has {} bytes but its header promises {} sequences and {} "
               "document entries ({} bytes of tables after the {}-byte header); the file is "
               "truncated or damaged; {}",
               idx_path, idx_size, seqs, docs,
               seqs <= body / 12 && docs <= body / 8 ? fmt::to_string(seqs * 12 + docs * 8)
                                                     : std::string("more than the file's"),
               kHeaderBytes, kRemake);
  ds->num_sequences_ = static_cast<int64_t>(seqs);
  ds->num_doc_index_ = static_cast<int64_t>(docs);
  ds->sizes_ = p + kHeaderBytes;
  ds->pointers_ = ds->sizes_ + 4 * seqs;
  const std::byte* doc_idx = ds->pointers_ + 8 * seqs;

  int64_t previous = 0;
  for (uint64_t d = 0; d < docs; ++d) {
    const int64_t v = load_le<int64_t>(doc_idx + 8 * d);
    TESSEL_CHECK(v >= previous && v <= ds->num_sequences_, CorruptDataError,
                 "Megatron index '{}': document index entry {} is {}, but entries must be "
                 "non-decreasing sequence numbers in [0, {}]; {}",
                 idx_path, d, v, seqs, kRemake);
    previous = v;
  }

  const uint64_t bin_size = ds->bin_.size();
  const uint64_t item = ds->item_;
  int64_t total = 0;
  for (int64_t i = 0; i < ds->num_sequences_; ++i) {
    const int64_t n = ds->sequence_size(i);
    const int64_t ptr = ds->sequence_pointer(i);
    TESSEL_CHECK(n >= 0, CorruptDataError,
                 "Megatron index '{}': sequence {} has negative size {}; {}", idx_path, i, n,
                 kRemake);
    TESSEL_CHECK(ptr >= 0 && uint64_t(ptr) <= bin_size && uint64_t(n) * item <= bin_size - ptr,
                 CorruptDataError,
                 "Megatron index '{}': sequence {} ({} tokens of {} bytes at byte {}) does not lie "
                 "inside '{}' ({} bytes); the .idx and .bin do not belong together or the .bin is "
                 "truncated; {}",
                 idx_path, i, n, item, ptr, bin_path, bin_size, kRemake);
    if (i > 0 && ptr != ds->sequence_pointer(i - 1) + ds->sequence_size(i - 1) * int64_t(item))
      ds->contiguous_ = false;
    total += n;
  }
  ds->total_tokens_ = total;
  if (!ds->contiguous_) {
    ds->starts_.resize(seqs + 1);
    ds->starts_[0] = 0;
    for (int64_t i = 0; i < ds->num_sequences_; ++i)
      ds->starts_[i + 1] = ds->starts_[i] + ds->sequence_size(i);
  }

  if (options.vocab_size == 0) {
    ds->scan_tokens(/*infer_vocab=*/true);
  } else {
    ds->vocab_ = options.vocab_size;
    if (options.verify) ds->scan_tokens(/*infer_vocab=*/false);
  }
  return ds;
}

int32_t MegatronDataset::sequence_size(int64_t i) const {
  return load_le<int32_t>(sizes_ + 4 * i);
}

int64_t MegatronDataset::sequence_pointer(int64_t i) const {
  return load_le<int64_t>(pointers_ + 8 * i);
}

int64_t MegatronDataset::sequence_start(int64_t i) const {
  if (!contiguous_) return starts_[i];
  return (sequence_pointer(i) - sequence_pointer(0)) / static_cast<int64_t>(item_);
}

void MegatronDataset::scan_tokens(bool infer_vocab) {
  // Reuse read() so the scan reports exactly what a later read would. While inferring, accept
  // every id that fits int32; negative ids are rejected either way.
  if (infer_vocab) vocab_ = kMaxVocabSize;
  constexpr int64_t kChunk = 1 << 20;
  const int64_t chunks = (total_tokens_ + kChunk - 1) / kChunk;
  int64_t max_id = -1;
  int64_t failed_chunk = std::numeric_limits<int64_t>::max();
  std::exception_ptr failure;
  std::mutex mu;
#pragma omp parallel reduction(max : max_id)
  {
    std::vector<int32_t> buf(static_cast<size_t>(std::min(kChunk, total_tokens_)));
#pragma omp for schedule(dynamic)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * kChunk;
      const int64_t n = std::min(kChunk, total_tokens_ - begin);
      try {
        read(begin, n, buf.data());
        for (int64_t i = 0; i < n; ++i) max_id = std::max<int64_t>(max_id, buf[i]);
      } catch (...) {
        // Report the earliest bad chunk so the message does not depend on thread timing.
        std::lock_guard<std::mutex> lock(mu);
        if (c < failed_chunk) {
          failed_chunk = c;
          failure = std::current_exception();
        }
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  if (infer_vocab) {
    vocab_ = static_cast<uint64_t>(max_id + 1);
    if (vocab_ == 0) vocab_ = 1;  // an empty dataset still has a well-formed (unused) vocab
    vocab_inferred_ = true;
  }
}

void MegatronDataset::read(int64_t offset, int64_t count, int32_t* out) const {
  check_read_range(*this, offset, count);
  if (count == 0) return;
  with_token_type(dtype_, [&](auto tag) {
    using T = decltype(tag);
    auto convert = [&](const std::byte* src, int64_t stream_pos, int64_t n, int32_t* dst) {
      const int64_t bad = convert_tokens_checked<T>(src, n, vocab_, dst);
      if (bad >= 0)
        throw_bad_token(*this, stream_pos + bad,
                        static_cast<int64_t>(load_le<T>(src + bad * sizeof(T))));
    };
    if (contiguous_) {
      convert(bin_.data() + sequence_pointer(0) + offset * sizeof(T), offset, count, out);
      return;
    }
    // The sequence holding `offset` is the last one starting at or before it.
    int64_t seq = std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin() - 1;
    int64_t pos = offset;
    while (count > 0) {
      const int64_t within = pos - starts_[seq];
      const int64_t n = std::min<int64_t>(count, starts_[seq + 1] - pos);
      if (n > 0) {
        convert(bin_.data() + sequence_pointer(seq) + within * sizeof(T), pos, n, out);
        out += n;
        pos += n;
        count -= n;
      }
      ++seq;
    }
  });
}

std::string MegatronDataset::describe() const {
  return fmt::format("Megatron dataset '{}' (.bin/.idx: {} sequences, {} tokens, {}, vocab {}{})",
                     prefix_, num_sequences_, total_tokens_, megatron_dtype_name(dtype_), vocab_,
                     vocab_inferred_ ? " inferred from the data" : "");
}

void write_megatron_dataset(const std::string& prefix,
                            const std::vector<std::vector<int64_t>>& documents,
                            MegatronDType dtype) {
  TESSEL_CHECK(
      !is_float(dtype) && static_cast<uint8_t>(dtype) >= 1 && static_cast<uint8_t>(dtype) <= 8,
      InvalidArgumentError,
      "cannot write Megatron dataset '{}' with dtype {}; token ids need an integer dtype", prefix,
      megatron_dtype_name(dtype));
  const size_t item = megatron_dtype_size(dtype);
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers;
  {
    AtomicFileWriter bin(prefix + ".bin");
    std::vector<std::byte> buf;
    for (size_t d = 0; d < documents.size(); ++d) {
      const auto& doc = documents[d];
      TESSEL_CHECK(doc.size() <= size_t(std::numeric_limits<int32_t>::max()), InvalidArgumentError,
                   "document {} of Megatron dataset '{}' has {} tokens, above int32 sizes", d,
                   prefix, doc.size());
      buf.resize(doc.size() * item);
      with_token_type(dtype, [&](auto tag) {
        using T = decltype(tag);
        for (size_t i = 0; i < doc.size(); ++i) {
          const int64_t v = doc[i];
          TESSEL_CHECK(
              v >= int64_t{std::numeric_limits<T>::min()} &&
                  v <= int64_t{std::numeric_limits<T>::max()},
              InvalidArgumentError,
              "token {} of document {} is {}, which does not fit Megatron dtype {} in '{}'", i, d,
              v, megatron_dtype_name(dtype), prefix);
          store_le<T>(buf.data() + i * sizeof(T), static_cast<T>(v));
        }
      });
      sizes.push_back(static_cast<int32_t>(doc.size()));
      pointers.push_back(static_cast<int64_t>(bin.size()));
      bin.write(buf.data(), buf.size());
    }
    bin.commit();
  }
  AtomicFileWriter idx(prefix + ".idx");
  std::byte header[kHeaderBytes];
  std::memcpy(header, kMegatronIndexMagic, 9);
  store_le<uint64_t>(header + 9, kMegatronIndexVersion);
  store_le<uint8_t>(header + 17, static_cast<uint8_t>(dtype));
  store_le<uint64_t>(header + 18, sizes.size());
  store_le<uint64_t>(header + 26, documents.size() + 1);
  idx.write(header, sizeof(header));
  idx.write(sizes.data(), sizes.size() * sizeof(int32_t));
  idx.write(pointers.data(), pointers.size() * sizeof(int64_t));
  std::vector<int64_t> doc_idx(documents.size() + 1);
  for (size_t d = 0; d < doc_idx.size(); ++d) doc_idx[d] = static_cast<int64_t>(d);
  idx.write(doc_idx.data(), doc_idx.size() * sizeof(int64_t));
  idx.commit();
}

}  // namespace tessel::data
