#include "tessel/tensor/allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>

#include "tessel/core/check.h"

namespace tessel {

namespace {

// Pieces per large block at most. Each is a kernel mapping (vm.max_map_count bounds them per
// process, 65530 by default) and costs a system call to move, so a block is assembled from a few
// large cached blocks rather than from every crumb.
constexpr size_t kMaxPieces = 32;

// `size` bytes (a multiple of 4 KiB) of fresh anonymous memory aligned to `align` (a power of two
// and multiple of 4 KiB): a larger mapping with its unaligned head and tail cut off.
char* map_aligned(size_t size, size_t align) {
  const size_t span = size + align;
  void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + align - 1) & ~(uintptr_t(align) - 1);
  const size_t head = aligned - base, tail = span - head - size;
  if (head > 0) ::munmap(raw, head);
  if (tail > 0) ::munmap(reinterpret_cast<char*>(aligned) + size, tail);
  return reinterpret_cast<char*>(aligned);
}

}  // namespace

HostAllocator& HostAllocator::instance() {
  // Never destroyed: tensors in static storage may be freed after main returns.
  static auto* a = new HostAllocator();
  return *a;
}

HostAllocator::~HostAllocator() {
  release_cached();
}

size_t HostAllocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  // Small: multiples of 512 B. Large: four classes per power of two (at most 25% waste), 4 KiB
  // granular, so reuse across similar sizes works without wasting much memory.
  if (bytes <= 4096) return (bytes + 511) / 512 * 512;
  size_t p = 1;
  while (p * 2 <= bytes) p *= 2;
  size_t step = std::max<size_t>(p / 4, 4096);
  return (bytes + step - 1) / step * step;
}

void* HostAllocator::allocate(size_t bytes) {
  const size_t size = round_size(bytes);
  {
    std::lock_guard lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      void* p = it->second;
      free_.erase(it);
      blocks_.at(p).cached = false;
      stats_.bytes_cached -= size;
      stats_.bytes_in_use += size;
      stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
      ++stats_.reused_allocations;
      return p;
    }
    if (size >= kLarge) return allocate_large(size);
  }
  // posix_memalign, unlike aligned_alloc, does not need the size to be a multiple of the
  // alignment.
  const size_t align = size >= (1u << 16) ? 4096 : kAlignment;
  void* p = nullptr;
  if (::posix_memalign(&p, align, size) != 0) throw std::bad_alloc();
  std::lock_guard lock(mu_);
  try {
    blocks_.emplace(p, Block{size, false, false, {}});
  } catch (...) {
    std::free(p);
    throw;
  }
  stats_.bytes_in_use += size;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  ++stats_.fresh_allocations;
  stats_.fresh_bytes += size;
  return p;
}

void* HostAllocator::allocate_large(size_t size) {
  // 2 MiB aligned and advised to use transparent huge pages: the big parameter, gradient and
  // optimizer buffers then take a TLB entry per 2 MiB instead of per 4 KiB (measured: the
  // gradient-norm pass over 124M floats goes 31 -> 16 ms).
  char* p = map_aligned(size, kLarge);
  if (huge_pages_.load(std::memory_order_relaxed)) ::madvise(p, size, MADV_HUGEPAGE);
  Block block{size, true, false, {}};
  size_t at = 0;
  try {
    block.pieces.reserve(kMaxPieces);
    // The largest cached large blocks first: the fewest moves.
    while (at < size && block.pieces.size() + 1 < kMaxPieces) {
      auto it = free_.end();
      while (it != free_.begin() && !blocks_.at(std::prev(it)->second).large) --it;
      if (it == free_.begin()) break;
      char* src = static_cast<char*>(std::prev(it)->second);
      const size_t want = std::min(std::prev(it)->first, size - at);
      free_.erase(std::prev(it));
      const size_t moved = take_prefix(src, want, p + at, block.pieces, at);
      at += moved;
      if (moved < want) break;  // the kernel refused a move: the rest is fresh
    }
    if (at < size) block.pieces.push_back({at, size - at});
    blocks_.emplace(p, std::move(block));
  } catch (...) {
    ::munmap(p, size);  // what was moved in is lost with it, as if freed
    stats_.bytes_cached -= at;
    throw;
  }
  stats_.bytes_cached -= at;
  stats_.bytes_in_use += size;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  ++stats_.fresh_allocations;
  stats_.fresh_bytes += size - at;
  stats_.assembled_bytes += at;
  return p;
}

size_t HostAllocator::take_prefix(char* src, size_t want, char* dst, std::vector<Piece>& moved,
                                  size_t at) {
  auto node = blocks_.extract(src);
  Block& b = node.mapped();
  size_t done = 0;
  size_t i = 0;
  for (; i < b.pieces.size() && done < want && moved.size() + 1 < kMaxPieces; ++i) {
    const size_t len = std::min(b.pieces[i].length, want - done);
    // The block's pieces are contiguous from its start: piece i begins at src + done.
    void* r = ::mremap(src + done, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, dst + done);
    if (r == MAP_FAILED) break;
    moved.push_back({at + done, len});
    done += len;
    if (len < b.pieces[i].length) break;  // piece i is split: its tail stays
  }
  if (done < b.size) {
    // What was not moved stays cached as a block of its own, where it is.
    Block rest{b.size - done, true, true, {}};
    for (const Piece& pc : b.pieces) {
      const size_t end = pc.offset + pc.length;
      if (end <= done) continue;
      const size_t begin = std::max(pc.offset, done);
      rest.pieces.push_back({begin - done, end - begin});
    }
    char* at_rest = src + done;
    blocks_.emplace(at_rest, std::move(rest));
    free_.emplace(b.size - done, at_rest);
  }
  return done;
}

void HostAllocator::deallocate(void* ptr) {
  if (!ptr) return;
  std::lock_guard lock(mu_);
  auto it = blocks_.find(ptr);
  TESSEL_CHECK(it != blocks_.end() && !it->second.cached, InvalidArgumentError,
               "deallocate of a pointer not from this allocator, or freed twice");
  it->second.cached = true;
  free_.emplace(it->second.size, ptr);
  stats_.bytes_in_use -= it->second.size;
  stats_.bytes_cached += it->second.size;
}

void HostAllocator::release_cached() {
  std::lock_guard lock(mu_);
  for (auto& [size, p] : free_) {
    auto it = blocks_.find(p);
    if (it->second.large) {
      // One call unmaps every mapping in the range.
      ::munmap(p, size);
    } else {
      std::free(p);
    }
    blocks_.erase(it);
  }
  free_.clear();
  stats_.bytes_cached = 0;
}

AllocatorStats HostAllocator::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace tessel
