#include "tessel/comm/shm_channel.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#include "tessel/core/check.h"

namespace tessel::comm {

namespace {

constexpr uint64_t kMagic = 0x314d485354534c54ull;  // "TLSTSHM1", little-endian
constexpr size_t kPage = 4096;
constexpr size_t kMaxCapacity = size_t(1) << 30;
constexpr const char* kMemfdName = "tessel-shm";

// State flags (Header::state).
constexpr uint32_t kAttached = 1;
constexpr uint32_t kSenderClosed = 2;
constexpr uint32_t kReceiverClosed = 4;
constexpr uint32_t kSenderAborted = 8;
constexpr uint32_t kReceiverAborted = 16;

// Spin iterations (each a PAUSE, tens of ns) before a wait goes to sleep: a few microseconds,
// about what a peer on another core needs to publish its next piece, and short enough not to steal
// much from a peer that shares this core.
constexpr int kSpins = 256;
// Bytes copied between two publications of head or tail: the other side starts on a piece while
// the next one is copied, and a large message does not wait for a whole ring's worth.
constexpr size_t kPublishBytes = size_t(64) << 10;

long futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = time_t(timeout.count() / 1000000000);
  ts.tv_nsec = long(timeout.count() % 1000000000);
  // Not FUTEX_PRIVATE_FLAG: the word is shared with another process.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr,
                 0);
}

void futex_wake(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

std::string errno_text(int e) {
  return std::strerror(e);
}

long long ms_since(ShmChannel::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(ShmChannel::Clock::now() - t)
      .count();
}

}  // namespace

struct ShmChannel::Header {
  uint64_t magic;
  uint64_t nonce;
  uint64_t capacity;
  int32_t creator_pid;
  uint32_t creator_role;  // Role of the creator
  // The bytes written so far (only the sender stores it) and read so far (only the receiver).
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  // Bumped by the sender after publishing head; the receiver sleeps on it.
  alignas(64) std::atomic<uint32_t> data_seq;
  std::atomic<uint32_t> receiver_sleeping;
  // Bumped by the receiver after publishing tail; the sender sleeps on it.
  alignas(64) std::atomic<uint32_t> space_seq;
  std::atomic<uint32_t> sender_sleeping;
  // Flags above; the creator sleeps on it until kAttached.
  alignas(64) std::atomic<uint32_t> state;
  std::atomic<int32_t> opener_pid;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the ring's counters must be lock-free to be shared between processes");

ShmChannel::ShmChannel(Role role, std::string peer) : role_(role), peer_(std::move(peer)) {}

ShmChannel::~ShmChannel() {
  if (header_ != nullptr) {
    close();
    munmap(header_, mapped_bytes_);
  }
  if (creator_fd_ >= 0) ::close(creator_fd_);
  if (peer_pidfd_ >= 0) ::close(peer_pidfd_);
}

void ShmChannel::map(int fd, size_t total_bytes) {
  static_assert(sizeof(Header) <= kPage, "the header must fit in the page before the ring");
  void* p = mmap(nullptr, total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    TESSEL_THROW(IoError, "shm channel to {}: cannot map {} bytes of shared memory: {}", peer_,
                 total_bytes, errno_text(e));
  }
  header_ = static_cast<Header*>(p);
  mapped_bytes_ = total_bytes;
  ring_ = static_cast<std::byte*>(p) + kPage;
}

std::unique_ptr<ShmChannel> ShmChannel::create(Role role, size_t capacity, std::string peer) {
  TESSEL_CHECK(capacity > 0 && capacity <= kMaxCapacity, InvalidArgumentError,
               "shm channel to {}: ring capacity {} bytes must be in (0, {}]", peer, capacity,
               kMaxCapacity);
  std::unique_ptr<ShmChannel> ch(new ShmChannel(role, std::move(peer)));
  ch->capacity_ = (capacity + kPage - 1) / kPage * kPage;
  const size_t total = kPage + ch->capacity_;
  const int fd = memfd_create(kMemfdName, MFD_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    TESSEL_THROW(IoError,
                 "shm channel to {}: memfd_create failed: {} (shared memory needs Linux "
                 ">= 3.17; turn it off with TransportOptions::shared_memory = false)",
                 ch->peer_, errno_text(e));
  }
  ch->creator_fd_ = fd;
  // Allocate every page now: tmpfs hands out pages lazily, and a page it cannot back later kills
  // the process with SIGBUS at the first touch instead of reporting anything.
  if (fallocate(fd, 0, 0, off_t(total)) != 0) {
    const int e = errno;
    TESSEL_THROW(IoError,
                 "shm channel to {}: cannot allocate {} bytes of shared memory: {}; free memory, "
                 "lower TransportOptions::shm_ring_bytes or turn shared memory off "
                 "(TransportOptions::shared_memory = false; TESSEL_SHARED_MEMORY=0 for tessel "
                 "train)",
                 ch->peer_, total, errno_text(e));
  }
  ch->map(fd, total);
  uint64_t nonce = 0;
  while (nonce == 0) {
    if (getrandom(&nonce, sizeof nonce, 0) != ssize_t(sizeof nonce)) {
      nonce = uint64_t(Clock::now().time_since_epoch().count()) ^ (uint64_t(getpid()) << 32);
    }
  }
  Header& h = *ch->header_;
  h.nonce = nonce;
  h.capacity = ch->capacity_;
  h.creator_pid = int32_t(getpid());
  h.creator_role = uint32_t(role);
  // Last: open() refuses a segment whose magic is not there yet.
  std::atomic_ref<uint64_t>(h.magic).store(kMagic, std::memory_order_release);
  ch->name_ = fmt::format("{}:{}:{:016x}", getpid(), fd, nonce);
  return ch;
}

std::unique_ptr<ShmChannel> ShmChannel::open(const std::string& name, std::string peer) {
  long long pid = 0;
  int fd = -1;
  unsigned long long nonce = 0;
  int consumed = 0;
  TESSEL_CHECK(std::sscanf(name.c_str(), "%lld:%d:%16llx%n", &pid, &fd, &nonce, &consumed) == 3 &&
                   size_t(consumed) == name.size() && pid > 0 && fd >= 0,
               InvalidArgumentError,
               "shm channel to {}: '{}' is not a channel name (<pid>:<fd>:<nonce>)", peer, name);
  const std::string path = fmt::format("/proc/{}/fd/{}", pid, fd);
  auto gone = [&](const std::string& why) {
    TESSEL_THROW(PeerLostError,
                 "shm channel to {}: cannot open channel '{}': the creating process (pid {}) {}",
                 peer, name, pid, why);
  };
  // A recycled pid or fd must not get a foreign file mapped read-write: look at what the fd is
  // before opening it, and at the header (through read, not a mapping) before mapping it.
  char link[256] = {};
  const ssize_t n = readlink(path.c_str(), link, sizeof link - 1);
  if (n < 0) {
    const int e = errno;
    if (e == ENOENT || e == ESRCH) gone("is gone or no longer holds the segment");
    TESSEL_THROW(IoError,
                 "shm channel to {}: cannot read {}: {} (shared memory needs both processes on "
                 "one host, in one pid namespace, under one user; turn it off with "
                 "TransportOptions::shared_memory = false)",
                 peer, path, errno_text(e));
  }
  if (std::strncmp(link, "/memfd:tessel-shm", 17) != 0) {
    gone(fmt::format("no longer holds the segment ({} is '{}')", path, link));
  }
  const int ofd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (ofd < 0) {
    const int e = errno;
    if (e == ENOENT) gone("is gone or no longer holds the segment");
    TESSEL_THROW(IoError, "shm channel to {}: cannot open {}: {}", peer, path, errno_text(e));
  }
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }
  } close_fd{ofd};
  struct stat st {};
  uint64_t fields[3] = {};  // magic, nonce, capacity
  if (fstat(ofd, &st) != 0 || size_t(st.st_size) < kPage ||
      pread(ofd, fields, sizeof fields, 0) != ssize_t(sizeof fields) || fields[0] != kMagic ||
      fields[1] != nonce || fields[2] == 0 || fields[2] > kMaxCapacity ||
      size_t(st.st_size) != kPage + fields[2]) {
    gone(fmt::format("no longer holds the segment ({} is another segment)", path));
  }
  std::unique_ptr<ShmChannel> ch(new ShmChannel(Role::kSender, std::move(peer)));
  ch->map(ofd, kPage + fields[2]);
  ch->capacity_ = fields[2];
  Header& h = *ch->header_;
  ch->role_ = h.creator_role == uint32_t(Role::kSender) ? Role::kReceiver : Role::kSender;
  int32_t expected = 0;
  if (!h.opener_pid.compare_exchange_strong(expected, int32_t(getpid()))) {
    TESSEL_THROW(IoError, "shm channel to {}: channel '{}' was already opened by pid {}", ch->peer_,
                 name, expected);
  }
  ch->peer_pid_ = pid_t(pid);
  ch->peer_pidfd_ = int(syscall(SYS_pidfd_open, pid_t(pid), 0));
  h.state.fetch_or(kAttached);
  futex_wake(h.state);
  // The creator may have sent already; start from where the stream is.
  ch->cached_head_ = h.head.load(std::memory_order_acquire);
  ch->cached_tail_ = h.tail.load(std::memory_order_acquire);
  return ch;
}

pid_t ShmChannel::peer_pid() {
  if (peer_pid_ == 0 && header_ != nullptr) {
    const int32_t p = header_->opener_pid.load(std::memory_order_acquire);
    if (p != 0) {
      peer_pid_ = p;
      peer_pidfd_ = int(syscall(SYS_pidfd_open, peer_pid_, 0));
    }
  }
  return peer_pid_;
}

bool ShmChannel::peer_dead() {
  if (peer_pid() == 0) return false;  // nobody opened it yet: nobody to lose
  if (peer_pidfd_ >= 0) {
    // A pidfd polls readable once the process has exited (zombies included, which kill(pid, 0)
    // would still find).
    pollfd p{peer_pidfd_, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
  }
  return kill(peer_pid_, 0) != 0 && errno == ESRCH;
}

void ShmChannel::set_failure(const std::string& message) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) failure_ = message;
  } catch (...) {
    // Out of memory or a broken mutex: the flag below still breaks the channel.
  }
  broken_.store(true, std::memory_order_release);
}

void ShmChannel::fail(bool timeout, const std::string& message) {
  set_failure(message);
  if (timeout) throw TimeoutError(message);
  throw PeerLostError(message);
}

std::string ShmChannel::failure() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) return failure_;
  }
  if (header_ == nullptr) return {};
  const uint32_t st = header_->state.load(std::memory_order_acquire);
  const uint32_t peer_aborted = role_ == Role::kSender ? kReceiverAborted : kSenderAborted;
  const uint32_t peer_closed = role_ == Role::kSender ? kReceiverClosed : kSenderClosed;
  if (st & peer_aborted) return fmt::format("shm channel to {}: the peer aborted it", peer_);
  if (st & peer_closed) return fmt::format("shm channel to {}: the peer closed its end", peer_);
  return {};
}

void ShmChannel::check(const char* op, size_t done, size_t total, bool need_peer_open) {
  const auto where = [&] {
    return fmt::format("shm channel to {}: {} of {} bytes failed with {} of them {}", peer_, op,
                       total, done, role_ == Role::kSender ? "written" : "read");
  };
  if (broken_.load(std::memory_order_acquire)) {
    std::string earlier;
    {
      std::lock_guard<std::mutex> lock(mu_);
      earlier = failure_;
    }
    if (earlier.empty()) earlier = "broken";
    throw PeerLostError(where() + ": " + earlier);
  }
  const uint32_t st = header_->state.load(std::memory_order_acquire);
  const uint32_t peer_aborted = role_ == Role::kSender ? kReceiverAborted : kSenderAborted;
  const uint32_t peer_closed = role_ == Role::kSender ? kReceiverClosed : kSenderClosed;
  if (st & peer_aborted) fail(false, where() + ": the peer aborted the channel");
  if (need_peer_open && (st & peer_closed)) {
    fail(false, where() + ": the peer closed its end");
  }
}

template <typename Ready>
void ShmChannel::wait_for(const char* op, std::atomic<uint32_t>& seq,
                          std::atomic<uint32_t>& sleeping, Ready&& ready, size_t done, size_t total,
                          Clock::time_point deadline) {
  for (int i = 0; i < kSpins; ++i) {
    if (ready()) return;
    _mm_pause();
  }
  for (;;) {
    // Readiness first: what the peer wrote before it closed or died is still delivered.
    if (ready()) return;
    check(op, done, total, true);
    const auto now = Clock::now();
    if (now >= deadline) {
      if (peer_dead()) {
        fail(false, fmt::format("shm channel to {} (pid {}): {} of {} bytes failed with {} of "
                                "them moved: the peer process died",
                                peer_, peer_pid_, op, total, done));
      }
      fail(true,
           fmt::format("shm channel to {}: {} of {} bytes timed out after {} ms with {} of them {}"
                       "{}",
                       peer_, op, total, ms_since(op_start_), done,
                       role_ == Role::kSender ? "written" : "read",
                       peer_pid() == 0 ? " (no peer has opened the channel)" : ""));
    }
    const auto slice = std::min<Clock::duration>(kLivenessSlice, deadline - now);
    sleeping.store(1);
    const uint32_t s = seq.load();
    // Checked after announcing the sleep and reading the sequence: a publication after this
    // check bumps the sequence (the futex then returns at once) and sees `sleeping` (and wakes).
    if (ready()) {
      sleeping.store(0, std::memory_order_relaxed);
      return;
    }
    const long r = futex_wait(seq, s, std::chrono::duration_cast<std::chrono::nanoseconds>(slice));
    const int e = errno;
    sleeping.store(0, std::memory_order_relaxed);
    if (r != 0 && e == ETIMEDOUT && !ready() && peer_dead()) {
      fail(false, fmt::format("shm channel to {} (pid {}): {} of {} bytes failed with {} of them "
                              "moved: the peer process died",
                              peer_, peer_pid_, op, total, done));
    }
  }
}

void ShmChannel::publish_head(uint64_t head) {
  Header& h = *header_;
  // Sequentially consistent: paired with the receiver's store to receiver_sleeping and its load
  // of head in wait_for, one of the two sides sees the other.
  h.head.store(head);
  h.data_seq.fetch_add(1);
  if (h.receiver_sleeping.load()) futex_wake(h.data_seq);
}

void ShmChannel::publish_tail(uint64_t tail) {
  Header& h = *header_;
  h.tail.store(tail);
  h.space_seq.fetch_add(1);
  if (h.sender_sleeping.load()) futex_wake(h.space_seq);
}

void ShmChannel::wait_attached(Clock::time_point deadline) {
  if (creator_fd_ < 0) return;
  Header& h = *header_;
  const auto start = Clock::now();
  for (;;) {
    const uint32_t st = h.state.load();
    if (st & kAttached) break;
    check("wait for the peer to open", 0, 0, false);
    const auto now = Clock::now();
    if (now >= deadline) {
      fail(true, fmt::format("shm channel to {}: no peer opened channel '{}' within {} ms", peer_,
                             name_, ms_since(start)));
    }
    futex_wait(h.state, st,
               std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::min<Clock::duration>(kLivenessSlice, deadline - now)));
  }
  peer_pid();
  ::close(creator_fd_);
  creator_fd_ = -1;
}

size_t ShmChannel::writable() const {
  return capacity_ - size_t(cached_head_ - header_->tail.load(std::memory_order_acquire));
}

size_t ShmChannel::readable() const {
  return size_t(header_->head.load(std::memory_order_acquire) - cached_tail_);
}

size_t ShmChannel::try_write(const void* data, size_t bytes) {
  TESSEL_CHECK(role_ == Role::kSender, InvalidArgumentError,
               "shm channel to {}: write on the receiving end", peer_);
  // Nothing to deliver, so nothing can fail: a receiver that read everything it needed and
  // closed must not fail the sender's empty tail (a frame's zero padding).
  if (bytes == 0) return 0;
  check("write", 0, bytes, true);
  const auto* src = static_cast<const std::byte*>(data);
  size_t done = 0;
  while (done < bytes) {
    size_t space = capacity_ - size_t(cached_head_ - cached_tail_);
    if (space == 0) {
      cached_tail_ = header_->tail.load(std::memory_order_acquire);
      space = capacity_ - size_t(cached_head_ - cached_tail_);
      if (space == 0) break;
    }
    const size_t n = std::min({space, bytes - done, kPublishBytes});
    const size_t pos = size_t(cached_head_ % capacity_);
    const size_t first = std::min(n, capacity_ - pos);
    std::memcpy(ring_ + pos, src + done, first);
    if (n > first) std::memcpy(ring_, src + done + first, n - first);
    cached_head_ += n;
    done += n;
    publish_head(cached_head_);
  }
  return done;
}

void ShmChannel::write(const void* data, size_t bytes, Clock::time_point deadline) {
  op_start_ = Clock::now();
  const auto* src = static_cast<const std::byte*>(data);
  size_t done = try_write(src, bytes);
  while (done < bytes) {
    Header& h = *header_;
    wait_for(
        "write", h.space_seq, h.sender_sleeping,
        [&] {
          cached_tail_ = h.tail.load(std::memory_order_acquire);
          return cached_head_ - cached_tail_ < capacity_;
        },
        done, bytes, deadline);
    done += try_write(src + done, bytes - done);
  }
}

void ShmChannel::read_with(size_t bytes, size_t granule, Clock::time_point deadline,
                           FunctionRef<void(const std::byte*, size_t)> consume) {
  TESSEL_CHECK(role_ == Role::kReceiver, InvalidArgumentError,
               "shm channel to {}: read on the sending end", peer_);
  TESSEL_CHECK(granule >= 1 && capacity_ % granule == 0, InvalidArgumentError,
               "shm channel to {}: granule {} does not divide the capacity {}", peer_, granule,
               capacity_);
  check("read", 0, bytes, false);
  op_start_ = Clock::now();
  Header& h = *header_;
  size_t done = 0;
  while (done < bytes) {
    const size_t want = std::min(granule, bytes - done);
    if (cached_head_ - cached_tail_ < want) {
      cached_head_ = h.head.load(std::memory_order_acquire);
      if (cached_head_ - cached_tail_ < want) {
        wait_for(
            "read", h.data_seq, h.receiver_sleeping,
            [&] {
              cached_head_ = h.head.load(std::memory_order_acquire);
              return cached_head_ - cached_tail_ >= want;
            },
            done, bytes, deadline);
      }
    }
    size_t n = std::min({size_t(cached_head_ - cached_tail_), bytes - done, kPublishBytes});
    if (n < bytes - done) n -= n % granule;
    const size_t pos = size_t(cached_tail_ % capacity_);
    const size_t first = std::min(n, capacity_ - pos);
    // The tail moves past what was handed over even if `consume` throws, so the stream stays
    // consistent for the caller's bookkeeping.
    struct Advance {
      ShmChannel& ch;
      size_t n;
      ~Advance() {
        ch.cached_tail_ += n;
        ch.publish_tail(ch.cached_tail_);
      }
    } advance{*this, n};
    consume(ring_ + pos, first);
    if (n > first) consume(ring_, n - first);
    done += n;
  }
}

void ShmChannel::read(void* data, size_t bytes, Clock::time_point deadline) {
  auto* dst = static_cast<std::byte*>(data);
  read_with(bytes, 1, deadline, [&](const std::byte* p, size_t n) {
    std::memcpy(dst, p, n);
    dst += n;
  });
}

void ShmChannel::abort(const std::string& reason) noexcept {
  try {
    set_failure("aborted by this process: " + reason);
  } catch (...) {
    set_failure("aborted by this process");
  }
  if (header_ == nullptr) return;
  announce(role_ == Role::kSender ? kSenderAborted : kReceiverAborted);
}

void ShmChannel::announce(uint32_t flag) noexcept {
  Header& h = *header_;
  h.state.fetch_or(flag);
  // Whoever sleeps on either word (the peer, or another thread of this process) wakes and sees
  // the flag.
  h.data_seq.fetch_add(1);
  h.space_seq.fetch_add(1);
  futex_wake(h.data_seq);
  futex_wake(h.space_seq);
  futex_wake(h.state);
}

void ShmChannel::close() noexcept {
  if (header_ == nullptr) return;
  set_failure("closed by this process");
  announce(role_ == Role::kSender ? kSenderClosed : kReceiverClosed);
}

}  // namespace tessel::comm
