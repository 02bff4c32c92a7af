#include "tessel/comm/tcp_context.h"

#include <fcntl.h>
#include <gloo/common/error.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/pair.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

namespace tessel::comm::detail {

namespace {

namespace tcp = gloo::transport::tcp;

constexpr int kNoFd = -1;  // Gloo's FD_INVALID (private to pair.cc)

class HandshakeSafePair final : public tcp::Pair {
 public:
  // Pair's constructor registers the listening socket with the I/O thread before this class's
  // part exists; no event can come before the caller publishes the pair's address, though.
  using tcp::Pair::Pair;

  ~HandshakeSafePair() override {
    // ~Pair's soft close, while this object is still whole: unregistering the descriptor waits
    // for the I/O thread's current tick, and after it that thread never calls handleEvents on
    // this pair again, so it cannot run while the object is being torn down below this class.
    try {
      std::lock_guard<std::mutex> lock(m_);
      if (state_ != CLOSED) changeState(CLOSED);
    } catch (...) {
      // Only a broken mutex could get here; ~Pair tries again.
    }
  }

  // Gloo's Pair::handleEvents, with the handshake below instead of Gloo's and no exception left
  // to escape onto the I/O thread.
  void handleEvents(int events) override {
    // As Gloo does: a thread holding the lock may be waiting for this thread's tick (closing a
    // pair unregisters its descriptor), so this tick skips the pair rather than wait for it.
    std::unique_lock<std::mutex> lock(m_, std::try_to_lock);
    if (!lock) return;
    // A failed or closed pair has no descriptor registered (changeState), so no events either.
    if (ex_ != nullptr || state_ == CLOSED) return;
    try {
      switch (state_) {
        case CONNECTED:
          handleReadWrite(events);
          break;
        case LISTENING:
          accept_peer();
          break;
        case CONNECTING:
          finish_dial();
          break;
        default:
          break;
      }
    } catch (const std::exception& e) {
      fail(std::string("Gloo's I/O thread failed on the connection with ") + peer_.str() + ": " +
           e.what());
    } catch (...) {
      fail("Gloo's I/O thread failed on the connection with " + peer_.str());
    }
  }

 private:
  // Gloo's handleListening. Every path leaves fd_ either invalid or registered with the device,
  // which changeState(CLOSED) relies on (it unregisters a valid fd_, and Gloo enforces that
  // inside a noexcept function).
  void accept_peer() {
    sockaddr_storage from{};
    socklen_t from_len = sizeof(from);
    const int fd = ::accept(fd_, reinterpret_cast<sockaddr*>(&from), &from_len);
    const int accept_errno = errno;
    // A listening pair takes one connection: its listening socket goes whatever happened (and
    // closing it drops it from the device's epoll set should unregistering fail).
    try {
      device_->unregisterDescriptor(fd_, this);
    } catch (...) {
    }
    ::close(fd_);
    fd_ = kNoFd;
    if (fd == -1) {
      signalException(GLOO_ERROR_MSG("accept: ", std::strerror(accept_errno)));
      return;
    }
    peer_ = tcp::Address(from);
    try {
      device_->registerDescriptor(fd, EPOLLIN, this);
    } catch (...) {
      ::close(fd);
      throw;
    }
    fd_ = fd;
    finish_connection();
  }

  // Gloo's handleConnecting.
  void finish_dial() {
    int error = 0;
    socklen_t len = sizeof(error);
    if (::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &error, &len) == -1) error = errno;
    if (error != 0) {
      signalException(GLOO_ERROR_MSG("connect ", peer_.str(), ": ", std::strerror(error)));
      return;
    }
    finish_connection();
  }

  // Gloo's handleConnected, where a connection the peer reset in the meantime is a failure of
  // the pair instead of a failed enforce on this thread.
  void finish_connection() {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    // getpeername() is also the check that the connection is still there: it fails (ENOTCONN)
    // once the peer reset it, which may have happened before the accept or after SO_ERROR above
    // was read.
    if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&ss), &len) == -1) {
      const int peer_errno = errno;
      signalException(
          GLOO_ERROR_MSG("Connection reset by peer ", peer_.str(),
                         " during the handshake (getpeername: ", std::strerror(peer_errno), ")"));
      return;
    }
    peer_ = tcp::Address(ss);
    len = sizeof(ss);
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len) == 0) self_ = tcp::Address(ss);
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags == -1 || ::fcntl(fd_, F_SETFL, flags | O_NONBLOCK) == -1) {
      signalException(GLOO_ERROR_MSG("fcntl ", peer_.str(), ": ", std::strerror(errno)));
      return;
    }
    int on = 1;
    timeval tv{};
    tv.tv_sec = timeout_.count() / 1000;
    tv.tv_usec = (timeout_.count() % 1000) * 1000;
    if (::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on)) == -1 ||
        ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == -1 ||
        ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) == -1) {
      signalException(GLOO_ERROR_MSG("setsockopt ", peer_.str(), ": ", std::strerror(errno)));
      return;
    }
    device_->registerDescriptor(fd_, EPOLLIN, this);
    changeState(CONNECTED);
  }

  // Fails the pair (waking whoever waits on it with a gloo::IoException) unless it already has.
  void fail(const std::string& message) noexcept {
    try {
      if (ex_ == nullptr && state_ != CLOSED) signalException(message);
    } catch (...) {
      // Out of memory for the message: the pair is left for its timeout.
    }
  }
};

class HandshakeSafeContext final : public tcp::Context {
 public:
  using tcp::Context::Context;

  // tcp::Context::createPair, with the pair above.
  std::unique_ptr<gloo::transport::Pair>& createPair(int rank) override {
    pairs_[size_t(rank)] =
        std::make_unique<HandshakeSafePair>(this, device_.get(), rank, getTimeout());
    return pairs_[size_t(rank)];
  }
};

}  // namespace

std::shared_ptr<gloo::transport::Context> create_tcp_context(
    const std::shared_ptr<gloo::transport::Device>& device, int rank, int size) {
  auto tcp_device = std::dynamic_pointer_cast<tcp::Device>(device);
  if (!tcp_device) return device->createContext(rank, size);
  return std::make_shared<HandshakeSafeContext>(std::move(tcp_device), rank, size);
}

}  // namespace tessel::comm::detail
