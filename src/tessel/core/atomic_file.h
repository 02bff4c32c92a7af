// Writes a file so that it either appears complete under its final name or not at all.
//
// Bytes go to a temporary file beside the destination ("<name>.tmp.XXXXXX"); commit() fsyncs it,
// renames it over the destination and fsyncs the directory. If the writer is destroyed before
// commit() (an exception, a failed write), the temporary file is removed. A crash can leave a
// "*.tmp.*" file behind, but never a truncated file under the final name.
//
// What is at the destination is respected, never replaced by something else:
//  * a symlink is followed: the file it points to is written (atomically, beside it), and the
//    link stays a link (a dangling link gets its file created);
//  * a device, a pipe or a socket is written through: the bytes are kept until commit() and then
//    written to it in order (`--out /dev/null` or a FIFO work, and the node stays what it was;
//    a pipe that no process reads is an IoError at commit(), not a wait);
//  * a directory is an IoError naming it.
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
  std::string path_;       // as given (named in messages)
  std::string target_;     // where the bytes go: path_ with symlinks followed
  std::string temp_path_;  // empty when writing through to a device, pipe or socket
  int fd_ = -1;
  uint64_t size_ = 0;
  bool through_ = false;    // write through (not a regular file)
  bool committed_ = false;  // through_: commit() ran
  std::string held_;        // through_: the bytes, written at commit()
};

// The whole of `bytes` as the file `path`, through an AtomicFileWriter. Throws IoError.
void write_file_atomically(const std::string& path, std::string_view bytes);

}  // namespace tessel
