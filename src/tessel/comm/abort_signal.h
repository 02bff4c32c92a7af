// AbortSignal: a thread-safe, one-shot cancellation flag with a reason and callbacks.
//
// The elastic runtime learns that a world is being abandoned (a peer died, a recovery starts)
// from its control store, on a thread other than the one connecting or running the world's
// communicators. One signal per generation lets that thread stop everything of the generation
// with one call: a rendezvous in progress (Communicator::connect and connect_process_groups, given
// the signal in StoreOptions::abort_signal) and the communicators it made (each registers its
// abort() here).
//
// Contract:
//   - abort(reason) is idempotent and never throws; the first reason is kept. The first call
//     runs every registered callback once, synchronously, on the calling thread, with the reason,
//     and returns when they have all returned. A concurrent second call returns at once.
//   - on_abort(callback) registers a callback. When the signal has already fired, the callback
//     runs at once, on the registering thread, before on_abort returns: no registration can miss
//     the abort.
//   - The returned Registration unregisters the callback when destroyed. If abort() is running
//     that callback on another thread at that moment, the destructor waits until it has
//     returned, so whatever the callback refers to may be destroyed right after the
//     Registration. Hence: never destroy a Registration while holding a lock its callback takes.
//   - Callbacks must be quick and should not throw (an exception is swallowed). They may call
//     aborted(), reason() and on_abort().
//   - Cheap: no thread of its own; aborted() is one atomic load.
//
// Own a signal through a shared_ptr (std::make_shared<AbortSignal>()): a Registration keeps its
// signal alive, so a communicator may outlive the caller's copy of the signal.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace tessel::comm {

class AbortSignal : public std::enable_shared_from_this<AbortSignal> {
 public:
  using Callback = std::function<void(const std::string& reason)>;

  // Unregisters its callback when destroyed (see above). An empty one (default-made, moved-from,
  // or returned by on_abort after the signal had fired) does nothing.
  class Registration {
   public:
    Registration() = default;
    Registration(Registration&& other) noexcept;
    Registration& operator=(Registration&& other) noexcept;
    ~Registration();
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;

    // Unregisters now, as the destructor does.
    void reset() noexcept;

   private:
    friend class AbortSignal;
    Registration(std::shared_ptr<AbortSignal> signal, uint64_t id);

    std::shared_ptr<AbortSignal> signal_;
    uint64_t id_ = 0;
  };

  AbortSignal() = default;
  AbortSignal(const AbortSignal&) = delete;
  AbortSignal& operator=(const AbortSignal&) = delete;

  // Fires the signal (see above). When the reason cannot be copied (out of memory) the signal
  // still fires, with the reason "aborted".
  void abort(const std::string& reason) noexcept;

  bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }
  // The first abort's reason; empty while the signal has not fired.
  std::string reason() const;

  // Registers `callback` (see above). Throws InvalidArgumentError when this signal is not owned by
  // a shared_ptr, and std::bad_alloc.
  [[nodiscard]] Registration on_abort(Callback callback);

 private:
  void unregister(uint64_t id) noexcept;

  std::atomic<bool> aborted_{false};
  mutable std::mutex mu_;  // guards everything below
  std::condition_variable callback_returned_;
  std::string reason_;
  std::map<uint64_t, Callback> callbacks_;  // registered and not run yet, by id
  uint64_t next_id_ = 1;
  uint64_t running_id_ = 0;  // the callback abort() is running now (0: none), and on which thread
  std::thread::id running_thread_;
};

}  // namespace tessel::comm
