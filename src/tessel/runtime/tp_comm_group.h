// CommTpGroup: the model's TpGroup interface (model/tp_group.h) over a comm::Communicator.
//
// The sum is Gloo's ring all-reduce, whose result is bit-identical on every rank (each chunk is
// reduced on one rank and then copied), as the TpGroup contract requires. Gloo has no max in the
// Communicator's API, so the max is an all-gather followed by a local max in rank order, which is
// identical on every rank too. Errors (TimeoutError, PeerLostError) propagate from the
// communicator. The communicator must outlive this object; it is used by one thread at a time.
#pragma once

#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/model/tp_group.h"

namespace tessel::runtime {

class CommTpGroup final : public model::TpGroup {
 public:
  explicit CommTpGroup(comm::Communicator& comm) : comm_(comm) {}

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void all_reduce_sum(float* data, size_t n) override;
  void all_reduce_max(float* data, size_t n) override;

 private:
  comm::Communicator& comm_;
  std::vector<float> gathered_;  // [size, n] staging for the max
};

}  // namespace tessel::runtime
