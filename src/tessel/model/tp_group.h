// TpGroup: the tensor-parallel peers of one model shard, as the model sees them.
//
// Megatron-LM tensor parallelism needs only a few collectives inside forward and backward: an
// all-reduce sum after every row-parallel linear (forward) and of every column-parallel linear's
// input gradient (backward), and a max + sum pair for the vocabulary-parallel softmax. The model
// may not depend on the comm subsystem (comm sits above model), so it talks to this interface;
// the runtime adapts comm::Communicator to it, tests use LocalTpGroup (local_tp_group_test_util.h:
// ranks as threads).
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

#include <cstddef>

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

}  // namespace tessel::model
