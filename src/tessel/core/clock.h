// Durations and times for logs and event lines.
#pragma once

#include <chrono>

namespace tessel {

// Seconds from t0 to now on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Now on the wall clock (Unix time, seconds): for times compared between processes.
inline double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace tessel
