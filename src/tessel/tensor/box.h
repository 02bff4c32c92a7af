// Box: an N-dimensional half-open hyper-rectangle [lo, hi) in index space.
//
// Boxes name parts of logical tensors: a tensor-parallel shard, a pipeline stage's layer, a
// sub-tensor read from a checkpoint. An empty box has some hi[d] <= lo[d]; intersecting disjoint
// boxes gives an empty box of the same rank.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessel/tensor/shape.h"

namespace tessel {

class Box {
 public:
  Box() = default;
  Box(std::vector<int64_t> lo, std::vector<int64_t> hi);
  // The whole extent of a shape: [0, shape).
  static Box of(const Shape& shape);
  // Parses "0:512,:" (per dimension "lo:hi", ":" for the whole extent, "i" for one index, open
  // ends allowed) against a shape. Throws InvalidArgumentError naming the bad part.
  static Box parse(const std::string& text, const Shape& shape);

  size_t rank() const { return lo_.size(); }
  const std::vector<int64_t>& lo() const { return lo_; }
  const std::vector<int64_t>& hi() const { return hi_; }
  int64_t lo(size_t d) const { return lo_[d]; }
  int64_t hi(size_t d) const { return hi_[d]; }
  int64_t extent(size_t d) const { return hi_[d] > lo_[d] ? hi_[d] - lo_[d] : 0; }
  Shape shape() const;
  int64_t volume() const;
  bool empty() const { return volume() == 0; }

  Box intersect(const Box& other) const;
  bool contains(const Box& other) const;  // an empty box is contained in any box of equal rank
  bool contains_point(const std::vector<int64_t>& point) const;
  Box translate(const std::vector<int64_t>& offset) const;
  // This box in coordinates relative to `origin`'s low corner (translate by -origin.lo()).
  Box relative_to(const Box& origin) const;

  // "[0:512, 0:768]"
  std::string str() const;
  bool operator==(const Box&) const = default;

 private:
  std::vector<int64_t> lo_, hi_;
};

}  // namespace tessel
