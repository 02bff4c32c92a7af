// LocalTpGroup, a test double of TpGroup (tp_group.h): the tensor-parallel ranks are threads of
// one process. Test-only (not in the library): model, layout and runtime tests use it.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/model/tp_group.h"

namespace tessel::model {

namespace detail {
struct LocalTpState;
}

// An in-process TpGroup for tests: the tp "ranks" are threads of one process that share a
// rendezvous (a mutex and condition variable). A collective is two barriers: every rank posts its
// buffer and waits for all; each rank reduces all posted buffers in rank order into a private
// copy (so every rank computes bit-identical results); a second barrier makes sure nobody
// overwrites its buffer while others still read it; then each copies the result into its buffer.
//
// Failure behaviour: every wait is bounded by the group's timeout and throws TimeoutError naming
// the operation and the missing ranks. Ranks that call with mismatched n or different operations
// throw InvalidArgumentError. Any failure, or abort(), breaks the group: ranks waiting in it wake
// up and throw, and later calls throw again, so a thread that dies never leaves its peers hanging.
class LocalTpGroup final : public TpGroup {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{30000};

  // One group object per rank, all joined to one shared rendezvous. Throws InvalidArgumentError
  // for size < 1 or a non-positive timeout.
  static std::vector<std::unique_ptr<LocalTpGroup>> create(
      int size, std::chrono::milliseconds timeout = kDefaultTimeout);

  // Runs fn(group) for every rank of a fresh group, each on its own thread, and joins them. When
  // a rank throws, the group is aborted (its peers fail fast instead of timing out); after all
  // threads ended, the first exception in rank order that is not the consequence of that abort is
  // rethrown.
  static void run(int size, const std::function<void(TpGroup&)>& fn,
                  std::chrono::milliseconds timeout = kDefaultTimeout);

  int rank() const override { return rank_; }
  int size() const override;
  void all_reduce_sum(float* data, size_t n) override;
  void all_reduce_max(float* data, size_t n) override;

  // Breaks the group: every rank blocked in a collective, and every later call, throws
  // PeerLostError carrying `reason`. Safe to call from any thread, repeatedly.
  void abort(const std::string& reason);

  LocalTpGroup(std::shared_ptr<detail::LocalTpState> state, int rank);

 private:
  void all_reduce(float* data, size_t n, bool max);

  std::shared_ptr<detail::LocalTpState> state_;
  int rank_;
};

namespace detail {

struct LocalTpState {
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::mutex mu;
  std::condition_variable cv;
  // A reusable barrier: `arrived` counts ranks in the current generation; the last one to arrive
  // starts the next generation and wakes the others.
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<uint64_t> barriers_entered;  // per rank, for naming the missing ranks on a timeout
  // What each rank posted for the collective in progress.
  std::vector<float*> bufs;
  std::vector<size_t> counts;
  std::vector<int> ops;  // 0 sum, 1 max
  // Non-empty once the group is broken; every later wait throws with this message.
  std::string broken;
  bool broken_by_timeout = false;
  int origin = -1;  // the rank whose failure broke the group (-1: unknown / external)

  void break_group(std::string why, int by_rank, bool timeout_kind) {
    if (!broken.empty()) return;
    broken = std::move(why);
    broken_by_timeout = timeout_kind;
    origin = by_rank;
    cv.notify_all();
  }

  [[noreturn]] void throw_broken(int rank, std::string_view op) const {
    TESSEL_THROW(PeerLostError, "local tp group (size {}): rank {} cannot run {}: {}", size, rank,
                 op, broken);
  }

  // Waits until all ranks arrived; throws when the group breaks or the timeout passes first.
  void barrier(std::unique_lock<std::mutex>& lock, int rank, std::string_view op) {
    if (!broken.empty()) throw_broken(rank, op);
    const uint64_t gen = generation;
    ++barriers_entered[size_t(rank)];
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const bool done =
        cv.wait_for(lock, timeout, [&] { return generation != gen || !broken.empty(); });
    if (generation != gen) return;  // completed, even if the group broke right after
    if (done) throw_broken(rank, op);
    std::string missing;
    for (int r = 0; r < size; ++r) {
      if (barriers_entered[size_t(r)] < barriers_entered[size_t(rank)]) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    const std::string why = "rank " + std::to_string(rank) + " waited " +
                            std::to_string(timeout.count()) + " ms in " + std::string(op) +
                            " for rank(s) " + missing + " that never arrived";
    break_group(why, rank, true);
    TESSEL_THROW(TimeoutError, "local tp group (size {}): {}", size, why);
  }
};

}  // namespace detail

inline std::vector<std::unique_ptr<LocalTpGroup>> LocalTpGroup::create(
    int size, std::chrono::milliseconds timeout) {
  TESSEL_CHECK(size >= 1, InvalidArgumentError, "a local tp group needs size >= 1, got {}", size);
  TESSEL_CHECK(timeout.count() > 0, InvalidArgumentError,
               "a local tp group needs a positive timeout, got {} ms", timeout.count());
  auto state = std::make_shared<detail::LocalTpState>();
  state->size = size;
  state->timeout = timeout;
  state->barriers_entered.assign(size_t(size), 0);
  state->bufs.assign(size_t(size), nullptr);
  state->counts.assign(size_t(size), 0);
  state->ops.assign(size_t(size), 0);
  std::vector<std::unique_ptr<LocalTpGroup>> groups;
  for (int r = 0; r < size; ++r) groups.push_back(std::make_unique<LocalTpGroup>(state, r));
  return groups;
}

inline LocalTpGroup::LocalTpGroup(std::shared_ptr<detail::LocalTpState> state, int rank)
    : state_(std::move(state)), rank_(rank) {}

inline int LocalTpGroup::size() const {
  return state_->size;
}

inline void LocalTpGroup::abort(const std::string& reason) {
  std::lock_guard lock(state_->mu);
  state_->break_group("aborted by rank " + std::to_string(rank_) + ": " + reason, rank_, false);
}

inline void LocalTpGroup::all_reduce_sum(float* data, size_t n) {
  all_reduce(data, n, false);
}

inline void LocalTpGroup::all_reduce_max(float* data, size_t n) {
  all_reduce(data, n, true);
}

inline void LocalTpGroup::all_reduce(float* data, size_t n, bool max) {
  detail::LocalTpState& s = *state_;
  const std::string_view op = max ? "all_reduce_max" : "all_reduce_sum";
  std::unique_lock lock(s.mu);
  if (!s.broken.empty()) s.throw_broken(rank_, op);
  if (s.size == 1) return;
  s.bufs[size_t(rank_)] = data;
  s.counts[size_t(rank_)] = n;
  s.ops[size_t(rank_)] = max ? 1 : 0;
  s.barrier(lock, rank_, op);
  // Every rank sees the same posts, so every rank reaches the same verdict.
  for (int r = 0; r < s.size; ++r) {
    if (s.counts[size_t(r)] != n || s.ops[size_t(r)] != s.ops[size_t(rank_)]) {
      const std::string why = "rank " + std::to_string(rank_) + " called " + std::string(op) +
                              " on " + std::to_string(n) + " floats but rank " + std::to_string(r) +
                              " called " +
                              (s.ops[size_t(r)] ? "all_reduce_max" : "all_reduce_sum") + " on " +
                              std::to_string(s.counts[size_t(r)]);
      s.break_group(why, rank_, false);
      TESSEL_THROW(InvalidArgumentError,
                   "local tp group: mismatched collectives ({}); every rank must call the same "
                   "collectives in the same order with the same sizes",
                   why);
    }
  }
  const std::vector<float*> bufs = s.bufs;
  lock.unlock();
  // Reduce in rank order into a private copy: identical arithmetic, identical bits, on every rank.
  // The peers' buffers stay untouched until everyone passed the second barrier.
  std::vector<float> result(bufs[0], bufs[0] + n);
  for (size_t r = 1; r < bufs.size(); ++r) {
    const float* src = bufs[r];
    if (max) {
      for (size_t i = 0; i < n; ++i) result[i] = src[i] > result[i] ? src[i] : result[i];
    } else {
      for (size_t i = 0; i < n; ++i) result[i] += src[i];
    }
  }
  lock.lock();
  s.barrier(lock, rank_, op);
  lock.unlock();
  std::copy(result.begin(), result.end(), data);
}

inline void LocalTpGroup::run(int size, const std::function<void(TpGroup&)>& fn,
                              std::chrono::milliseconds timeout) {
  auto groups = create(size, timeout);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(size_t(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(*groups[size_t(r)]);
      } catch (const std::exception& e) {
        errors[size_t(r)] = std::current_exception();
        groups[size_t(r)]->abort(e.what());
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
        groups[size_t(r)]->abort("unknown exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  const int origin = groups[0]->state_->origin;
  if (origin >= 0 && errors[size_t(origin)]) std::rethrow_exception(errors[size_t(origin)]);
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace tessel::model
