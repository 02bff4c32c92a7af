#include "tessel/tensor/box.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "tessel/core/check.h"

namespace tessel {

Box::Box(std::vector<int64_t> lo, std::vector<int64_t> hi)
    : lo_(std::move(lo)), hi_(std::move(hi)) {
  TESSEL_CHECK(lo_.size() == hi_.size(), InvalidArgumentError, "box corners of ranks {} and {}",
               lo_.size(), hi_.size());
}

Box Box::of(const Shape& shape) {
  return Box(std::vector<int64_t>(shape.rank(), 0), shape.dims());
}

namespace {

int64_t parse_index(std::string_view s, int64_t extent, const std::string& text) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  TESSEL_CHECK(ec == std::errc() && ptr == s.data() + s.size(), InvalidArgumentError,
               "box '{}': '{}' is not an integer", text, s);
  if (v < 0) v += extent;  // Python-style negative index
  return v;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

}  // namespace

Box Box::parse(const std::string& text, const Shape& shape) {
  std::vector<std::string_view> parts;
  std::string_view rest(text);
  if (!trim(rest).empty()) {
    while (true) {
      auto comma = rest.find(',');
      parts.push_back(trim(rest.substr(0, comma)));
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  TESSEL_CHECK(parts.size() <= shape.rank(), InvalidArgumentError,
               "box '{}' has {} dimensions but the tensor {} has {}", text, parts.size(),
               shape.str(), shape.rank());
  std::vector<int64_t> lo(shape.rank(), 0), hi = shape.dims();
  for (size_t d = 0; d < parts.size(); ++d) {
    auto p = parts[d];
    auto colon = p.find(':');
    if (colon == std::string_view::npos) {
      lo[d] = parse_index(p, shape[d], text);
      // Checked before the + 1, which would overflow for an index of 2^63 - 1.
      TESSEL_CHECK(0 <= lo[d] && lo[d] < shape[d], InvalidArgumentError,
                   "box '{}': dimension {} index {} is outside 0:{}", text, d, lo[d], shape[d]);
      hi[d] = lo[d] + 1;
    } else {
      auto a = trim(p.substr(0, colon)), b = trim(p.substr(colon + 1));
      if (!a.empty()) lo[d] = parse_index(a, shape[d], text);
      if (!b.empty()) hi[d] = parse_index(b, shape[d], text);
    }
    TESSEL_CHECK(0 <= lo[d] && lo[d] <= hi[d] && hi[d] <= shape[d], InvalidArgumentError,
                 "box '{}': dimension {} range {}:{} is outside 0:{}", text, d, lo[d], hi[d],
                 shape[d]);
  }
  return Box(std::move(lo), std::move(hi));
}

Shape Box::shape() const {
  std::vector<int64_t> dims(rank());
  for (size_t d = 0; d < rank(); ++d) dims[d] = extent(d);
  return Shape(std::move(dims));
}

int64_t Box::volume() const {
  int64_t v = 1;
  for (size_t d = 0; d < rank(); ++d) v *= extent(d);
  return v;
}

Box Box::intersect(const Box& other) const {
  TESSEL_CHECK(rank() == other.rank(), InvalidArgumentError, "intersect boxes {} and {}", str(),
               other.str());
  std::vector<int64_t> lo(rank()), hi(rank());
  for (size_t d = 0; d < rank(); ++d) {
    lo[d] = std::max(lo_[d], other.lo_[d]);
    hi[d] = std::max(lo[d], std::min(hi_[d], other.hi_[d]));
  }
  return Box(std::move(lo), std::move(hi));
}

bool Box::contains(const Box& other) const {
  if (rank() != other.rank()) return false;
  if (other.empty()) return true;
  for (size_t d = 0; d < rank(); ++d)
    if (other.lo_[d] < lo_[d] || other.hi_[d] > hi_[d]) return false;
  return true;
}

bool Box::contains_point(const std::vector<int64_t>& point) const {
  if (point.size() != rank()) return false;
  for (size_t d = 0; d < rank(); ++d)
    if (point[d] < lo_[d] || point[d] >= hi_[d]) return false;
  return true;
}

Box Box::translate(const std::vector<int64_t>& offset) const {
  TESSEL_CHECK(offset.size() == rank(), InvalidArgumentError, "translate box {} by rank {}", str(),
               offset.size());
  Box b = *this;
  for (size_t d = 0; d < rank(); ++d) {
    b.lo_[d] += offset[d];
    b.hi_[d] += offset[d];
  }
  return b;
}

Box Box::relative_to(const Box& origin) const {
  std::vector<int64_t> neg(origin.rank());
  for (size_t d = 0; d < origin.rank(); ++d) neg[d] = -origin.lo(d);
  return translate(neg);
}

std::string Box::str() const {
  std::string s = "[";
  for (size_t d = 0; d < rank(); ++d) {
    if (d) s += ", ";
    s += fmt::format("{}:{}", lo_[d], hi_[d]);
  }
  return s + "]";
}

}  // namespace tessel
