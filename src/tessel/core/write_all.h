// Writing a whole buffer to a file descriptor: the one loop behind every output that is not a
// file written whole (console lines, log files, metrics lines, a device or pipe an output names).
#pragma once

#include <cstddef>

namespace tessel {

// Writes all `size` bytes, retrying after EINTR and, on a non-blocking fd, waiting (at most 1 s
// each time) for room. False on error, with errno saying why (ETIMEDOUT: the fd stayed full).
bool write_all(int fd, const void* data, size_t size);

}  // namespace tessel
