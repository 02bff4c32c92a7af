#include "tessel/core/write_all.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

namespace tessel {

bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd w{fd, POLLOUT, 0};
      if (::poll(&w, 1, 1000) <= 0) {
        errno = ETIMEDOUT;
        return false;
      }
      continue;
    }
    if (n == 0) errno = EIO;  // no progress and no error: do not spin
    return false;
  }
  return true;
}

}  // namespace tessel
