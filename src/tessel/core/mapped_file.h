// A read-only memory mapping of a whole file.
//
// Datasets are mapped rather than read so that opening a multi-gigabyte corpus costs nothing, the
// page cache is shared between processes on one machine, and random sample reads touch only the
// pages they need. A mapping sees the file's inode: tessel's writers replace files by rename
// (atomic_file.h), so a running reader keeps the old contents; truncating a mapped file in place
// would make reads past the new end fault (SIGBUS), which no check here can prevent.
#pragma once

#include <cstddef>
#include <string>

namespace tessel {

class MappedFile {
 public:
  // Maps `path` read-only. Throws IoError naming the path (and the OS reason) when it is missing,
  // not a regular file, or cannot be opened or mapped. An empty file maps to size() == 0.
  static MappedFile open(const std::string& path);

  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Page-aligned start of the file's bytes (nullptr when empty); valid while this object lives.
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace tessel
