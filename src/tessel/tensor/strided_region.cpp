#include "tessel/tensor/strided_region.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tessel/core/check.h"

namespace tessel {

StridedRegion StridedRegion::of_box(const Box& box, const Box& frame) {
  const size_t rank = box.rank();
  TESSEL_CHECK(frame.rank() == rank, InvalidArgumentError,
               "box {} and the array's box {} have different ranks", box.str(), frame.str());
  TESSEL_CHECK(frame.contains(box), InvalidArgumentError, "box {} is outside the array's box {}",
               box.str(), frame.str());
  StridedRegion r;
  r.strides.resize(rank);
  r.extents.resize(rank);
  int64_t stride = 1;
  for (size_t d = rank; d-- > 0;) {
    r.strides[d] = stride;
    r.extents[d] = box.extent(d);
    stride *= frame.extent(d);
  }
  if (!box.empty()) {
    for (size_t d = 0; d < rank; ++d) r.offset += (box.lo(d) - frame.lo(d)) * r.strides[d];
  }
  return r;
}

StridedRegion StridedRegion::of_box(const Box& box, const Shape& shape) {
  return of_box(box, Box::of(shape));
}

StridedRegion StridedRegion::dense(const Shape& shape) {
  return StridedRegion{0, shape.strides(), shape.dims()};
}

int64_t StridedRegion::numel() const {
  int64_t n = 1;
  for (int64_t e : extents) n *= e > 0 ? e : 0;
  return n;
}

int64_t StridedRegion::end() const {
  if (numel() == 0) return offset;
  int64_t last = offset;
  for (size_t d = 0; d < extents.size(); ++d) last += (extents[d] - 1) * strides[d];
  return last + 1;
}

bool StridedRegion::contiguous() const {
  if (numel() == 0) return true;
  int64_t expect = 1;
  for (size_t d = extents.size(); d-- > 0;) {
    if (extents[d] == 1) continue;
    if (strides[d] != expect) return false;
    expect *= extents[d];
  }
  return true;
}

std::string StridedRegion::str() const {
  return fmt::format("offset {}, strides [{}], extents [{}]", offset, fmt::join(strides, ", "),
                     fmt::join(extents, ", "));
}

void check_region_inside(const StridedRegion& r, int64_t size, const char* what) {
  TESSEL_CHECK(r.strides.size() == r.extents.size(), InvalidArgumentError,
               "{} region ({}) has {} strides for {} dimensions", what, r.str(), r.strides.size(),
               r.extents.size());
  if (r.numel() == 0) return;
  bool nonnegative = r.offset >= 0;
  for (int64_t s : r.strides) nonnegative = nonnegative && s >= 0;
  TESSEL_CHECK(nonnegative, InvalidArgumentError, "{} region ({}) has a negative offset or stride",
               what, r.str());
  TESSEL_CHECK(r.end() <= size, InvalidArgumentError,
               "{} region ({}) reaches element {} of a buffer of {} elements", what, r.str(),
               r.end() - 1, size);
}

}  // namespace tessel
