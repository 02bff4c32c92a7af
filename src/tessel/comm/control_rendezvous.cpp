#include "tessel/comm/control_rendezvous.h"

#include <gloo/common/error.h>

#include <algorithm>

#include "tessel/comm/abort_signal.h"
#include "tessel/core/check.h"

namespace tessel::comm {
namespace {

std::string names(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : " ") + k;
  return out;
}

// Runs a control store call for Gloo: the failures the Communicator classifies by Gloo's
// exception and its text become gloo::IoException (the word "timeout" marks a timeout).
template <typename F>
auto for_gloo(const char* what, const std::vector<std::string>& keys,
              std::chrono::milliseconds timeout, F&& f) {
  try {
    return f();
  } catch (const TimeoutError& e) {
    throw gloo::IoException("Wait timeout after " + std::to_string(timeout.count()) +
                            " ms for store key(s): " + names(keys) + " (" + e.what() + ")");
  } catch (const PeerLostError& e) {
    throw gloo::IoException(std::string("control store lost while ") + what +
                            " store key(s): " + names(keys) + " (" + e.what() + ")");
  }
}

}  // namespace

ControlRendezvousStore::ControlRendezvousStore(ControlStore& store,
                                               std::chrono::milliseconds timeout,
                                               std::shared_ptr<AbortSignal> abort_signal)
    : store_(store), timeout_(timeout), abort_signal_(std::move(abort_signal)) {
  TESSEL_CHECK(timeout_.count() > 0, ConfigError, "rendezvous timeout {} ms must be positive",
               timeout_.count());
}

void ControlRendezvousStore::set(const std::string& key, const std::vector<char>& data) {
  const std::string value(data.begin(), data.end());
  // Created only if absent (revision 0), as Gloo's FileStore refuses to overwrite: a rank
  // registered twice would otherwise replace the address its peers may already have read.
  const bool created = for_gloo("setting", {key}, timeout_,
                                [&] { return store_.compare_and_set(key, 0, value).has_value(); });
  TESSEL_CHECK(created, ConfigError,
               "rendezvous key '{}' is already in the control store: another process registered "
               "as this rank of this job, generation and group; every new world needs a new "
               "generation",
               key);
}

std::vector<char> ControlRendezvousStore::get(const std::string& key) {
  wait({key});
  const auto kv = for_gloo("reading", {key}, timeout_, [&] { return store_.get(key); });
  if (!kv) {
    throw gloo::IoException("store key " + key +
                            " was erased from the control store right after it appeared");
  }
  return {kv->value.begin(), kv->value.end()};
}

void ControlRendezvousStore::wait(const std::vector<std::string>& keys) {
  if (!abort_signal_) {
    for_gloo("waiting for", keys, timeout_, [&] { store_.wait(keys, timeout_); });
    return;
  }
  // The control store's wait cannot be interrupted from another thread, so wait in slices and
  // look at the signal between them. A slice that times out is no error until the whole timeout
  // has passed; the last one's TimeoutError (naming the keys still missing) is then reported.
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for_gloo("waiting for", keys, timeout_, [&] {
    for (;;) {
      if (abort_signal_->aborted()) {
        throw gloo::IoException("rendezvous aborted while waiting for store key(s): " +
                                names(keys) + ": " + abort_signal_->reason());
      }
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      try {
        store_.wait(keys, std::clamp(left, std::chrono::milliseconds(1), kAbortableWaitSlice));
        return;
      } catch (const TimeoutError&) {
        if (std::chrono::steady_clock::now() >= deadline) throw;
      }
    }
  });
}

void ControlRendezvousStore::wait(const std::vector<std::string>& keys,
                                  const std::chrono::milliseconds&) {
  wait(keys);
}

}  // namespace tessel::comm
