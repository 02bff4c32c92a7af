#include "tessel/net/sigpipe_hold.h"

#include <pthread.h>

#include <cerrno>
#include <ctime>

namespace tessel::net {

SigpipeHold::SigpipeHold() {
  sigemptyset(&pipe_);
  sigaddset(&pipe_, SIGPIPE);
  sigset_t pending;
  sigpending(&pending);
  was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
}

SigpipeHold::~SigpipeHold() {
  // A SIGPIPE pending before this hold is not ours to discard.
  if (!was_pending_) {
    sigset_t pending;
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE) == 1) {
      const int saved = errno;
      const timespec now{};
      while (sigtimedwait(&pipe_, nullptr, &now) < 0 && errno == EINTR) {
      }
      errno = saved;
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_, nullptr);
}

}  // namespace tessel::net
