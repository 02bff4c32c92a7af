// The NumPy .npy format, version 1.0, for serving tensors to Python (`numpy.load`).
//
// A file is the magic "\x93NUMPY", version bytes 1 0, a u16 little-endian header length and a
// Python-literal dict {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded with
// spaces and a final newline so the data starts at a multiple of 64, then the raw C-order data.
#pragma once

#include <string>

#include "tessel/tensor/dtype.h"
#include "tessel/tensor/shape.h"

namespace tessel::store {

// NumPy's type string ("<f4", "<f2", "<i4", "<i8", "|u1", "<u2"). Throws UnsupportedError for
// bf16, which NumPy lacks (convert to f32 first).
std::string npy_descr(DType dtype);
// Everything before the data.
std::string npy_header(DType dtype, const Shape& shape);

}  // namespace tessel::store
