// Shape: the extent of each dimension of a dense, row-major tensor.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace tessel {

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::vector<int64_t> dims);

  size_t rank() const { return dims_.size(); }
  int64_t operator[](size_t i) const { return dims_[i]; }
  int64_t& operator[](size_t i) { return dims_[i]; }
  const std::vector<int64_t>& dims() const { return dims_; }
  // Product of the dimensions (1 for rank 0).
  int64_t numel() const;
  // Row-major strides in elements.
  std::vector<int64_t> strides() const;
  // "[2, 3, 4]"
  std::string str() const;

  bool operator==(const Shape&) const = default;

 private:
  std::vector<int64_t> dims_;
};

}  // namespace tessel
