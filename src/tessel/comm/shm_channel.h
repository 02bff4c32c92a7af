// ShmChannel: a one-way byte stream between two processes of one host, through a ring buffer in
// shared memory (Gloo has no shared-memory transport; this is what the Communicator uses between
// ranks on the same host, see shm_transport.h).
//
// One side create()s the channel, choosing whether it is the sender or the receiver; the other
// side open()s it by name() (passed however the two agree: the Communicator exchanges names over
// its connected Gloo mesh, a test through a pipe) and takes the other role. The segment is a
// memfd, so it never has a name in /dev/shm: nothing is left behind when either process dies at
// any moment, a stale segment of an earlier run cannot exist, and the size of /dev/shm does not
// matter. The opener reaches the creator's memfd through /proc/<pid>/fd/<fd> (same host, same
// pid namespace, a user allowed to read the creator's /proc entries); the name carries a random
// nonce that the segment must carry too, so a recycled pid or fd is refused.
//
// Layout: a header page (the producer's head and the consumer's tail as monotonically growing
// 64-bit byte counts, each on its own cache line; two 32-bit futex sequence words; a state word
// with the attach / close / abort flags; both pids), then `capacity` bytes of ring. Payload is
// copied straight from the sender's buffer into the ring and from the ring into the receiver's
// buffer (or handed to a consumer callback that reads it in place): no allocation per message.
// A message larger than the ring is streamed through it in pieces while the other side drains it.
//
// Waiting: a bounded spin first (the other side usually runs on another core), then FUTEX_WAIT on
// the sequence word the other side bumps after every publish, in slices of kLivenessSlice. After a
// slice without progress the peer's pid is checked (a pidfd where available, else kill(pid, 0)),
// so a peer killed with SIGKILL is noticed within about that long.
//
// Failure contract. Every blocking call has a deadline and throws
//   - TimeoutError   when the deadline passed ("... timed out after N ms with K of M bytes ...");
//   - PeerLostError  when the peer died, closed its end while this side still needed bytes, or
//                    aborted; or when this side was aborted (by abort(), from any thread);
//   - IoError        when the segment cannot be made or mapped (the message names the fix).
// Messages name the peer (the description given at create/open) and the bytes. Data the peer
// wrote before it died or closed is still delivered; only a wait for more fails. Any failure is
// final: the channel stays broken and later calls throw PeerLostError at once.
//
// Threads: one thread at a time may write (sender) or read (receiver); abort() may be called from
// any thread at any time and ends a blocked wait on either side at once.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

namespace tessel::comm {

// A non-owning reference to a callable (the consumer of read_with), so the channel's hot path
// stays out of line without std::function's allocation.
template <typename Signature>
class FunctionRef;

template <typename R, typename... Args>
class FunctionRef<R(Args...)> {
 public:
  template <typename F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef>)
      FunctionRef(F&& f)  // NOLINT: implicit on purpose, like std::function_ref
      : object_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(args)...);
        }) {}
  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

class ShmChannel {
 public:
  enum class Role { kSender, kReceiver };
  using Clock = std::chrono::steady_clock;

  // The ring size used when none is given; a multiple of the page size.
  static constexpr size_t kDefaultCapacity = size_t(1) << 20;
  // How long one futex wait lasts before the peer's liveness is checked.
  static constexpr std::chrono::milliseconds kLivenessSlice{100};

  // Makes a new segment with a ring of at least `capacity` bytes (rounded up to whole pages) and
  // takes `role` in it. `peer` describes the other side in messages ("rank 3", ...). Throws
  // InvalidArgumentError for capacity 0 or above 1 GiB, IoError when the memory cannot be had
  // (the memfd is fully allocated up front, so running out shows here and not as a SIGBUS later).
  static std::unique_ptr<ShmChannel> create(Role role, size_t capacity, std::string peer);

  // Maps the segment another process of this host create()d, by its name(), taking the other
  // role. Throws InvalidArgumentError for a malformed name, PeerLostError when the creator is gone
  // or no longer holds the segment (its fd was closed or now refers to something else), IoError
  // when /proc/<pid>/fd cannot be opened (another user, another pid namespace) or a second
  // process tries to open the same channel.
  static std::unique_ptr<ShmChannel> open(const std::string& name, std::string peer);

  // Closes this end (close()) and unmaps.
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // "<pid>:<fd>:<nonce>", what the peer passes to open(). Only meaningful on the creator.
  const std::string& name() const { return name_; }
  Role role() const { return role_; }
  size_t capacity() const { return capacity_; }
  const std::string& peer() const { return peer_; }

  // Creator: blocks until the peer has opened the channel, then drops the creator's handle on
  // the segment (after this the memory lives exactly as long as the two mappings). Not needed
  // for data to flow, but a creator that never calls it keeps one file descriptor per channel
  // until it is destroyed. Throws TimeoutError ("no peer opened ...") at the deadline and
  // PeerLostError when aborted. Returns at once on the opener.
  void wait_attached(Clock::time_point deadline);

  // Sender: blocks until all `bytes` are in the ring (not until the peer read them). Writing 0
  // bytes does nothing (and cannot fail).
  void write(const void* data, size_t bytes, Clock::time_point deadline);
  // Sender: copies as much of data[0, bytes) as fits now and returns how much that was; never
  // blocks. Throws PeerLostError once the channel is broken.
  size_t try_write(const void* data, size_t bytes);
  // Sender: the bytes try_write could take now.
  size_t writable() const;

  // Receiver: blocks until `bytes` bytes were copied into `data`.
  void read(void* data, size_t bytes, Clock::time_point deadline);
  // Receiver: consumes the next `bytes` bytes in place, handing them to `consume` as contiguous
  // spans in order (the ring memory, valid only during the call). Every span but the last is a
  // multiple of `granule` bytes, and so is the last when `bytes` is; with the stream position
  // and the capacity multiples of `granule`, every span is aligned to it (for reductions on
  // elements). `consume` may throw; the stream is then positioned after the spans it was given.
  void read_with(size_t bytes, size_t granule, Clock::time_point deadline,
                 FunctionRef<void(const std::byte*, size_t)> consume);
  // Receiver: the bytes available to read now.
  size_t readable() const;

  // Breaks the channel on purpose, from any thread: every blocked or later call on either side
  // throws PeerLostError at once (this side's message says "aborted by this process: <reason>",
  // the peer's that this side aborted). Idempotent (the first reason is kept); never throws.
  void abort(const std::string& reason) noexcept;
  // Ends this side gracefully: the peer still gets every byte written before; a wait of the peer
  // for more (or for space) throws PeerLostError. Idempotent; never throws.
  void close() noexcept;
  // Why the channel is broken, empty while it is healthy (also reflects the peer's abort/close
  // and a death noticed during a wait).
  std::string failure() const;

 private:
  struct Header;
  ShmChannel(Role role, std::string peer);
  void map(int fd, size_t total_bytes);
  pid_t peer_pid();
  bool peer_dead();
  // Throws when the channel is broken (ours or the peer's abort, or `need_peer_open` and the
  // peer closed its end).
  void check(const char* op, size_t done, size_t total, bool need_peer_open);
  // Waits (spin, then futex slices) until `ready()` or the deadline, the peer's death or an
  // abort. `seq` is the futex word the other side bumps after making progress.
  template <typename Ready>
  void wait_for(const char* op, std::atomic<uint32_t>& seq, std::atomic<uint32_t>& sleeping,
                Ready&& ready, size_t done, size_t total, Clock::time_point deadline);
  void set_failure(const std::string& message) noexcept;
  // Sets `flag` in the state word and wakes every sleeper on the channel to see it.
  void announce(uint32_t flag) noexcept;
  [[noreturn]] void fail(bool timeout, const std::string& message);
  void publish_head(uint64_t head);
  void publish_tail(uint64_t tail);

  Role role_;
  std::string peer_;
  std::string name_;
  size_t capacity_ = 0;
  size_t mapped_bytes_ = 0;
  Header* header_ = nullptr;
  std::byte* ring_ = nullptr;
  int creator_fd_ = -1;  // creator only, until the peer attached
  pid_t peer_pid_ = 0;
  int peer_pidfd_ = -1;
  uint64_t cached_head_ = 0;    // the sender's own head / the receiver's last view of it
  uint64_t cached_tail_ = 0;    // the receiver's own tail / the sender's last view of it
  Clock::time_point op_start_;  // when the running write or read began, for messages

  std::atomic<bool> broken_{false};  // failure_ is set: the fast path's one check
  mutable std::mutex mu_;            // guards failure_
  std::string failure_;
};

}  // namespace tessel::comm
