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
#include "tessel/core/write_all.h"

namespace tessel {

namespace {

namespace fs = std::filesystem;

// `path` with every symlink followed, also a final one that points to nothing yet (its file is
// what gets created). Bounded like the kernel's own resolution.
std::string follow_links(const std::string& path) {
  fs::path p = path;
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    if (!fs::is_symlink(fs::symlink_status(p, ec))) return p.string();
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) return p.string();
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  TESSEL_THROW(IoError, "cannot write '{}': too many levels of symbolic links", path);
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  struct stat st {};
  // The kernel's view first: it also follows links that name no path (/dev/stdout -> a pipe).
  if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    TESSEL_CHECK(!S_ISDIR(st.st_mode), IoError,
                 "cannot write '{}': it is a directory; name a file inside it", path_);
    // A device, a pipe or a socket: written through at commit(), never replaced.
    target_ = path_;
    through_ = true;
    return;
  }
  target_ = follow_links(path_);
  std::vector<char> name(target_.begin(), target_.end());
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
  const char* p = static_cast<const char*>(data);
  if (through_) {
    TESSEL_CHECK(!committed_, InvalidArgumentError, "write to '{}' after commit", path_);
    if (held_.size() < offset + n) held_.resize(size_t(offset + n));
    std::memcpy(held_.data() + offset, p, n);
    return;
  }
  TESSEL_CHECK(fd_ >= 0, InvalidArgumentError, "write to '{}' after commit", path_);
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
  if (through_) {
    TESSEL_CHECK(!committed_, InvalidArgumentError, "'{}' committed twice", path_);
    committed_ = true;
    // Non-blocking, so that a pipe nobody reads is an error now, not a wait without end; the
    // writes then block as usual (a reader that reads slowly is still a reader).
    const int fd = ::open(target_.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    TESSEL_CHECK(fd >= 0 || errno != ENXIO, IoError,
                 "cannot write '{}': it is a pipe and no process reads it", path_);
    TESSEL_CHECK(fd >= 0, IoError, "cannot open '{}' for writing: {}", path_, std::strerror(errno));
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    if (!write_all(fd, held_.data(), held_.size())) {
      const int err = errno;
      ::close(fd);
      TESSEL_THROW(IoError, "cannot write '{}': {}", path_, std::strerror(err));
    }
    TESSEL_CHECK(::close(fd) == 0, IoError, "cannot close '{}': {}", path_, std::strerror(errno));
    held_.clear();
    return;
  }
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
  if (std::rename(temp_path_.c_str(), target_.c_str()) != 0) {
    int err = errno;
    ::unlink(temp_path_.c_str());
    TESSEL_THROW(IoError, "cannot rename '{}' to '{}': {}", temp_path_, target_,
                 std::strerror(err));
  }
  // The rename is durable only once the directory entry is on disk.
  auto dir = std::filesystem::path(target_).parent_path();
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
