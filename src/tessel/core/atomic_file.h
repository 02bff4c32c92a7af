// Writes a file so that it either appears complete under its final name or not at all.
//
// Bytes go to a temporary file beside the destination ("<name>.tmp.XXXXXX"); commit() fsyncs it,
// renames it over the destination and fsyncs the directory. If the writer is destroyed before
// commit() (an exception, a failed write), the temporary file is removed. A crash can leave a
// "*.tmp.*" file behind, but never a truncated file under the final name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tessel {

class AtomicFileWriter {
 public:
  // Creates the temporary file. Throws IoError naming the destination when its directory does
  // not exist or is not writable.
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends n bytes at the current end. Throws IoError (e.g. disk full) naming the destination.
  void write(const void* data, size_t n);
  // Overwrites n bytes at `offset` (used to fill in a header once the body is known); the
  // append position is unchanged.
  void write_at(uint64_t offset, const void* data, size_t n);
  // Bytes appended so far.
  uint64_t size() const { return size_; }
  // Makes the file durable under its final name; afterwards the writer accepts no more writes.
  void commit();

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole of `bytes` as the file `path`, through an AtomicFileWriter. Throws IoError.
void write_file_atomically(const std::string& path, std::string_view bytes);

}  // namespace tessel
