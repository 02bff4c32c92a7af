// Reader for golden files: named tensors written by tools/golden.py (PyTorch reference values
// that the model's golden test compares the engine against).
//
// Format (all integers little-endian):
//   magic    8 bytes  "TSLGOLD\0"
//   version  u32      1
//   count    u32      number of records
//   count records, each:
//     name_len u32, name (name_len bytes of UTF-8, no terminator)
//     dtype    u32      1 = f32, 2 = i32
//     rank     u32      0 for a scalar (one element)
//     dims     i64[rank]
//     nbytes   u64      must equal numel(dims) * 4
//     data     nbytes   row-major, little-endian
//   nothing after the last record.
//
// Record names are "<model>/<kind>/..." (see tools/golden.py's docstring for the list).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "tessel/tensor/tensor.h"

namespace tessel::model {

class GoldenFile {
 public:
  // Reads the whole file. Throws IoError when it cannot be opened or read, CorruptDataError on a
  // bad magic, an unknown version or dtype, a truncated record, a size mismatch, a duplicate name
  // or trailing bytes.
  static GoldenFile read(const std::filesystem::path& path);
  // Parses an in-memory image of a golden file (same checks; `origin` names it in messages).
  static GoldenFile parse(std::span<const char> bytes, const std::string& origin);

  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // The tensor named `name` (f32 or i32, rank as stored). Throws InvalidArgumentError naming
  // the missing record.
  const Tensor& get(const std::string& name) const;
  // The single value of a one-element f32 or i32 record, as double.
  double scalar(const std::string& name) const;
  // Names of all records starting with `prefix`, in sorted order, with the prefix removed.
  std::vector<std::string> names_under(const std::string& prefix) const;
  size_t size() const { return tensors_.size(); }

 private:
  std::map<std::string, Tensor> tensors_;
};

}  // namespace tessel::model
