#include "tessel/core/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "tessel/core/check.h"

namespace tessel {

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  std::vector<char> name(path_.begin(), path_.end());
  const char suffix[] = ".tmp.XXXXXX";
  name.insert(name.end(), suffix, suffix + sizeof(suffix));  // includes the terminating NUL
  fd_ = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd_ < 0) {
    TESSEL_THROW(IoError,
                 "cannot create '{}' (temporary '{}'): {}; check that the directory exists "
                 "and is writable",
                 path_, name.data(), std::strerror(errno));
  }
  temp_path_ = name.data();
  ::fchmod(fd_, 0644);  // mkstemp creates 0600; datasets are meant to be shared
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_path_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, size_t n) {
  write_at(size_, data, n);
  size_ += n;
}

void AtomicFileWriter::write_at(uint64_t offset, const void* data, size_t n) {
  TESSEL_CHECK(fd_ >= 0, InvalidArgumentError, "write to '{}' after commit", path_);
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      TESSEL_THROW(IoError, "cannot write '{}': {}; check free disk space", path_,
                   w < 0 ? std::strerror(errno) : "no progress");
    }
    p += w;
    offset += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
}

void AtomicFileWriter::commit() {
  TESSEL_CHECK(fd_ >= 0, InvalidArgumentError, "'{}' committed twice", path_);
  if (::fsync(fd_) != 0) {
    TESSEL_THROW(IoError, "cannot flush '{}' to disk: {}", path_, std::strerror(errno));
  }
  if (::close(fd_) != 0) {
    fd_ = -1;
    ::unlink(temp_path_.c_str());
    TESSEL_THROW(IoError, "cannot close '{}': {}", path_, std::strerror(errno));
  }
  fd_ = -1;
  if (std::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(temp_path_.c_str());
    TESSEL_THROW(IoError, "cannot rename '{}' to '{}': {}", temp_path_, path_, std::strerror(err));
  }
  // The rename is durable only once the directory entry is on disk.
  auto dir = std::filesystem::path(path_).parent_path();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  AtomicFileWriter out(path);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

}  // namespace tessel
