// ControlRendezvousStore: Gloo's rendezvous store (gloo::rendezvous::Store) on a control store
// (control_store.h), so the members of a group find each other through the job's control store
// (etcd, or the embedded store) instead of a directory they all reach.
//
// It behaves as store.cpp's FileStore does towards Gloo and the Communicator:
//   - values are bytes, stored as they are;
//   - a key is written once: setting one that exists throws ConfigError (a second process took
//     this rank of this job, generation and group; every new world needs a new generation);
//   - every wait, and get() (which waits for its key first), is bounded by the adapter's timeout,
//     whatever Gloo passes (some of its callers pass its 30 s default instead of ours);
//   - a wait that times out, or a control store that cannot be reached, throws gloo::IoException
//     naming the keys ("timeout" in its text for the first), which is what the Communicator maps
//     to TimeoutError and PeerLostError. Other errors of the control store pass unchanged;
//   - given an abort signal, a wait (and get()) waits in slices of at most kAbortableWaitSlice
//     and throws gloo::IoException "rendezvous aborted while waiting for store key(s):
//     <keys>: <reason>" at the first slice's end after the signal fired. Without one it waits in
//     one call, as before (a slice costs the control store requests).
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tessel/comm/control_store.h"

namespace tessel::comm {

class AbortSignal;

// How long a wait on the control store may go without looking at the abort signal: each slice is
// one wait on the control store (for etcd: a read of the keys and a watch, on a new connection),
// so shorter slices react faster and cost more requests. Only waits with a signal are sliced.
inline constexpr std::chrono::milliseconds kAbortableWaitSlice{200};

class ControlRendezvousStore final : public gloo::rendezvous::Store {
 public:
  // `store` must outlive this object. Throws ConfigError unless timeout > 0.
  ControlRendezvousStore(ControlStore& store, std::chrono::milliseconds timeout,
                         std::shared_ptr<AbortSignal> abort_signal = nullptr);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& ignored) override;

  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  ControlStore& store_;
  const std::chrono::milliseconds timeout_;
  const std::shared_ptr<AbortSignal> abort_signal_;  // null: waits cannot be aborted
};

}  // namespace tessel::comm
