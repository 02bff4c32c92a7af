#include "tessel/comm/shm_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "tessel/comm/communicator.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"

namespace tessel::comm::detail {

namespace {

constexpr size_t kHeaderBytes = 16;   // slot, byte count
constexpr size_t kRecordBytes = 256;  // per rank: enabled flag, then the host identity
constexpr size_t kNameBytes = 64;     // per channel name
// How often a send wait looks at the incoming channels while receives are posted: soon at
// first, then less and less often while nothing arrives (a pipeline posts a whole step's
// receives up front, so this is the common case, and a long wait should not burn a core).
constexpr auto kFirstPumpInterval = std::chrono::microseconds(50);
constexpr auto kLastPumpInterval = std::chrono::microseconds(2000);
const std::byte kZeros[8] = {};

size_t padding(size_t bytes) {
  return (8 - bytes % 8) % 8;
}

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string link_of(const char* path) {
  char buf[128] = {};
  const ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

}  // namespace

std::string shm_host_id() {
  const std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  const std::string pidns = link_of("/proc/self/ns/pid");
  const std::string netns = link_of("/proc/self/ns/net");
  char host[256] = {};
  if (boot.empty() || pidns.empty() || netns.empty() || gethostname(host, sizeof host - 1) != 0) {
    return {};
  }
  return boot + "|" + pidns + "|" + netns + "|" + host;
}

ShmTransport::ShmTransport(int rank, int size, size_t ring_bytes, std::string group)
    : rank_(rank), size_(size), ring_bytes_(ring_bytes), group_(std::move(group)) {
  outgoing_.resize(size_t(size));
  incoming_.resize(size_t(size));
}

std::unique_ptr<ShmTransport> ShmTransport::connect(Communicator& comm,
                                                    const TransportOptions& options,
                                                    std::chrono::milliseconds timeout) {
  const int n = comm.size();
  const int me = comm.rank();
  // 1. Who is where.
  std::string host = options.shared_memory ? shm_host_id() : std::string();
  std::vector<char> record(kRecordBytes, 0);
  record[0] = host.empty() ? 0 : 1;
  std::memcpy(record.data() + 1, host.data(), std::min(host.size(), kRecordBytes - 1));
  std::vector<char> records(kRecordBytes * size_t(n));
  comm.all_gather(reinterpret_cast<const uint8_t*>(record.data()), kRecordBytes,
                  reinterpret_cast<uint8_t*>(records.data()), timeout);
  auto record_of = [&](int r) { return records.data() + size_t(r) * kRecordBytes; };
  auto local = [&](int a, int b) {
    return a != b && record_of(a)[0] == 1 && record_of(b)[0] == 1 &&
           std::memcmp(record_of(a), record_of(b), kRecordBytes) == 0;
  };
  std::vector<std::vector<int>> peers(
      static_cast<size_t>(n));  // each rank's local peers, ascending
  size_t pairs = 0;
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (local(a, b)) peers[size_t(a)].push_back(b);
    }
    pairs += peers[size_t(a)].size();
  }
  if (pairs == 0) return nullptr;

  // 2. Every rank creates its outgoing channels and publishes their names; then opens its
  // incoming ones. A failure is kept until everyone has said whether they managed.
  std::unique_ptr<ShmTransport> t(new ShmTransport(me, n, options.shm_ring_bytes, comm.name()));
  auto peer_name = [&](int p) { return fmt::format("rank {} of group '{}'", p, comm.name()); };
  const auto& mine = peers[size_t(me)];
  std::string error;
  std::vector<char> names(mine.size() * kNameBytes, 0);
  try {
    for (size_t i = 0; i < mine.size(); ++i) {
      auto out = std::make_unique<Outgoing>();
      out->ch =
          ShmChannel::create(ShmChannel::Role::kSender, options.shm_ring_bytes, peer_name(mine[i]));
      const std::string& name = out->ch->name();
      TESSEL_CHECK(name.size() < kNameBytes, IoError, "channel name '{}' too long", name);
      std::memcpy(names.data() + i * kNameBytes, name.data(), name.size());
      t->outgoing_[size_t(mine[i])] = std::move(out);
    }
  } catch (const Error& e) {
    error = e.what();
  }
  std::vector<size_t> counts(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) counts[size_t(r)] = peers[size_t(r)].size() * kNameBytes;
  std::vector<char> all_names(pairs * kNameBytes);
  comm.all_gather_v(reinterpret_cast<const uint8_t*>(names.data()), counts,
                    reinterpret_cast<uint8_t*>(all_names.data()), timeout);
  size_t offset = 0;
  std::vector<size_t> offsets(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    offsets[size_t(r)] = offset;
    offset += counts[size_t(r)];
  }
  if (error.empty()) {
    try {
      for (int p : mine) {
        const auto& theirs = peers[size_t(p)];
        const size_t i = size_t(std::find(theirs.begin(), theirs.end(), me) - theirs.begin());
        const char* entry = all_names.data() + offsets[size_t(p)] + i * kNameBytes;
        const std::string name(entry, strnlen(entry, kNameBytes));
        TESSEL_CHECK(!name.empty(), IoError, "{} could not create its channel", peer_name(p));
        auto in = std::make_unique<Incoming>();
        in->ch = ShmChannel::open(name, peer_name(p));
        t->incoming_[size_t(p)] = std::move(in);
      }
    } catch (const Error& e) {
      error = e.what();
    }
  }

  // 3. Agree.
  const uint8_t ok = error.empty() ? 1 : 0;
  std::vector<uint8_t> oks(static_cast<size_t>(n));
  comm.all_gather(&ok, 1, oks.data(), timeout);
  const auto failed = std::find(oks.begin(), oks.end(), uint8_t(0));
  if (failed != oks.end()) {
    if (!error.empty()) {
      spdlog::warn(
          "group '{}' rank {}: shared memory between the processes of this host is off, "
          "all traffic goes over TCP: {}",
          comm.name(), me, error);
    } else {
      spdlog::warn(
          "group '{}' rank {}: shared memory is off for the whole group (rank {} could "
          "not set it up; see its log), all traffic goes over TCP",
          comm.name(), me, failed - oks.begin());
    }
    return nullptr;
  }
  const auto deadline = Clock::now() + timeout;
  for (auto& out : t->outgoing_) {
    if (out) out->ch->wait_attached(deadline);
  }
  t->reaches_all_ = mine.size() == size_t(n - 1);
  spdlog::debug("group '{}' rank {}: shared memory with {} of {} peers ({} KiB rings){}",
                comm.name(), me, mine.size(), n - 1, options.shm_ring_bytes >> 10,
                t->reaches_all_ ? ", collectives too" : "");
  return t;
}

ShmTransport::~ShmTransport() {
  for (auto& out : outgoing_) {
    if (!out) continue;
    {
      std::lock_guard<std::mutex> lock(out->mu);
      out->stop = true;
    }
    out->cv.notify_all();
    // Ends a write blocked on a full ring; what is in the ring stays readable for the peer.
    out->ch->close();
    if (out->thread.joinable()) out->thread.join();
  }
}

void ShmTransport::write_frame(ShmChannel& ch, const SendOp& op, Clock::time_point deadline) {
  const uint64_t header[2] = {op.slot, op.bytes};
  ch.write(header, kHeaderBytes, deadline);
  ch.write(op.data, op.bytes, deadline);
  ch.write(kZeros, padding(op.bytes), deadline);
}

void ShmTransport::run_sender(Outgoing& out) {
  std::unique_lock<std::mutex> lock(out.mu);
  for (;;) {
    out.cv.wait(lock, [&] { return out.stop || !out.queue.empty(); });
    if (out.stop) break;
    const SendOp op = out.queue.front();
    lock.unlock();
    std::string error;
    bool timed_out = false;
    try {
      // No deadline of its own: the Request's wait bounds the send, and its failure aborts the
      // channel, which ends this write.
      write_frame(*out.ch, op, Clock::time_point::max());
    } catch (const TimeoutError& e) {
      error = e.what();
      timed_out = true;
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "send failed";
    }
    lock.lock();
    if (!error.empty()) {
      out.error = error;
      out.timed_out = timed_out;
      out.queue.clear();
      out.retired = out.posted;
      out.cv.notify_all();
      break;
    }
    out.queue.pop_front();
    ++out.completed;
    ++out.retired;
    out.cv.notify_all();
  }
  // Stopped or failed: nothing posted later is taken (post_send checks `error`/`stop`).
  out.retired = out.posted;
  out.queue.clear();
  out.cv.notify_all();
}

uint64_t ShmTransport::post_send(int peer, uint64_t slot, const void* data, size_t bytes) {
  Outgoing& out = *outgoing_[size_t(peer)];
  std::unique_lock<std::mutex> lock(out.mu);
  if (!out.error.empty() || out.aborted) {
    throw PeerLostError(fmt::format("shm channel to {}: {}", out.ch->peer(),
                                    out.aborted ? abort_reason() : out.error));
  }
  const uint64_t ticket = out.posted++;
  const SendOp op{slot, static_cast<const std::byte*>(data), bytes};
  const size_t frame = kHeaderBytes + bytes + padding(bytes);
  // The thread is idle when the queue is empty (it keeps the op it writes at the front), so this
  // thread may write the channel itself.
  if (out.queue.empty() && out.ch->writable() >= frame) {
    try {
      write_frame(*out.ch, op, Clock::now());  // fits: never waits
    } catch (...) {
      out.retired = out.posted;
      throw;
    }
    ++out.completed;
    ++out.retired;
    return ticket;
  }
  out.queue.push_back(op);
  if (!out.thread.joinable()) out.thread = std::thread([this, &out] { run_sender(out); });
  lock.unlock();
  out.cv.notify_all();
  return ticket;
}

bool ShmTransport::send_done(int peer, uint64_t ticket) {
  Outgoing& out = *outgoing_[size_t(peer)];
  std::lock_guard<std::mutex> lock(out.mu);
  return out.completed > ticket;
}

void ShmTransport::wait_send(int peer, uint64_t ticket, Clock::time_point deadline) {
  Outgoing& out = *outgoing_[size_t(peer)];
  std::unique_lock<std::mutex> lock(out.mu);
  const auto start = Clock::now();
  std::string error;
  bool timed_out = false;
  auto pump_interval = std::chrono::duration_cast<Clock::duration>(kFirstPumpInterval);
  for (;;) {
    if (out.completed > ticket) return;
    if (!out.error.empty()) {
      error = out.error;
      timed_out = out.timed_out;
      break;
    }
    if (out.aborted) {
      error = fmt::format("shm channel to {}: {}", out.ch->peer(), abort_reason());
      break;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      error = fmt::format(
          "shm channel to {}: send timed out after {} ms with the message not yet all in the "
          "ring ({} bytes each; the peer is not receiving)",
          out.ch->peer(),
          std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count(), ring_bytes_);
      timed_out = true;
      break;
    }
    if (posted_recvs_ > 0) {
      // The peer may be waiting for its own send to this rank, whose receive is posted here:
      // take in what has arrived so neither ring stays full.
      lock.unlock();
      const bool pumped = pump_ready(deadline);
      lock.lock();
      if (pumped) {
        pump_interval = kFirstPumpInterval;
      } else {
        out.cv.wait_until(lock, std::min(deadline, Clock::now() + pump_interval));
        pump_interval = std::min<Clock::duration>(2 * pump_interval, kLastPumpInterval);
      }
    } else {
      out.cv.wait_until(lock, deadline);
    }
  }
  lock.unlock();
  // Given up: the thread must be off the caller's buffer before the error reaches the caller.
  abort(timed_out ? "a send timed out" : "a send failed");
  release_send(peer, ticket);
  if (timed_out) throw TimeoutError(error);
  throw PeerLostError(error);
}

void ShmTransport::release_send(int peer, uint64_t ticket) noexcept {
  Outgoing& out = *outgoing_[size_t(peer)];
  try {
    std::unique_lock<std::mutex> lock(out.mu);
    if (out.retired > ticket) return;
    lock.unlock();
    abort("a send was given up");
    lock.lock();
    // The aborted channel makes the thread's write throw within one piece of copying.
    out.cv.wait(lock, [&] { return out.retired > ticket; });
  } catch (...) {
    // Only a broken mutex could get here.
  }
}

uint64_t ShmTransport::post_recv(int peer, uint64_t slot, void* data, size_t bytes) {
  Incoming& in = *incoming_[size_t(peer)];
  // Waits at most for one message another thread's send wait is pumping from this peer.
  std::lock_guard<std::mutex> lock(in.mu);
  PostedRecv r{in.next_ticket++, slot, static_cast<std::byte*>(data), bytes, false};
  for (auto it = in.stash.begin(); it != in.stash.end(); ++it) {
    if (it->slot != slot) continue;
    TESSEL_CHECK(it->bytes.size() == bytes, InvalidArgumentError,
                 "shm channel to {}: receive of {} bytes matched a send of {} bytes (sizes "
                 "must agree on both sides)",
                 in.ch->peer(), bytes, it->bytes.size());
    if (bytes > 0) std::memcpy(data, it->bytes.data(), bytes);
    in.stash.erase(it);
    r.done = true;
    break;
  }
  in.posted.push_back(r);
  if (!r.done) ++posted_recvs_;
  return r.ticket;
}

bool ShmTransport::pump(int peer, Incoming& in, Clock::time_point deadline,
                        CollectiveTarget* target) {
  (void)peer;
  uint64_t header[2];
  in.ch->read(header, kHeaderBytes, deadline);
  const uint64_t slot = header[0];
  const size_t bytes = size_t(header[1]);
  std::byte pad[8];
  if (target != nullptr && slot == target->slot) {
    TESSEL_CHECK(bytes == target->bytes, InvalidArgumentError,
                 "shm channel to {}: a collective expected {} bytes and got a message of {} "
                 "(every rank must call the same collectives with the same sizes)",
                 in.ch->peer(), target->bytes, bytes);
    in.ch->read_with(bytes, target->granule, deadline, target->consume);
    in.ch->read(pad, padding(bytes), deadline);
    return true;
  }
  for (size_t i = 0; i < in.posted.size(); ++i) {
    PostedRecv& r = in.posted[i];
    if (r.done || r.slot != slot) continue;
    TESSEL_CHECK(bytes == r.bytes, InvalidArgumentError,
                 "shm channel to {}: receive of {} bytes matched a send of {} bytes (sizes must "
                 "agree on both sides)",
                 in.ch->peer(), r.bytes, bytes);
    in.ch->read(r.data, bytes, deadline);
    in.ch->read(pad, padding(bytes), deadline);
    r.done = true;
    --posted_recvs_;
    return false;
  }
  // Nobody asked for it yet.
  Stashed s;
  s.slot = slot;
  s.bytes.resize(bytes);
  in.ch->read(s.bytes.data(), bytes, deadline);
  in.ch->read(pad, padding(bytes), deadline);
  in.stash.push_back(std::move(s));
  return false;
}

bool ShmTransport::pump_ready(Clock::time_point deadline) {
  bool any = false;
  for (size_t p = 0; p < incoming_.size(); ++p) {
    Incoming* in = incoming_[p].get();
    if (in == nullptr) continue;
    // Held by another thread: it is reading this channel (or posting to it), so the ring drains
    // without this one, which must not wait behind a receive that may take long.
    std::unique_lock<std::mutex> lock(in->mu, std::try_to_lock);
    if (!lock.owns_lock()) continue;
    if (in->posted.empty() || in->ch->readable() < kHeaderBytes) continue;
    bool waiting = false;
    for (size_t i = 0; i < in->posted.size() && !waiting; ++i) waiting = !in->posted[i].done;
    if (!waiting) continue;
    pump(int(p), *in, deadline, nullptr);
    any = true;
  }
  return any;
}

void ShmTransport::wait_recv(int peer, uint64_t ticket, Clock::time_point deadline) {
  Incoming& in = *incoming_[size_t(peer)];
  // Held while blocked in the channel: other threads' send waits skip this channel meanwhile.
  std::lock_guard<std::mutex> lock(in.mu);
  for (;;) {
    while (!in.posted.empty() && in.posted.front().done) in.posted.pop_front();
    if (in.posted.empty() || in.posted.front().ticket > ticket) return;
    if (in.posted[size_t(ticket - in.posted.front().ticket)].done) return;
    pump(peer, in, deadline, nullptr);
  }
}

void ShmTransport::recv_with(int peer, uint64_t slot, size_t bytes, size_t granule,
                             Clock::time_point deadline,
                             FunctionRef<void(const std::byte*, size_t)> consume) {
  Incoming& in = *incoming_[size_t(peer)];
  std::lock_guard<std::mutex> lock(in.mu);
  for (auto it = in.stash.begin(); it != in.stash.end(); ++it) {
    if (it->slot != slot) continue;
    TESSEL_CHECK(it->bytes.size() == bytes, InvalidArgumentError,
                 "shm channel to {}: a collective expected {} bytes and got a message of {}",
                 in.ch->peer(), bytes, it->bytes.size());
    if (bytes > 0) consume(it->bytes.data(), bytes);
    in.stash.erase(it);
    return;
  }
  CollectiveTarget target{slot, bytes, granule, consume};
  while (!pump(peer, in, deadline, &target)) {
  }
}

namespace {

// Releases a posted send when a ring step ends early (the sender thread must be off the buffer).
struct ReleaseOnExit {
  ShmTransport& shm;
  int peer;
  uint64_t ticket;
  bool armed;
  ~ReleaseOnExit() {
    if (armed) shm.release_send(peer, ticket);
  }
};

}  // namespace

template <typename T>
void ShmTransport::ring_reduce_scatter(T* data, const std::vector<size_t>& counts, uint64_t slot,
                                       Clock::time_point deadline) {
  const int n = size_;
  const int r = rank_;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  std::vector<size_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  for (int step = 0; step < n - 1; ++step) {
    const int send_chunk = (r - step - 1 + 2 * n) % n;
    const int recv_chunk = (r - step - 2 + 2 * n) % n;
    ReleaseOnExit release{*this, right, 0, counts[send_chunk] > 0};
    if (release.armed) {
      release.ticket =
          post_send(right, slot, data + offsets[send_chunk], counts[send_chunk] * sizeof(T));
    }
    if (counts[recv_chunk] > 0) {
      T* dst = data + offsets[recv_chunk];
      recv_with(left, slot, counts[recv_chunk] * sizeof(T), sizeof(T), deadline,
                [&](const std::byte* p, size_t bytes) {
                  const size_t k = bytes / sizeof(T);
                  const T* __restrict x = reinterpret_cast<const T*>(p);
                  for (size_t i = 0; i < k; ++i) dst[i] = dst[i] + x[i];
                  dst += k;
                });
    }
    if (release.armed) wait_send(right, release.ticket, deadline);
  }
}

void ShmTransport::ring_all_gather(void* data, const std::vector<size_t>& bytes, uint64_t slot,
                                   Clock::time_point deadline) {
  const int n = size_;
  const int r = rank_;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  std::vector<size_t> offsets(bytes.size() + 1, 0);
  for (size_t i = 0; i < bytes.size(); ++i) offsets[i + 1] = offsets[i] + bytes[i];
  auto* base = static_cast<std::byte*>(data);
  for (int step = 0; step < n - 1; ++step) {
    const int send_chunk = (r - step + n) % n;
    const int recv_chunk = (r - step - 1 + n) % n;
    ReleaseOnExit release{*this, right, 0, bytes[send_chunk] > 0};
    if (release.armed) {
      release.ticket = post_send(right, slot, base + offsets[send_chunk], bytes[send_chunk]);
    }
    if (bytes[recv_chunk] > 0) {
      std::byte* dst = base + offsets[recv_chunk];
      recv_with(left, slot, bytes[recv_chunk], 1, deadline, [&](const std::byte* p, size_t k) {
        std::memcpy(dst, p, k);
        dst += k;
      });
    }
    if (release.armed) wait_send(right, release.ticket, deadline);
  }
}

template void ShmTransport::ring_reduce_scatter<float>(float*, const std::vector<size_t>&, uint64_t,
                                                       Clock::time_point);
template void ShmTransport::ring_reduce_scatter<double>(double*, const std::vector<size_t>&,
                                                        uint64_t, Clock::time_point);
template void ShmTransport::ring_reduce_scatter<int32_t>(int32_t*, const std::vector<size_t>&,
                                                         uint64_t, Clock::time_point);
template void ShmTransport::ring_reduce_scatter<int64_t>(int64_t*, const std::vector<size_t>&,
                                                         uint64_t, Clock::time_point);

std::string ShmTransport::abort_reason() {
  std::lock_guard<std::mutex> lock(abort_mu_);
  return abort_reason_.empty() ? "aborted" : "aborted by this process: " + abort_reason_;
}

void ShmTransport::abort(const std::string& reason) noexcept {
  try {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  } catch (...) {
    // Out of memory for the reason: the flags below still break everything.
  }
  for (auto& in : incoming_) {
    if (in) in->ch->abort(reason);
  }
  for (auto& out : outgoing_) {
    if (!out) continue;
    out->ch->abort(reason);
    try {
      std::lock_guard<std::mutex> lock(out->mu);
      out->aborted = true;
    } catch (...) {
    }
    out->cv.notify_all();
  }
}

}  // namespace tessel::comm::detail
