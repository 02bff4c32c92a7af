#include "tessel/comm/control_rendezvous.h"

#include <gloo/common/error.h>

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
                                               std::chrono::milliseconds timeout)
    : store_(store), timeout_(timeout) {
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
  for_gloo("waiting for", keys, timeout_, [&] { store_.wait(keys, timeout_); });
}

void ControlRendezvousStore::wait(const std::vector<std::string>& keys,
                                  const std::chrono::milliseconds&) {
  wait(keys);
}

}  // namespace tessel::comm
