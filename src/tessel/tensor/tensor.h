// Tensor: a dense, row-major, contiguous array of one dtype in host memory.
//
// Storage is reference counted and comes from HostAllocator; copies of a Tensor share storage
// (like torch.Tensor), `clone()` copies the data. A tensor may be a view of a flat element range
// of another tensor's storage (see `view`), which is how a model's parameters live inside one
// contiguous buffer.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "tessel/tensor/dtype.h"
#include "tessel/tensor/shape.h"

namespace tessel {

class Storage {
 public:
  explicit Storage(size_t bytes);
  // Wraps memory owned elsewhere (not freed by Storage).
  Storage(void* external, size_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool owned_ = true;
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised contents.
  static Tensor empty(const Shape& shape, DType dtype = DType::f32);
  static Tensor zeros(const Shape& shape, DType dtype = DType::f32);
  // A tensor over memory owned by the caller, who keeps it alive.
  static Tensor wrap(void* data, const Shape& shape, DType dtype = DType::f32);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_[i]; }
  size_t rank() const { return shape_.rank(); }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }

  void* raw() const;
  // Typed access; throws InvalidArgumentError when T does not match the dtype.
  template <typename T>
  T* data() const;
  template <typename T>
  std::span<T> span() const {
    return {data<T>(), size_t(numel())};
  }

  // A tensor sharing storage: `shape.numel()` elements starting at flat element `offset`.
  Tensor view(int64_t offset, const Shape& shape) const;
  // Same elements, another shape of equal numel.
  Tensor reshape(const Shape& shape) const;
  Tensor clone() const;
  // Converted copy (or this tensor if the dtype already matches).
  Tensor to(DType dtype) const;
  void fill_zero();
  // Copies data from a tensor of equal shape (dtype converted).
  void copy_from(const Tensor& src);

  std::string str() const;  // "f32[2, 3]"

 private:
  std::shared_ptr<Storage> storage_;
  size_t byte_offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::u8;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::u16;
}

void throw_dtype_mismatch(DType have, DType want);

template <typename T>
T* Tensor::data() const {
  if (dtype_of<std::remove_const_t<T>>() != dtype_)
    throw_dtype_mismatch(dtype_, dtype_of<std::remove_const_t<T>>());
  return static_cast<T*>(raw());
}

}  // namespace tessel
