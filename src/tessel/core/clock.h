// Durations and times for logs and event lines.
#pragma once

#include <time.h>

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

// CPU time the calling thread has used, seconds: unlike the steady clock, it does not advance
// while the thread waits for a core.
inline double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

}  // namespace tessel
