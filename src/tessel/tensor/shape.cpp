#include "tessel/tensor/shape.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessel/core/check.h"

namespace tessel {

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::vector<int64_t>(dims)) {}

Shape::Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {
  for (int64_t d : dims_) TESSEL_CHECK(d >= 0, InvalidArgumentError, "negative dimension {}", d);
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int64_t d : dims_) n *= d;
  return n;
}

std::vector<int64_t> Shape::strides() const {
  std::vector<int64_t> s(dims_.size(), 1);
  for (size_t i = dims_.size(); i-- > 1;) s[i - 1] = s[i] * dims_[i];
  return s;
}

std::string Shape::str() const {
  return fmt::format("[{}]", fmt::join(dims_, ", "));
}

}  // namespace tessel
