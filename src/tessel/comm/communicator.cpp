#include "tessel/comm/communicator.h"

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/context.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "tessel/comm/comm_state.h"
#include "tessel/comm/full_mesh.h"
#include "tessel/comm/pair_handshake.h"
#include "tessel/core/check.h"

namespace tessel::comm {

namespace {

using detail::Clock;
using detail::CommState;
using detail::FailureKind;
using detail::make_slot;
using gloo::transport::UnboundBuffer;

// Large chunks travel in segments of at most this many bytes, so that the reduction of one
// segment overlaps the transfer of the next (the bound Gloo's ring all-reduce uses).
constexpr size_t kSegmentBytes = size_t(1) << 20;

// Gloo writes to its sockets without MSG_NOSIGNAL, so a write to a peer that just died raises
// SIGPIPE, whose default action kills this process before Gloo can report the broken pipe. Ignore
// it (unless the program installed its own handler) so the write fails with EPIPE instead and
// surfaces as PeerLostError.
void ignore_sigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  }
}

std::chrono::milliseconds effective(const CommState& s, Communicator::Timeout t, const char* op) {
  if (!t) return s.timeout;
  TESSEL_CHECK(t->count() > 0, InvalidArgumentError, "{}: timeout {} ms must be positive",
               s.where(op, -1), t->count());
  return *t;
}

template <typename T>
void sum_into(T* out, const T* x, const T* __restrict y, size_t n) {
  // out may alias x (reduction in place); y never aliases either.
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

template <typename T>
bool disjoint(const T* a, size_t na, const T* b, size_t nb) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return x + na * sizeof(T) <= y || y + nb * sizeof(T) <= x;
}

std::vector<size_t> offsets_of(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  return offsets;
}

void check_counts(const CommState& s, const char* op, const std::vector<size_t>& counts) {
  TESSEL_CHECK(counts.size() == size_t(s.size), InvalidArgumentError,
               "{}: {} counts given, one per rank ({}) needed", s.where(op, -1), counts.size(),
               s.size);
}

// Ring reduce-scatter, in place. At step k every rank sends chunk (rank-k-1) to its right
// neighbour and adds the chunk (rank-k-2) arriving from its left neighbour into its own copy; the
// chunk sent at step k+1 is the one completed at step k. After size-1 steps rank r holds the full
// sum of chunk r. Chunks travel in segments: all sends of a step are posted at once straight from
// `data`, receives are double-buffered so one segment is reduced while the next is in flight.
// Every rank sends and receives (size-1)/size of the buffer.
template <typename T>
void ring_reduce_scatter(CommState& s, T* data, const std::vector<size_t>& counts,
                         const std::vector<size_t>& offsets, uint32_t tag,
                         Clock::time_point deadline) {
  const int n = s.size;
  const int r = s.rank;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const size_t seg = std::max<size_t>(1, kSegmentBytes / sizeof(T));
  const size_t max_count = *std::max_element(counts.begin(), counts.end());
  const size_t half = std::min(seg, max_count);
  s.scratch.resize(std::max<size_t>(1, 2 * half * sizeof(T)));
  const uint64_t slot = make_slot(detail::kReduceScatterSlotPrefix, tag);

  auto data_buf = s.context->createUnboundBuffer(data, offsets.back() * sizeof(T));
  auto tmp_buf = s.context->createUnboundBuffer(s.scratch.data(), s.scratch.size());
  const T* tmp = reinterpret_cast<const T*>(s.scratch.data());
  for (int step = 0; step < n - 1; ++step) {
    const int send_chunk = (r - step - 1 + 2 * n) % n;
    const int recv_chunk = (r - step - 2 + 2 * n) % n;

    size_t sends = 0;
    for (size_t off = 0; off < counts[send_chunk]; off += seg) {
      const size_t len = std::min(seg, counts[send_chunk] - off);
      data_buf->send(right, slot, (offsets[send_chunk] + off) * sizeof(T), len * sizeof(T));
      ++sends;
    }

    const size_t count = counts[recv_chunk];
    const size_t segments = (count + seg - 1) / seg;
    auto post_recv = [&](size_t k) {
      const size_t len = std::min(seg, count - k * seg);
      tmp_buf->recv(left, slot, (k % 2) * half * sizeof(T), len * sizeof(T));
    };
    for (size_t k = 0; k < std::min<size_t>(2, segments); ++k) post_recv(k);
    for (size_t k = 0; k < segments; ++k) {
      s.wait_recv(*tmp_buf, {left}, deadline);
      const size_t len = std::min(seg, count - k * seg);
      T* dst = data + offsets[recv_chunk] + k * seg;
      sum_into<T>(dst, dst, tmp + (k % 2) * half, len);
      if (k + 2 < segments) post_recv(k + 2);
    }
    for (size_t i = 0; i < sends; ++i) s.wait_send(*data_buf, {right}, deadline);
  }
}

// Ring all-gather of uneven chunks, in place: chunk r of `data` (bytes[r] bytes at the sum of the
// bytes before it) comes from rank r. At step k every rank forwards chunk (rank-k) to its right
// neighbour and receives chunk (rank-k-1) from its left one, straight into place.
void ring_all_gather(CommState& s, void* data, const std::vector<size_t>& bytes, uint32_t tag,
                     Clock::time_point deadline) {
  const int n = s.size;
  const int r = s.rank;
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const auto offsets = offsets_of(bytes);
  const uint64_t slot = make_slot(detail::kAllGatherSlotPrefix, tag);
  auto buf = s.context->createUnboundBuffer(data, offsets.back());
  for (int step = 0; step < n - 1; ++step) {
    const int send_chunk = (r - step + n) % n;
    const int recv_chunk = (r - step - 1 + n) % n;
    // Both sides know every chunk's size, so empty chunks are simply not exchanged.
    if (bytes[recv_chunk] > 0) buf->recv(left, slot, offsets[recv_chunk], bytes[recv_chunk]);
    if (bytes[send_chunk] > 0) buf->send(right, slot, offsets[send_chunk], bytes[send_chunk]);
    if (bytes[recv_chunk] > 0) s.wait_recv(*buf, {left}, deadline);
    if (bytes[send_chunk] > 0) s.wait_send(*buf, {right}, deadline);
  }
}

// Binomial-tree broadcast (the schedule of gloo::broadcast): with ranks renumbered so the root is
// 0, at level i every rank below 2^i that has a partner 2^i above it sends it the whole buffer.
// A rank receives once, from its parent, then forwards to its children.
void tree_broadcast(CommState& s, void* data, size_t bytes, int root, uint32_t tag,
                    Clock::time_point deadline) {
  const int n = s.size;
  const int vrank = (s.rank - root + n) % n;
  const uint64_t slot = make_slot(detail::kBroadcastSlotPrefix, tag);
  auto buf = s.context->createUnboundBuffer(data, bytes);
  std::vector<int> children;
  for (int bit = 1; bit < n; bit <<= 1) {
    if (vrank < bit) {
      if (vrank + bit < n) {
        const int child = (vrank + bit + root) % n;
        buf->send(child, slot);
        children.push_back(child);
      }
    } else if (vrank < 2 * bit) {
      const int parent = (vrank - bit + root) % n;
      buf->recv(parent, slot);
      s.wait_recv(*buf, {parent}, deadline);
    }
  }
  while (!children.empty()) {
    const int done = s.wait_send(*buf, children, deadline);
    auto it = std::find(children.begin(), children.end(), done);
    children.erase(it != children.end() ? it : children.begin());
  }
}

// Runs a shared-memory operation like CommState::guarded runs a Gloo one: the channels throw
// tessel's errors, which break the communicator the same way (fail() records the first failure and
// closes every connection and channel, so peers fail fast).
template <typename F>
void shm_guarded(CommState& s, const char* op, int peer, std::chrono::milliseconds t, F&& body) {
  s.guarded(op, peer, t, [&] {
    try {
      body();
    } catch (const TimeoutError& e) {
      s.fail(op, peer, FailureKind::kTimeout, t, e.what());
    } catch (const PeerLostError& e) {
      s.fail(op, peer, FailureKind::kPeerLost, t, e.what());
    } catch (const Error& e) {
      s.fail(op, peer, FailureKind::kOther, t, e.what());
    }
  });
}

// Whether the collectives of this group run over shared memory.
bool collectives_on_shm(const CommState& s) {
  return s.shm != nullptr && s.shm->reaches_all();
}

// The ring all-gather on whichever transport the group uses.
void any_ring_all_gather(CommState& s, void* data, const std::vector<size_t>& bytes, uint32_t tag,
                         Clock::time_point deadline) {
  if (collectives_on_shm(s)) {
    s.shm->ring_all_gather(data, bytes, make_slot(detail::kAllGatherSlotPrefix, tag), deadline);
  } else {
    ring_all_gather(s, data, bytes, tag, deadline);
  }
}

// Shared memory is on unless the options or the environment turn it off.
bool shared_memory_wanted(const TransportOptions& transport) {
  const char* env = std::getenv("TESSEL_SHARED_MEMORY");
  if (env != nullptr && std::string(env) == "0") return false;
  return transport.shared_memory;
}

// "host:port" of each address a peer published (by rank; empty where none), for messages.
std::vector<std::string> address_names(const std::vector<std::vector<char>>& published) {
  std::vector<std::string> names(published.size());
  for (size_t p = 0; p < published.size(); ++p) {
    if (!published[p].empty()) names[p] = gloo::transport::tcp::Address(published[p]).str();
  }
  return names;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Request

Request::Request(std::shared_ptr<detail::CommState> state, bool is_send, int peer, uint32_t tag,
                 size_t bytes, std::unique_ptr<gloo::transport::UnboundBuffer> buffer)
    : state_(std::move(state)),
      is_send_(is_send),
      peer_(peer),
      tag_(tag),
      bytes_(bytes),
      done_(false),
      buffer_(std::move(buffer)) {}

Request::Request(std::shared_ptr<detail::CommState> state, bool is_send, int peer, uint32_t tag,
                 size_t bytes, uint64_t shm_ticket)
    : state_(std::move(state)),
      is_send_(is_send),
      peer_(peer),
      tag_(tag),
      bytes_(bytes),
      done_(false),
      on_shm_(true),
      shm_ticket_(shm_ticket) {}

Request::Request(Request&& other) noexcept
    : state_(std::move(other.state_)),
      is_send_(other.is_send_),
      peer_(other.peer_),
      tag_(other.tag_),
      bytes_(other.bytes_),
      done_(other.done_),
      buffer_(std::move(other.buffer_)),
      on_shm_(other.on_shm_),
      shm_ticket_(other.shm_ticket_) {
  other.done_ = true;
}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    abandon();
    state_ = std::move(other.state_);
    is_send_ = other.is_send_;
    peer_ = other.peer_;
    tag_ = other.tag_;
    bytes_ = other.bytes_;
    done_ = other.done_;
    buffer_ = std::move(other.buffer_);
    on_shm_ = other.on_shm_;
    shm_ticket_ = other.shm_ticket_;
    other.done_ = true;
  }
  return *this;
}

Request::~Request() {
  abandon();
}

void Request::abandon() noexcept {
  if (done_ || !state_) return;
  try {
    finish(state_->timeout);
  } catch (...) {
    // The failure is recorded in the communicator; later calls report it.
  }
}

void Request::wait() {
  TESSEL_CHECK(state_ != nullptr, InvalidArgumentError, "wait() on a moved-from Request");
  finish(state_->timeout);
}

void Request::wait(std::chrono::milliseconds timeout) {
  TESSEL_CHECK(state_ != nullptr, InvalidArgumentError, "wait() on a moved-from Request");
  TESSEL_CHECK(timeout.count() > 0, InvalidArgumentError,
               "Request::wait: timeout {} ms must be positive", timeout.count());
  finish(timeout);
}

void Request::finish(std::chrono::milliseconds timeout) {
  if (done_) return;
  // Whatever happens below, this transfer is over for the caller.
  done_ = true;
  auto& s = *state_;
  if (on_shm_) {
    // However this ends, the sender thread must be off the caller's buffer before it returns.
    struct Release {
      Request& r;
      ~Release() {
        if (r.is_send_) r.state_->shm->release_send(r.peer_, r.shm_ticket_);
      }
    } release{*this};
    shm_guarded(s, is_send_ ? "send" : "recv", peer_, timeout, [&] {
      const auto deadline = Clock::now() + timeout;
      is_send_ ? s.shm->wait_send(peer_, shm_ticket_, deadline)
               : s.shm->wait_recv(peer_, shm_ticket_, deadline);
    });
    return;
  }
  s.guarded(is_send_ ? "send" : "recv", peer_, timeout, [&] {
    const auto deadline = Clock::now() + timeout;
    is_send_ ? s.wait_send(*buffer_, {peer_}, deadline) : s.wait_recv(*buffer_, {peer_}, deadline);
  });
  buffer_.reset();
}

// ---------------------------------------------------------------------------------------------
// Communicator

Communicator::Communicator(std::shared_ptr<detail::CommState> state) : state_(std::move(state)) {}
Communicator::~Communicator() = default;

void Communicator::follow(const std::shared_ptr<AbortSignal>& signal) {
  if (!signal) return;
  // The raw pointer is safe: the registration is dropped (waiting for a running callback) before
  // state_ is released.
  abort_registration_ =
      signal->on_abort([state = state_.get()](const std::string& reason) { state->abort(reason); });
}

std::unique_ptr<Communicator> Communicator::connect(const StoreOptions& store,
                                                    const std::string& group_name, int rank,
                                                    int size, std::chrono::milliseconds timeout,
                                                    const TransportOptions& transport) {
  validate(store);
  validate_group_name(group_name);
  TESSEL_CHECK(size >= 1, ConfigError, "group '{}': size {} must be at least 1", group_name, size);
  TESSEL_CHECK(rank >= 0 && rank < size, ConfigError, "group '{}': rank {} is outside [0, {})",
               group_name, rank, size);
  TESSEL_CHECK(timeout.count() > 0, ConfigError, "group '{}': timeout {} ms must be positive",
               group_name, timeout.count());
  TESSEL_CHECK(transport.shm_ring_bytes >= 4096 && transport.shm_ring_bytes <= (size_t(1) << 30),
               ConfigError,
               "group '{}': TransportOptions::shm_ring_bytes {} must be in [4096, 1 GiB]",
               group_name, transport.shm_ring_bytes);

  auto state = std::make_shared<CommState>();
  state->name = group_name;
  state->rank = rank;
  state->size = size;
  state->timeout = timeout;
  const char* op = "connect";
  const std::string where = state->where(op, -1);
  const auto& signal = store.abort_signal;
  // Once the signal has fired, whatever failed meanwhile (a store wait, a pair, the barrier) was
  // the abort's doing or no longer matters: the caller asked to stop.
  auto throw_if_aborted = [&] {
    if (signal && signal->aborted()) {
      TESSEL_THROW(PeerLostError, "{} failed: rendezvous aborted by this process: {}", where,
                   signal->reason());
    }
  };
  throw_if_aborted();
  if (size == 1) {
    std::unique_ptr<Communicator> comm(new Communicator(std::move(state)));
    comm->follow(signal);
    return comm;
  }

  ignore_sigpipe();
  GroupStore group_store(store, group_name);
  std::vector<std::vector<char>> peer_addresses;  // as published, for the handshake's messages
  try {
    gloo::transport::tcp::attr attr;
    if (!transport.iface.empty()) {
      attr.iface = transport.iface;
    } else {
      attr.hostname = transport.hostname;
    }
    state->device = gloo::transport::tcp::CreateDevice(attr);
    // Rendezvous waits for every peer to start, so it runs under the (usually longer) store
    // timeout: the store enforces it on its waits, and Gloo's pairs allow 5x their timeout for
    // the TCP handshake, hence the fifth. Operations pass their timeouts explicitly.
    auto context = detail::connect_full_mesh(
        group_store.store(), rank, size, state->device,
        std::max(store.timeout / 5, std::chrono::milliseconds(1)), signal, &peer_addresses);
    context->setTimeout(timeout);
    state->mesh_settling = true;
    state->context = std::move(context);
    state->start_watchdog();
  } catch (const MembershipError& e) {
    throw_if_aborted();
    throw MembershipError(fmt::format("{} failed: {}", where, e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    throw_if_aborted();
    const std::string message = e.what();
    TESSEL_CHECK(message.find("File already exists") == std::string::npos, ConfigError,
                 "{}: rank {} is already registered in rendezvous store '{}' under prefix '{}'; "
                 "every new world needs a new generation: {}",
                 where, rank, group_store.location(), group_store.prefix(), message);
    state->fail(op, -1, FailureKind::kOther, store.timeout, message);
  } catch (const gloo::IoException& e) {
    throw_if_aborted();
    state->fail(op, -1, detail::classify_gloo_message(e.what()), store.timeout,
                std::string(e.what()) + fmt::format(" [store '{}', prefix '{}']",
                                                    group_store.location(), group_store.prefix()));
  } catch (const gloo::Exception& e) {
    throw_if_aborted();
    state->fail(op, -1, FailureKind::kOther, store.timeout, e.what());
  }
  std::unique_ptr<Communicator> comm(new Communicator(std::move(state)));
  // From here the signal aborts the communicator (at once if it fired since the rendezvous
  // stopped watching it), which also ends the barrier below.
  comm->follow(signal);
  // With a secret, every peer proves it holds it before anyone uses the group; the barrier below
  // then also says that every rank accepted every peer.
  if (!store.secret.empty()) {
    try {
      detail::prove_membership(*comm->state_, store.secret, group_store.prefix(),
                               address_names(peer_addresses), store.timeout);
    } catch (const Error&) {
      throw_if_aborted();
      throw;
    }
  }
  // A rank's pairs can be connected while some peers are still connecting to others; leave only
  // when the whole mesh is up, so a short operation timeout right after connect cannot fire on a
  // peer that is merely still joining.
  try {
    comm->barrier(store.timeout);
  } catch (const Error&) {
    throw_if_aborted();
    throw;
  }
  // Everyone entered the barrier, so every peer's rendezvous has taken in all its connections.
  comm->state_->settled();
  // Channels to the peers on this host, agreed over the mesh (every rank takes part, also with
  // shared memory off, so that the ranks' collectives stay matched).
  TransportOptions shm_options = transport;
  shm_options.shared_memory = shared_memory_wanted(transport);
  try {
    comm->state_->attach_shm(detail::ShmTransport::connect(*comm, shm_options, store.timeout));
  } catch (const TimeoutError& e) {
    throw_if_aborted();
    throw TimeoutError(
        fmt::format("{} failed while agreeing on shared memory: {}", where, e.what()));
  } catch (const PeerLostError& e) {
    throw_if_aborted();
    throw PeerLostError(
        fmt::format("{} failed while agreeing on shared memory: {}", where, e.what()));
  }
  return comm;
}

int Communicator::rank() const {
  return state_->rank;
}
int Communicator::size() const {
  return state_->size;
}
const std::string& Communicator::name() const {
  return state_->name;
}
std::chrono::milliseconds Communicator::timeout() const {
  return state_->timeout;
}

std::string Communicator::failure() const {
  std::string recorded = state_->recorded_failure();
  if (!recorded.empty()) return recorded;
  return state_->peer_failure();
}

bool Communicator::shares_memory_with(int peer) const {
  return state_->shm != nullptr && state_->shm->reaches(peer);
}

bool Communicator::collectives_share_memory() const {
  return state_->shm != nullptr && state_->shm->reaches_all();
}

void Communicator::abort(const std::string& reason) noexcept {
  state_->abort(reason);
}

void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  TESSEL_CHECK(timeout.count() > 0, InvalidArgumentError, "{}: timeout {} ms must be positive",
               state_->where("set_timeout", -1), timeout.count());
  state_->timeout = timeout;
  if (state_->context) state_->context->setTimeout(timeout);
}

template <ReduceElement T>
void Communicator::all_reduce_sum(T* data, size_t n, Timeout timeout) {
  auto& s = *state_;
  const char* op = "all_reduce_sum";
  const auto t = effective(s, timeout, op);
  const uint32_t tag = s.next_tag++;
  s.ensure_healthy(op);
  if (s.size == 1 || n == 0) return;
  TESSEL_CHECK(data != nullptr, InvalidArgumentError, "{}: null data for {} elements",
               s.where(op, -1), n);
  // Ring all-reduce = ring reduce-scatter + ring all-gather, both straight on `data`: the
  // bandwidth-optimal algorithm of gloo::allreduce, scheduled here so every wait is reachable by
  // the watchdog (see comm_state.h).
  const auto counts = even_counts(n, s.size);
  const auto offsets = offsets_of(counts);
  std::vector<size_t> bytes(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) bytes[i] = counts[i] * sizeof(T);
  const auto deadline = Clock::now() + t;
  if (collectives_on_shm(s)) {
    shm_guarded(s, op, -1, t, [&] {
      s.shm->ring_reduce_scatter(data, counts, make_slot(detail::kReduceScatterSlotPrefix, tag),
                                 deadline);
      s.shm->ring_all_gather(data, bytes, make_slot(detail::kAllGatherSlotPrefix, tag), deadline);
    });
    return;
  }
  s.guarded(op, -1, t, [&] {
    ring_reduce_scatter(s, data, counts, offsets, tag, deadline);
    ring_all_gather(s, data, bytes, tag, deadline);
  });
}

template <ReduceElement T>
void Communicator::reduce_scatter_sum(T* data, const std::vector<size_t>& counts, Timeout timeout) {
  auto& s = *state_;
  const char* op = "reduce_scatter_sum";
  const auto t = effective(s, timeout, op);
  const uint32_t tag = s.next_tag++;
  s.ensure_healthy(op);
  check_counts(s, op, counts);
  const auto offsets = offsets_of(counts);
  if (s.size == 1 || offsets.back() == 0) return;
  TESSEL_CHECK(data != nullptr, InvalidArgumentError, "{}: null data for {} elements",
               s.where(op, -1), offsets.back());
  const auto deadline = Clock::now() + t;
  if (collectives_on_shm(s)) {
    shm_guarded(s, op, -1, t, [&] {
      s.shm->ring_reduce_scatter(data, counts, make_slot(detail::kReduceScatterSlotPrefix, tag),
                                 deadline);
    });
    return;
  }
  s.guarded(op, -1, t, [&] { ring_reduce_scatter(s, data, counts, offsets, tag, deadline); });
}

template <Element T>
void Communicator::all_gather(const T* mine, size_t n, T* out, Timeout timeout) {
  auto& s = *state_;
  const char* op = "all_gather";
  const auto t = effective(s, timeout, op);
  const uint32_t tag = s.next_tag++;
  s.ensure_healthy(op);
  if (n == 0) return;
  TESSEL_CHECK(mine != nullptr && out != nullptr, InvalidArgumentError,
               "{}: null buffer for {} elements", s.where(op, -1), n);
  T* slot = out + size_t(s.rank) * n;
  TESSEL_CHECK(mine == slot || disjoint(mine, n, out, n * size_t(s.size)), InvalidArgumentError,
               "{}: input overlaps the output without being this rank's slot of it",
               s.where(op, -1));
  if (mine != slot) std::memcpy(slot, mine, n * sizeof(T));
  if (s.size == 1) return;
  const std::vector<size_t> bytes(size_t(s.size), n * sizeof(T));
  const auto deadline = Clock::now() + t;
  shm_guarded(s, op, -1, t, [&] { any_ring_all_gather(s, out, bytes, tag, deadline); });
}

template <Element T>
void Communicator::all_gather_v(const T* mine, const std::vector<size_t>& counts, T* out,
                                Timeout timeout) {
  auto& s = *state_;
  const char* op = "all_gather_v";
  const auto t = effective(s, timeout, op);
  const uint32_t tag = s.next_tag++;
  s.ensure_healthy(op);
  check_counts(s, op, counts);
  const auto offsets = offsets_of(counts);
  const size_t total = offsets.back();
  if (total == 0) return;
  const size_t n = counts[s.rank];
  TESSEL_CHECK(out != nullptr && (mine != nullptr || n == 0), InvalidArgumentError,
               "{}: null buffer", s.where(op, -1));
  T* slot = out + offsets[s.rank];
  TESSEL_CHECK(n == 0 || mine == slot || disjoint(mine, n, out, total), InvalidArgumentError,
               "{}: input overlaps the output without being this rank's slot of it",
               s.where(op, -1));
  if (n > 0 && mine != slot) std::memcpy(slot, mine, n * sizeof(T));
  if (s.size == 1) return;
  std::vector<size_t> bytes(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) bytes[i] = counts[i] * sizeof(T);
  const auto deadline = Clock::now() + t;
  shm_guarded(s, op, -1, t, [&] { any_ring_all_gather(s, out, bytes, tag, deadline); });
}

template <Element T>
void Communicator::broadcast(T* data, size_t n, int root, Timeout timeout) {
  auto& s = *state_;
  const char* op = "broadcast";
  const auto t = effective(s, timeout, op);
  TESSEL_CHECK(root >= 0 && root < s.size, InvalidArgumentError, "{}: root {} outside [0, {})",
               s.where(op, -1), root, s.size);
  const uint32_t tag = s.next_tag++;
  s.ensure_healthy(op);
  if (s.size == 1 || n == 0) return;
  TESSEL_CHECK(data != nullptr, InvalidArgumentError, "{}: null data for {} elements",
               s.where(op, -1), n);
  const auto deadline = Clock::now() + t;
  s.guarded(op, -1, t, [&] { tree_broadcast(s, data, n * sizeof(T), root, tag, deadline); });
}

void Communicator::broadcast_bytes(void* data, size_t bytes, int root, Timeout timeout) {
  broadcast(static_cast<uint8_t*>(data), bytes, root, timeout);
}

void Communicator::barrier(Timeout timeout) {
  auto& s = *state_;
  const char* op = "barrier";
  const auto t = effective(s, timeout, op);
  const uint32_t tag = s.next_tag++;
  s.ensure_healthy(op);
  if (s.size == 1) return;
  // An all-gather of one byte per rank: nobody leaves before everybody's byte arrived.
  std::vector<uint8_t> bytes(size_t(s.size), 0);
  const auto deadline = Clock::now() + t;
  s.guarded(op, -1, t, [&] {
    ring_all_gather(s, bytes.data(), std::vector<size_t>(size_t(s.size), 1), tag, deadline);
  });
}

namespace {

// Posts one point-to-point transfer (the two directions differ only in the buffer call).
std::unique_ptr<UnboundBuffer> post_transfer(CommState& s, bool is_send, void* data, size_t bytes,
                                             int peer, uint32_t tag) {
  const char* op = is_send ? "send" : "recv";
  TESSEL_CHECK(peer >= 0 && peer < s.size && peer != s.rank, InvalidArgumentError,
               "{}: peer {} must be another rank in [0, {})", s.where(op, peer), peer, s.size);
  TESSEL_CHECK(data != nullptr || bytes == 0, InvalidArgumentError, "{}: null data",
               s.where(op, peer));
  std::unique_ptr<UnboundBuffer> buf;
  s.guarded(op, peer, s.timeout, [&] {
    buf = s.context->createUnboundBuffer(data, bytes);
    const uint64_t slot = make_slot(detail::kPointToPointSlotPrefix, tag);
    if (is_send) {
      buf->send(peer, slot, 0, bytes);
    } else {
      buf->recv(peer, slot, 0, bytes);
    }
  });
  return buf;
}

// Posts one point-to-point transfer on the shared-memory channel with `peer`.
uint64_t post_shm_transfer(CommState& s, bool is_send, void* data, size_t bytes, int peer,
                           uint32_t tag) {
  const char* op = is_send ? "send" : "recv";
  TESSEL_CHECK(data != nullptr || bytes == 0, InvalidArgumentError, "{}: null data",
               s.where(op, peer));
  uint64_t ticket = 0;
  shm_guarded(s, op, peer, s.timeout, [&] {
    const uint64_t slot = make_slot(detail::kPointToPointSlotPrefix, tag);
    ticket = is_send ? s.shm->post_send(peer, slot, data, bytes)
                     : s.shm->post_recv(peer, slot, data, bytes);
  });
  return ticket;
}

bool on_shm(const CommState& s, int peer) {
  return s.shm != nullptr && peer != s.rank && s.shm->reaches(peer);
}

}  // namespace

Request Communicator::send(const void* data, size_t bytes, int peer, uint32_t tag) {
  if (on_shm(*state_, peer)) {
    const uint64_t ticket =
        post_shm_transfer(*state_, true, const_cast<void*>(data), bytes, peer, tag);
    return Request(state_, true, peer, tag, bytes, ticket);
  }
  // Gloo's buffers are not const-typed; a send only reads `data`.
  auto buf = post_transfer(*state_, true, const_cast<void*>(data), bytes, peer, tag);
  return Request(state_, true, peer, tag, bytes, std::move(buf));
}

Request Communicator::recv(void* data, size_t bytes, int peer, uint32_t tag) {
  if (on_shm(*state_, peer)) {
    const uint64_t ticket = post_shm_transfer(*state_, false, data, bytes, peer, tag);
    return Request(state_, false, peer, tag, bytes, ticket);
  }
  auto buf = post_transfer(*state_, false, data, bytes, peer, tag);
  return Request(state_, false, peer, tag, bytes, std::move(buf));
}

std::vector<size_t> even_counts(size_t n, int parts) {
  TESSEL_CHECK(parts >= 1, InvalidArgumentError, "even_counts: {} parts, need at least 1", parts);
  std::vector<size_t> counts(size_t(parts), n / size_t(parts));
  for (size_t i = 0; i < n % size_t(parts); ++i) ++counts[i];
  return counts;
}

#define TESSEL_COMM_REDUCE(T)                                         \
  template void Communicator::all_reduce_sum<T>(T*, size_t, Timeout); \
  template void Communicator::reduce_scatter_sum<T>(T*, const std::vector<size_t>&, Timeout);
#define TESSEL_COMM_MOVE(T)                                                                       \
  template void Communicator::all_gather<T>(const T*, size_t, T*, Timeout);                       \
  template void Communicator::all_gather_v<T>(const T*, const std::vector<size_t>&, T*, Timeout); \
  template void Communicator::broadcast<T>(T*, size_t, int, Timeout);

TESSEL_COMM_REDUCE(float)
TESSEL_COMM_REDUCE(double)
TESSEL_COMM_REDUCE(int32_t)
TESSEL_COMM_REDUCE(int64_t)
TESSEL_COMM_MOVE(float)
TESSEL_COMM_MOVE(double)
TESSEL_COMM_MOVE(int32_t)
TESSEL_COMM_MOVE(int64_t)
TESSEL_COMM_MOVE(uint8_t)

}  // namespace tessel::comm
