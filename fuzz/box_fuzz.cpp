// The box syntax of `tessel store get --box` and the tensor server's `?box=` (Box::parse,
// tensor/box.h), against a tensor shape chosen by the first input byte.
#include <vector>

#include "fuzz_util.h"
#include "tessel/tensor/box.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  if (size == 0) return 0;
  // Shapes as a checkpoint may hold them: empty dimensions, small ones and large ones, within the
  // index's limit of 2^60 elements.
  constexpr int64_t kDims[] = {0, 1, 3, 8, 4096, int64_t(1) << 36};
  const uint8_t pick = data[0];
  std::vector<int64_t> dims;
  int64_t numel = 1;
  for (int d = 0; d < pick % 4; ++d) {
    int64_t n = kDims[(pick / (4 << d)) % 6];
    if (numel > 0 && n > (int64_t(1) << 60) / numel) n = 2;
    dims.push_back(n);
    numel *= n;
  }
  const Shape shape(std::move(dims));
  const std::string text(fuzz::as_text(data + 1, size - 1));
  fuzz::expect_only_tessel_errors([&] {
    const Box box = Box::parse(text, shape);
    // What the server does next with the box: its shape and size, checked against the tensor.
    if (!Box::of(shape).contains(box)) __builtin_trap();
    (void)box.shape().numel();
    (void)box.volume();
    (void)box.str();
  });
  return 0;
}
