#include "tessel/tensor/tensor.h"

#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/tensor/allocator.h"

namespace tessel {
namespace {

TEST(Tensor, BasicsAndViews) {
  Tensor t = Tensor::zeros({2, 3});
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.nbytes(), 24u);
  EXPECT_EQ(t.str(), "f32[2, 3]");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % HostAllocator::kAlignment, 0u);
  Tensor v = t.view(3, {3});
  v.data<float>()[0] = 5.0f;
  EXPECT_EQ(t.data<float>()[3], 5.0f);  // views share storage
  Tensor c = t.clone();
  c.data<float>()[3] = 1.0f;
  EXPECT_EQ(t.data<float>()[3], 5.0f);
  EXPECT_THROW(t.data<int32_t>(), InvalidArgumentError);
  EXPECT_THROW(t.view(4, {3}), InvalidArgumentError);
  EXPECT_THROW(t.reshape({7}), InvalidArgumentError);
  Tensor h = t.to(DType::bf16);
  EXPECT_EQ(h.dtype(), DType::bf16);
  EXPECT_EQ(h.to(DType::f32).data<float>()[3], 5.0f);
}

TEST(Allocator, SteadyStateReusesBlocksWithoutFreshAllocations) {
  auto& a = HostAllocator::instance();
  // First "step" allocates; later steps of the same shapes must be served from the cache.
  auto step = [] {
    Tensor x = Tensor::empty({256, 768});
    Tensor y = Tensor::empty({256, 3072});
    Tensor z = Tensor::empty({17});
    return x.numel() + y.numel() + z.numel();
  };
  step();
  uint64_t fresh = a.stats().fresh_allocations;
  for (int i = 0; i < 10; ++i) step();
  EXPECT_EQ(a.stats().fresh_allocations, fresh);
  EXPECT_GE(a.stats().reused_allocations, 30u);
}

TEST(Allocator, SizeClassesBoundWaste) {
  for (size_t bytes : {1ul, 100ul, 4097ul, 100000ul, 123456789ul}) {
    size_t r = HostAllocator::round_size(bytes);
    EXPECT_GE(r, bytes);
    EXPECT_LE(double(r), std::max(512.0, 1.25 * double(bytes) + 4096)) << bytes;
  }
}

}  // namespace
}  // namespace tessel
