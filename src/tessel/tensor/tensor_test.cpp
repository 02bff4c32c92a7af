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

}  // namespace
}  // namespace tessel
