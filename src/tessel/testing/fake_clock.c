// A wall clock that jumps, for one process tree: preloaded (LD_PRELOAD) into a test's agent, it
// adds an offset to every reading of the real-time clock (clock_gettime(CLOCK_REALTIME*),
// gettimeofday, time) and leaves the monotonic clocks alone -- which is what an NTP step, a
// hand-set `date` or a VM restored from a snapshot does to a host. The offset, seconds as a
// decimal text, is in the file named by $TESSEL_FAKE_CLOCK_FILE; the test rewrites it to make the
// clock jump while the processes run, so it is read again on each call (the calls that reach here
// are rare: timestamps of log lines and records, never a wait). Children inherit the preload
// through the environment.
//
// Why not change the machine's clock: every other test running beside this one, and the CI
// machine itself, would jump too. Why not a hook in tessel: what a jump must not break is exactly
// the code that does not know about it.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static double offset_seconds(void) {
  const char* path = getenv("TESSEL_FAKE_CLOCK_FILE");
  if (path == NULL) return 0;
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[64];
  const ssize_t n = read(fd, text, sizeof text - 1);
  close(fd);
  if (n <= 0) return 0;
  text[n] = '\0';
  return strtod(text, NULL);
}

static void shift(struct timespec* ts) {
  const double offset = offset_seconds();
  const long long whole = (long long)offset;
  long long nsec = ts->tv_nsec + (long long)((offset - (double)whole) * 1e9);
  ts->tv_sec += whole;
  while (nsec < 0) {
    nsec += 1000000000LL;
    ts->tv_sec -= 1;
  }
  while (nsec >= 1000000000LL) {
    nsec -= 1000000000LL;
    ts->tv_sec += 1;
  }
  ts->tv_nsec = nsec;
}

typedef int (*clock_gettime_fn)(clockid_t, struct timespec*);

static int real_clock_gettime(clockid_t id, struct timespec* ts) {
  static clock_gettime_fn real = NULL;
  if (real == NULL) real = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
  return real(id, ts);
}

int clock_gettime(clockid_t id, struct timespec* ts) {
  const int rc = real_clock_gettime(id, ts);
  if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) shift(ts);
  return rc;
}

int gettimeofday(struct timeval* restrict tv, void* restrict tz) {
  (void)tz;
  struct timespec ts;
  const int rc = clock_gettime(CLOCK_REALTIME, &ts);
  if (rc == 0) {  // glibc declares tv non-null
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
  }
  return rc;
}

time_t time(time_t* out) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (out != NULL) *out = ts.tv_sec;
  return ts.tv_sec;
}
