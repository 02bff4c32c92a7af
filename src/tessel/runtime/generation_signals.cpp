#include "tessel/runtime/generation_signals.h"

#include <fmt/format.h>

#include <vector>

namespace tessel::runtime {

namespace {

std::string reason_of(int64_t failure) {
  return fmt::format("the coordinator is recovering from failure {} (a peer or its host was lost)",
                     failure);
}

}  // namespace

std::shared_ptr<comm::AbortSignal> GenerationSignals::of(int64_t generation) {
  std::lock_guard lock(mu_);
  auto& s = signals_[generation];
  if (!s) {
    s = std::make_shared<comm::AbortSignal>();
    if (announced_ > known_) s->abort(reason_of(announced_));
  }
  // Generations two behind are over: a process holds at most its world and a transition's.
  signals_.erase(signals_.begin(), signals_.lower_bound(generation - 2));
  return s;
}

void GenerationSignals::announce(int64_t failure) {
  std::vector<std::shared_ptr<comm::AbortSignal>> fire;
  {
    std::lock_guard lock(mu_);
    if (failure <= announced_) return;
    announced_ = failure;
    if (announced_ <= known_) return;
    for (const auto& [g, s] : signals_) fire.push_back(s);
  }
  // Outside the lock: the callbacks close connections and may take a while.
  for (const auto& s : fire) s->abort(reason_of(failure));
}

void GenerationSignals::acknowledge(int64_t failures) {
  std::lock_guard lock(mu_);
  known_ = std::max(known_, failures);
}

}  // namespace tessel::runtime
