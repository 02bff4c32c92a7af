// A caching allocator for aligned host memory.
//
// Training allocates the same buffer sizes every step. Returning freed blocks to the OS and taking
// fresh ones back costs a page fault per 4 KiB page on first touch (~10 µs each on our machines),
// so freed blocks are kept in per-size free lists and handed out again; after the first step a
// steady-state training loop touches no new pages. Blocks of 2 MiB and more are 2 MiB aligned and
// asked to be backed by transparent huge pages (fewer TLB misses in the passes over parameters
// and optimizer state); set_huge_pages(false) (training.huge_pages: false) turns that off (on a VM
// whose host backs guest memory lazily, the first touch of fresh huge pages is slow: see
// bench/README.md, elastic). Thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace tessel {

struct AllocatorStats {
  size_t bytes_in_use = 0;  // handed out and not yet freed
  size_t bytes_cached = 0;  // freed, kept for reuse
  size_t peak_bytes_in_use = 0;
  uint64_t fresh_allocations = 0;   // blocks obtained from the OS (each touches new pages)
  uint64_t reused_allocations = 0;  // blocks served from the cache
};

class HostAllocator {
 public:
  static constexpr size_t kAlignment = 64;

  // The process-wide allocator.
  static HostAllocator& instance();

  // Returns a block of at least `bytes` (rounded up to a size class), aligned to kAlignment
  // (large blocks to 4 KiB). Throws std::bad_alloc when the OS refuses.
  void* allocate(size_t bytes);
  // Returns a block obtained from allocate(); it is cached, not released.
  void deallocate(void* ptr);
  // Releases every cached block to the OS.
  void release_cached();
  // Whether new blocks of 2 MiB and more are advised to use transparent huge pages (default on).
  void set_huge_pages(bool on) { huge_pages_.store(on, std::memory_order_relaxed); }
  AllocatorStats stats() const;

  // The size class a request of `bytes` is served from.
  static size_t round_size(size_t bytes);

  HostAllocator() = default;
  ~HostAllocator();
  HostAllocator(const HostAllocator&) = delete;
  HostAllocator& operator=(const HostAllocator&) = delete;

 private:
  mutable std::mutex mu_;
  std::atomic<bool> huge_pages_{true};
  std::multimap<size_t, void*> free_;  // size class -> cached blocks
  std::map<void*, size_t> live_;       // block -> size class
  AllocatorStats stats_;
};

}  // namespace tessel
