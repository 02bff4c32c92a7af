#include "tessel/tensor/tensor.h"

#include <cstring>

#include "tessel/core/check.h"
#include "tessel/tensor/allocator.h"

namespace tessel {

Storage::Storage(size_t bytes) : data_(HostAllocator::instance().allocate(bytes)), bytes_(bytes) {}
Storage::Storage(void* external, size_t bytes) : data_(external), bytes_(bytes), owned_(false) {}
Storage::~Storage() {
  if (owned_) HostAllocator::instance().deallocate(data_);
}

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes());
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  t.fill_zero();
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(data, t.nbytes());
  return t;
}

void* Tensor::raw() const {
  TESSEL_CHECK(storage_, InvalidArgumentError, "access to an undefined tensor");
  return static_cast<char*>(storage_->data()) + byte_offset_;
}

void throw_dtype_mismatch(DType have, DType want) {
  TESSEL_THROW(InvalidArgumentError, "tensor of dtype {} accessed as {}", dtype_name(have),
               dtype_name(want));
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  TESSEL_CHECK(offset >= 0 && offset + shape.numel() <= numel(), InvalidArgumentError,
               "view of {} elements at offset {} outside tensor {}", shape.numel(), offset, str());
  Tensor t = *this;
  t.byte_offset_ = byte_offset_ + size_t(offset) * dtype_size(dtype_);
  t.shape_ = shape;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  TESSEL_CHECK(shape.numel() == numel(), InvalidArgumentError, "reshape {} to {}", str(),
               shape.str());
  return view(0, shape);
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_);
  std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  Tensor t = empty(shape_, dtype);
  convert(raw(), dtype_, t.raw(), dtype, size_t(numel()));
  return t;
}

void Tensor::fill_zero() {
  std::memset(raw(), 0, nbytes());
}

void Tensor::copy_from(const Tensor& src) {
  TESSEL_CHECK(src.shape() == shape_, InvalidArgumentError, "copy {} into {}", src.str(), str());
  convert(src.raw(), src.dtype(), raw(), dtype_, size_t(numel()));
}

std::string Tensor::str() const {
  return std::string(dtype_name(dtype_)) + shape_.str();
}

}  // namespace tessel
