#include "tessel/store/npy.h"

#include <fmt/format.h>

#include "tessel/core/check.h"

namespace tessel::store {

std::string npy_descr(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "<f4";
    case DType::f16:
      return "<f2";
    case DType::i32:
      return "<i4";
    case DType::i64:
      return "<i8";
    case DType::u8:
      return "|u1";
    case DType::u16:
      return "<u2";
    case DType::bf16:
      break;
  }
  TESSEL_THROW(UnsupportedError, "NumPy has no {} dtype; convert the tensor to f32 first",
               dtype_name(dtype));
}

std::string npy_header(DType dtype, const Shape& shape) {
  std::string dims;
  for (size_t d = 0; d < shape.rank(); ++d) dims += fmt::format("{}{}", d ? ", " : "", shape[d]);
  if (shape.rank() == 1) dims += ",";
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}",
                                 npy_descr(dtype), dims);
  // magic (6) + version (2) + length (2) + dict + padding + '\n' is a multiple of 64.
  const size_t unpadded = 10 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += char(dict.size() & 0xff);
  out += char(dict.size() >> 8);
  return out + dict;
}

}  // namespace tessel::store
