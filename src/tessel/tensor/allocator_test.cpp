// The caching allocator: steady state from the cache, and large blocks assembled from the pages
// of cached ones (their contents moved, not copied) where no cached block fits.
#include "tessel/tensor/allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/tensor/tensor.h"

namespace tessel {
namespace {

constexpr size_t MiB = size_t(1) << 20;

// Fills `bytes` at p with a pattern that names `tag` and each 4 KiB page's index, so a page that
// moved to the wrong place or lost its contents shows.
void fill(void* p, size_t bytes, uint32_t tag) {
  auto* w = static_cast<uint32_t*>(p);
  for (size_t i = 0; i < bytes / 4; ++i) w[i] = tag * 1000003u + uint32_t(i / 1024);
}

// Whether `bytes` at p hold fill(.., tag)'s pattern from byte `from` of the filled range on.
bool holds(const void* p, size_t bytes, uint32_t tag, size_t from = 0) {
  const auto* w = static_cast<const uint32_t*>(p);
  for (size_t i = 0; i < bytes / 4; ++i)
    if (w[i] != tag * 1000003u + uint32_t((i + from / 4) / 1024)) return false;
  return true;
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

TEST(Allocator, ANewLargeBlockIsAssembledFromCachedPagesWithTheirContents) {
  HostAllocator a;
  void* four = a.allocate(4 * MiB);
  void* six = a.allocate(6 * MiB);
  fill(four, 4 * MiB, 1);
  fill(six, 6 * MiB, 2);
  a.deallocate(four);
  a.deallocate(six);
  const auto before = a.stats();
  EXPECT_EQ(before.bytes_cached, 10 * MiB);

  // No cached block is 8 MiB: the 6 MiB one moves in whole, then the first 2 MiB of the other.
  void* eight = a.allocate(8 * MiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(eight) % HostAllocator::kLarge, 0u);
  const auto after = a.stats();
  EXPECT_EQ(after.fresh_bytes, before.fresh_bytes);
  EXPECT_EQ(after.assembled_bytes - before.assembled_bytes, 8 * MiB);
  EXPECT_EQ(after.bytes_cached, 2 * MiB);
  EXPECT_EQ(after.bytes_in_use, 8 * MiB);
  EXPECT_TRUE(holds(eight, 6 * MiB, 2));
  EXPECT_TRUE(holds(static_cast<char*>(eight) + 6 * MiB, 2 * MiB, 1));

  // The rest of the 4 MiB block stayed where it was, as a cached 2 MiB block.
  void* rest = a.allocate(2 * MiB);
  EXPECT_EQ(rest, static_cast<char*>(four) + 2 * MiB);
  EXPECT_TRUE(holds(rest, 2 * MiB, 1, 2 * MiB));
  EXPECT_EQ(a.stats().fresh_bytes, before.fresh_bytes);

  // The assembled block is an ordinary block: writable, freed, and itself taken apart later.
  fill(eight, 8 * MiB, 3);
  a.deallocate(eight);
  a.deallocate(rest);
  void* twelve = a.allocate(12 * MiB);  // 8 + 2 cached, 2 fresh
  EXPECT_EQ(a.stats().fresh_bytes - before.fresh_bytes, 2 * MiB);
  EXPECT_TRUE(holds(twelve, 8 * MiB, 3));
  fill(twelve, 12 * MiB, 4);
  EXPECT_TRUE(holds(twelve, 12 * MiB, 4));
  a.deallocate(twelve);
  a.release_cached();
  EXPECT_EQ(a.stats().bytes_cached, 0u);
  EXPECT_EQ(a.stats().bytes_in_use, 0u);
}

// A block made of several pieces, split across a piece boundary: both parts keep their contents.
TEST(Allocator, AnAssembledBlockSplitsAcrossItsPieces) {
  HostAllocator a;
  void* x = a.allocate(3 * MiB);
  void* y = a.allocate(5 * MiB);
  fill(x, 3 * MiB, 5);
  fill(y, 5 * MiB, 6);
  a.deallocate(x);
  a.deallocate(y);
  void* both = a.allocate(8 * MiB);  // y's 5 MiB, then x's 3 MiB
  a.deallocate(both);
  void* part = a.allocate(7 * MiB);  // all of y's piece and 2 MiB of x's
  EXPECT_TRUE(holds(part, 5 * MiB, 6));
  EXPECT_TRUE(holds(static_cast<char*>(part) + 5 * MiB, 2 * MiB, 5));
  const auto s = a.stats();
  EXPECT_EQ(s.bytes_cached, 1 * MiB);
  void* tail = a.allocate(1 * MiB + 1);  // a small request never takes a large block's pages
  EXPECT_EQ(a.stats().bytes_cached, 1 * MiB);
  a.deallocate(tail);
  a.deallocate(part);
}

// Assembly stops at a bounded number of pieces (each is a kernel mapping): the rest is fresh.
TEST(Allocator, AssemblyTakesABoundedNumberOfPieces) {
  HostAllocator a;
  std::vector<void*> blocks;
  for (int i = 0; i < 40; ++i) blocks.push_back(a.allocate(2 * MiB));
  for (void* p : blocks) a.deallocate(p);
  const auto before = a.stats();
  void* big = a.allocate(80 * MiB);
  const auto after = a.stats();
  const size_t assembled = after.assembled_bytes - before.assembled_bytes;
  EXPECT_GT(assembled, 0u);
  EXPECT_LT(assembled, 80 * MiB);
  EXPECT_EQ(after.fresh_bytes - before.fresh_bytes, 80 * MiB - assembled);
  EXPECT_EQ(after.bytes_cached, before.bytes_cached - assembled);
  fill(big, 80 * MiB, 7);
  EXPECT_TRUE(holds(big, 80 * MiB, 7));
  a.deallocate(big);
}

TEST(Allocator, RejectsForeignAndDoubleFrees) {
  HostAllocator a;
  int local = 0;
  EXPECT_THROW(a.deallocate(&local), InvalidArgumentError);
  void* p = a.allocate(100);
  a.deallocate(p);
  EXPECT_THROW(a.deallocate(p), InvalidArgumentError);
  a.deallocate(nullptr);
}

}  // namespace
}  // namespace tessel
