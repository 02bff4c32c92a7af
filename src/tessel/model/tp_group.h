// TpGroup: the tensor-parallel peers of one model shard, as the model sees them.
//
// Megatron-LM tensor parallelism needs only a few collectives inside forward and backward: an
// all-reduce sum after every row-parallel linear (forward) and of every column-parallel linear's
// input gradient (backward), and a max + sum pair for the vocabulary-parallel softmax. The model
// may not depend on the comm subsystem (comm sits above model), so it talks to this interface;
// the runtime adapts comm::Communicator to it, tests use LocalTpGroup (ranks as threads).
//
// Contract for implementations:
// - Every rank of the group calls the same collectives in the same order with the same n
//   (the Transformer does so by construction: all its collectives are unconditional).
// - Pointers are in the memory of the model's backend (host memory on the CPU backends). The
//   model calls a collective right after enqueuing the ops that produce its data; on an
//   asynchronous backend (CUDA) the implementation must order itself after them (synchronize
//   the backend's stream, or use a stream-aware collective).
// - The result must be BIT-IDENTICAL on every rank. The model keeps its replicated parameters
//   (norms, biases of row-parallel linears, positions, replicated kv heads) identical on all ranks
//   without exchanging them, which holds only if every rank sees exactly the same reduced values.
//   (A ring all-reduce, where each chunk is summed on one rank and then copied, satisfies this; a
//   reduction that sums in a rank-dependent order does not.)
// - Failures throw tessel errors (TimeoutError, PeerLostError, ...); every blocking call must be
//   bounded by a timeout, never hang.
// A TpGroup is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tessel::model {

class TpGroup {
 public:
  virtual ~TpGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: every rank ends with the element-wise sum over ranks of data[0, n).
  virtual void all_reduce_sum(float* data, size_t n) = 0;
  // In place: every rank ends with the element-wise maximum over ranks of data[0, n). -inf is a
  // valid input (a vocabulary shard made only of padding columns has no real logit). A
  // communicator without a native max can implement it as an all-gather and a local max.
  virtual void all_reduce_max(float* data, size_t n) = 0;
};

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

}  // namespace tessel::model
