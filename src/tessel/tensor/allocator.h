// A caching allocator for aligned host memory.
//
// Training allocates the same buffer sizes every step. Returning freed blocks to the OS and taking
// fresh ones back costs a page fault per 4 KiB page on first touch (~10 µs each on our machines),
// so freed blocks are kept and handed out again; after the first step a steady-state training
// loop touches no new pages.
//
// Small blocks (below 2 MiB) are cached per size class. Large blocks are mapped by the allocator
// itself, 2 MiB aligned and asked to be backed by transparent huge pages (fewer TLB misses in the
// passes over parameters and optimizer state); set_huge_pages(false) (training.huge_pages: false)
// turns that off. A live switch of plans asks for new sizes (another micro-batch size, another
// share of the model) while it frees the old ones, and touching fresh memory is what its rebuild
// costs (on a VM whose host backs guest memory lazily, seconds per GiB: bench/README.md, elastic).
// So cached large memory is fungible: a large request no cached block fits is assembled from the
// pages of cached large blocks, moved into the new block's address range with mremap(2) (page
// tables move; the pages stay touched and keep their contents), and only the rest is fresh. A
// process thus touches fresh memory only beyond the most it has held before.
//
// Thread-safe.
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
  uint64_t fresh_allocations = 0;   // blocks not served whole from the cache
  uint64_t reused_allocations = 0;  // blocks served whole from the cache
  size_t fresh_bytes = 0;           // bytes of new memory mapped (each page touched anew)
  size_t assembled_bytes = 0;       // bytes of cached blocks moved into new large blocks
};

class HostAllocator {
 public:
  static constexpr size_t kAlignment = 64;
  // Blocks of this size and more are large: mapped by the allocator, 2 MiB aligned.
  static constexpr size_t kLarge = size_t(2) << 20;

  // The process-wide allocator.
  static HostAllocator& instance();

  // Returns a block of at least `bytes` (rounded up to a size class), aligned to kAlignment
  // (blocks of 64 KiB and more to 4 KiB, large ones to 2 MiB). Its contents are unspecified
  // (a block assembled from cached pages holds their old contents). Throws std::bad_alloc when
  // the OS refuses.
  void* allocate(size_t bytes);
  // Returns a block obtained from allocate(); it is cached, not released.
  void deallocate(void* ptr);
  // Releases every cached block to the OS.
  void release_cached();
  // Whether new large blocks are advised to use transparent huge pages (default on).
  void set_huge_pages(bool on) { huge_pages_.store(on, std::memory_order_relaxed); }
  AllocatorStats stats() const;

  // The size class a request of `bytes` is served from.
  static size_t round_size(size_t bytes);

  HostAllocator() = default;
  ~HostAllocator();
  HostAllocator(const HostAllocator&) = delete;
  HostAllocator& operator=(const HostAllocator&) = delete;

 private:
  // A byte range [offset, offset + length) of a large block that lies in one kernel mapping
  // (mremap moves a range only within one mapping).
  struct Piece {
    size_t offset, length;
  };
  struct Block {
    size_t size = 0;
    bool large = false;
    bool cached = false;
    std::vector<Piece> pieces;  // large blocks: in address order, covering [0, size)
  };

  // A new large block of `size` bytes (lock held): cached pages first, fresh memory for the rest.
  void* allocate_large(size_t size);
  // Moves the first `want` bytes of cached block `src` (taken out of free_ by the caller) to
  // `dst`, appending the moved pieces to `moved` at offset `at` of their new block (lock held);
  // what is left of the block stays cached where it is. Returns the bytes moved: fewer than
  // `want` when the kernel refused a move or the block would have too many pieces.
  size_t take_prefix(char* src, size_t want, char* dst, std::vector<Piece>& moved, size_t at);

  mutable std::mutex mu_;
  std::atomic<bool> huge_pages_{true};
  std::map<void*, Block> blocks_;      // every block, live or cached
  std::multimap<size_t, void*> free_;  // cached blocks by size
  AllocatorStats stats_;
};

}  // namespace tessel
