// The Hugging Face safetensors format: writer and a validating, range-reading reader.
//
// Layout: u64 little-endian N | N bytes of JSON header | data. The header maps each tensor name
// to {"dtype": "F32"|"BF16"|..., "shape": [...], "data_offsets": [begin, end]} (offsets relative
// to the start of the data) and may hold "__metadata__": {string: string}. As Hugging Face's
// writer does, the header is padded with spaces so the data starts at a multiple of 8, and
// tensors are stored by decreasing dtype size (then by name), back to back, so every tensor is
// aligned to its element size. Files written here load with `safetensors.safe_open` and files
// written by Hugging Face read here (for the dtypes tessel has: F32 BF16 F16 I32 I64 U8 U16).
//
// The reader checks the header strictly at open, with no read of the data: header length sane
// (<= 100 MB, inside the file), valid JSON object, known dtypes, data_offsets matching
// dtype x shape, tensors tiling the data exactly (no overlap, no gap) and the file size equal to
// what the header promises (so a truncated file fails at open). Reads are pread()s of exactly the
// byte runs a box needs; a reader is safe to use from several threads at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/tensor/box.h"
#include "tessel/tensor/dtype.h"
#include "tessel/tensor/shape.h"

namespace tessel::store {

// One tensor to write: `data` holds shape.numel() elements of `dtype`, dense row-major,
// little-endian; it must stay valid until write_safetensors returns.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  const void* data = nullptr;
};

// Writes `tensors` and `metadata` to `path` atomically (temporary file, fsync, rename: see
// core/atomic_file.h). Returns the file size. Throws InvalidArgumentError for an empty, repeated
// or reserved ("__metadata__") name or missing data, IoError when the file cannot be written.
uint64_t write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                           const std::map<std::string, std::string>& metadata = {});

// Streaming: the same file, its tensors' bytes produced one at a time, so that a file larger
// than memory can be written from something read piece by piece (a conversion). `tensors` give
// names, dtypes and shapes (their data is not read). `produce(i, write)` is called once per tensor,
// in the file's order, and must pass exactly tensor i's bytes, in order, to `write` (in pieces of
// any size; IoError otherwise). `final_metadata`, when set, is called after the last tensor and
// replaces `metadata` in the header, which is then rewritten in place: it must encode to the same
// length (e.g. checksums of fixed width, computed while producing; InvalidArgumentError
// otherwise). Atomic like write_safetensors.
struct SafetensorsStream {
  using Write = std::function<void(const void* data, size_t n)>;
  std::function<void(size_t index, const Write& write)> produce;
  std::function<std::map<std::string, std::string>()> final_metadata;
};
uint64_t write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                           const std::map<std::string, std::string>& metadata,
                           const SafetensorsStream& stream);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t offset = 0;  // absolute file offset of the first byte
  uint64_t nbytes = 0;
};

class SafetensorsReader {
 public:
  // Opens and validates `path`. Throws IoError when it cannot be opened, CorruptDataError naming
  // the file (and the tensor, where one is at fault) for every header or size inconsistency,
  // UnsupportedError naming the tensor for a valid safetensors dtype tessel lacks (F64, I8, ...).
  static SafetensorsReader open(const std::string& path);

  const std::string& path() const;
  uint64_t file_size() const;
  // Bytes before the data: 8 + N.
  uint64_t header_bytes() const;
  // xxh3-64 of those 8 + N bytes (the checkpoint index records it to detect header damage).
  uint64_t header_xxh3() const;
  // In file order.
  const std::vector<SafetensorsEntry>& tensors() const;
  const std::map<std::string, std::string>& metadata() const;
  // nullptr when absent.
  const SafetensorsEntry* find(std::string_view name) const;
  // Throws InvalidArgumentError naming the file when absent.
  const SafetensorsEntry& at(std::string_view name) const;

  // Reads n bytes at absolute file offset `offset`. Throws CorruptDataError when the file ends
  // first (it shrank after open), IoError on a read error.
  void pread(uint64_t offset, void* out, uint64_t n) const;
  // Reads `box` of tensor `name` into `out` (box.volume() elements, dense row-major), reading
  // only the box's bytes. Throws InvalidArgumentError for an unknown name or a box outside the
  // tensor.
  void read_box(std::string_view name, const Box& box, void* out) const;
  void read(std::string_view name, void* out) const;

  // Bytes and pread calls issued so far by this reader (all copies of it), header included.
  uint64_t bytes_read() const;
  uint64_t read_calls() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace tessel::store
