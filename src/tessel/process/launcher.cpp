#include "tessel/process/launcher.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "tessel/core/check.h"

namespace tessel::process {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string random_job_id() {
  std::random_device rd;
  std::string id;
  while (id.size() < 12) id += fmt::format("{:08x}", rd());
  return id.substr(0, 12);
}

std::string abs_path(const std::string& p) {
  std::error_code ec;
  auto a = std::filesystem::absolute(p, ec);
  return ec ? p : a.lexically_normal().string();
}

// Removes the default store dir when launch() ends; declared before the Supervisor so the
// workers are gone before their rendezvous files are.
struct OwnedDir {
  std::string path;
  ~OwnedDir() {
    if (path.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Creates the store dir; returns its absolute path. `owned` takes a default one.
std::string prepare_store_dir(const LaunchOptions& o, const std::string& job_id, OwnedDir& owned) {
  std::error_code ec;
  if (!o.store_dir.empty()) {
    std::filesystem::create_directories(o.store_dir, ec);
    TESSEL_CHECK(!ec, IoError, "launcher: cannot create store dir '{}': {}", o.store_dir,
                 ec.message());
    return abs_path(o.store_dir);
  }
  std::string base = o.log_dir;
  if (base.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    base = (tmp && *tmp) ? tmp : "/tmp";
  }
  // Leftovers of launchers that were killed before they could remove theirs: their pid, in the
  // name, is gone.
  for (const auto& e : std::filesystem::directory_iterator(base, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tessel-store-", 0) != 0) continue;
    const auto pid = std::strtol(name.c_str() + 13, nullptr, 10);
    if (pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) {
      std::error_code rm;
      std::filesystem::remove_all(e.path(), rm);
    }
  }
  std::string tmpl =
      base + "/tessel-store-" + std::to_string(::getpid()) + "-" + job_id + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  TESSEL_CHECK(mkdtemp(buf.data()) != nullptr, IoError,
               "launcher: cannot create a store dir under '{}': {}", base, std::strerror(errno));
  owned.path = abs_path(buf.data());
  return owned.path;
}

}  // namespace

int default_omp_threads(int nproc) {
  int cores = 0;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cores / std::max(1, nproc));
}

LaunchResult launch(const LaunchOptions& o) {
  TESSEL_CHECK(o.nproc >= 1, ConfigError, "launcher: nproc must be at least 1, got {}", o.nproc);
  TESSEL_CHECK(!o.command.empty() && !o.command[0].empty(), ConfigError,
               "launcher: no worker command given (e.g. `tessel launch -n 2 -- ./worker`)");
  TESSEL_CHECK(o.stop_timeout.count() >= 0 && o.peer_grace.count() >= 0, ConfigError,
               "launcher: stop_timeout ({} ms) and peer_grace ({} ms) must not be negative",
               o.stop_timeout.count(), o.peer_grace.count());
  for (const auto& [k, v] : o.extra_env) {
    TESSEL_CHECK(!k.empty() && k.find('=') == std::string::npos, ConfigError,
                 "launcher: invalid environment variable name '{}'", k);
  }

  LaunchResult result;
  result.job_id = o.job_id.empty() ? random_job_id() : o.job_id;
  if (!o.log_dir.empty()) {  // before the store dir, which defaults to a place inside it
    std::error_code ec;
    std::filesystem::create_directories(o.log_dir, ec);
    TESSEL_CHECK(!ec, IoError, "launcher: cannot create log dir '{}': {}", o.log_dir, ec.message());
  }
  OwnedDir owned_store;
  if (o.file_store) result.store_dir = prepare_store_dir(o, result.job_id, owned_store);

  SupervisorOptions so;
  so.log_dir = o.log_dir;
  so.console_fd = o.console_fd;
  so.prefix_console = o.prefix_console;
  so.stop_timeout = o.stop_timeout;
  so.name = "launcher";
  so.forward_interrupts = !o.on_interrupt;
  so.parent_death_signal = o.parent_death_signal;
  if (!std::getenv("OMP_NUM_THREADS") && !o.extra_env.count("OMP_NUM_THREADS")) {
    so.env["OMP_NUM_THREADS"] = std::to_string(default_omp_threads(o.nproc));
  }
  for (const auto& [k, v] : o.extra_env) so.env[k] = v;
  so.env["WORLD_SIZE"] = so.env["LOCAL_WORLD_SIZE"] = so.env["TESSEL_WORLD_SIZE"] =
      std::to_string(o.world_size > 0 ? o.world_size : o.nproc);
  so.env["TESSEL_JOB_ID"] = result.job_id;
  if (o.file_store) so.env["TESSEL_STORE_DIR"] = result.store_dir;
  so.env["TESSEL_GENERATION"] = "0";

  Supervisor sup(std::move(so));
  // Supervisor ids count spawns (never reused); ranks may be started again (on_tick).
  std::vector<int> rank_of_id;
  std::set<int> ranks_started;
  int left = 0;
  auto spawn = [&](int rank, const std::map<std::string, std::string>& env) {
    const std::string r = std::to_string(rank);
    WorkerSpec spec;
    spec.id = int(rank_of_id.size());
    spec.command = o.command;
    spec.env = env;
    spec.env["RANK"] = spec.env["LOCAL_RANK"] = spec.env["TESSEL_RANK"] = r;
    spec.log_name = "rank" + r + ".log";
    spec.append_log = ranks_started.count(rank) > 0;
    spec.console_prefix = o.prefix_console ? "[rank " + r + "] " : "";
    sup.spawn(spec);
    rank_of_id.push_back(rank);
    ranks_started.insert(rank);
    result.workers.emplace_back();
    ++left;
  };
  for (int r = 0; r < o.nproc; ++r) spawn(r, {});
  auto kill = [&](int rank) {
    for (int id : sup.running())
      if (rank_of_id[static_cast<size_t>(id)] == rank) return sup.kill(id);
    return false;
  };
  const LaunchOptions::Workers workers{spawn, kill};
  // A graceful stop (on_interrupt): the signal was not forwarded; the workers get
  // interrupt_grace to save and exit, then terminate_all().
  bool interrupt_seen = false, in_interrupt_grace = false;
  Clock::time_point interrupt_deadline{};

  // Policy: the first worker that does not end ok (or the launcher's own interruption) is THE
  // failure; the others get peer_grace to end by themselves, then terminate_all().
  bool in_grace = false;  // a failure happened; terminate_all() at term_at
  Clock::time_point term_at{};
  while (left > 0) {
    milliseconds wait = o.on_tick ? std::min(o.tick, milliseconds(1000)) : milliseconds(1000);
    if (in_grace) {
      wait = std::clamp(std::chrono::ceil<milliseconds>(term_at - Clock::now()), milliseconds(0),
                        wait);
    }
    if (in_interrupt_grace) {
      wait = std::clamp(std::chrono::ceil<milliseconds>(interrupt_deadline - Clock::now()),
                        milliseconds(0), wait);
    }
    // Whether the job's own policy still runs (on_tick, on_exit): not after a failure ended it,
    // nor after an interruption, unless the caller stops the workers itself (on_interrupt).
    auto live = [&] {
      return result.failure.empty() && !sup.shutting_down() &&
             (!sup.interrupted() || o.on_interrupt);
    };
    // The wake fds only while on_tick runs: nobody would consume them otherwise.
    const bool ticking = o.on_tick && live();
    auto exits = sup.poll(wait, ticking ? o.wake_fds : std::vector<int>{});
    if (sup.interrupted() && !interrupt_seen && o.on_interrupt) {
      interrupt_seen = in_interrupt_grace = true;
      interrupt_deadline = Clock::now() + o.interrupt_grace;
      sup.notice(fmt::format(
          "received {}: the workers save a checkpoint and stop within {} ms (a second {} stops "
          "them now)",
          signal_name(sup.interrupt_signal()), o.interrupt_grace.count(),
          signal_name(sup.interrupt_signal())));
      try {
        o.on_interrupt(sup.interrupt_signal());
      } catch (const std::exception& e) {
        sup.notice(fmt::format("could not ask the workers to stop ({}); stopping them", e.what()));
        sup.terminate_all();
      }
    }
    // An interruption seen in the same poll as exits came first: the signal is processed before
    // the reaping, and forwarding it may be what ended them.
    if (sup.interrupted() && !o.on_interrupt) {
      in_grace = false;  // the forwarded signal started its own stop timeout
      if (result.failure.empty()) {
        result.failure = fmt::format("the launcher received {} and forwarded it to all workers",
                                     signal_name(sup.interrupt_signal()));
        result.exit_code = 128 + sup.interrupt_signal();
      }
    }
    for (auto e : exits) {
      const int rank = rank_of_id[static_cast<size_t>(e.id)];
      e.rank = rank;
      result.workers[static_cast<size_t>(e.id)] = e;
      --left;
      const bool handled = o.on_exit && live() && o.on_exit(e) && !e.ok();
      if (handled) {
        sup.notice(fmt::format("rank {} (pid {}) {}; the job goes on without it", rank, e.pid,
                               e.describe(o.command[0])));
        continue;
      }
      if (e.ok() || !result.failure.empty()) continue;
      result.failed_rank = rank;
      result.failure = fmt::format("rank {} (pid {}) {}", rank, e.pid, e.describe(o.command[0]));
      result.exit_code = e.status_lost ? 255 : e.signaled ? 128 + e.signal : e.code;
      size_t others = sup.running().size();
      if (others == 0) {
        sup.notice(result.failure);
        continue;
      }
      sup.notice(fmt::format("{}; stopping the other {} worker(s): SIGTERM{}, SIGKILL {} ms later",
                             result.failure, others,
                             o.peer_grace.count() > 0
                                 ? fmt::format(" after {} ms", o.peer_grace.count())
                                 : std::string(),
                             o.stop_timeout.count()));
      if (o.peer_grace.count() > 0) {
        in_grace = true;
        term_at = Clock::now() + o.peer_grace;
      } else {
        sup.terminate_all();
      }
    }
    if (o.on_tick && live()) {
      try {
        o.on_tick(workers, result);
      } catch (const std::exception& e) {
        result.failure = fmt::format("the job's coordinator stopped it: {}", e.what());
        result.exit_code = 1;
        sup.notice(result.failure + "; stopping the workers");
        sup.terminate_all();
      }
    }
    if (in_grace && Clock::now() >= term_at) {
      in_grace = false;
      sup.terminate_all();
    }
    if (in_interrupt_grace && Clock::now() >= interrupt_deadline) {
      in_interrupt_grace = false;
      if (!sup.running().empty()) {
        sup.notice(fmt::format("{} worker(s) did not stop within {} ms; stopping them",
                               sup.running().size(), o.interrupt_grace.count()));
        sup.terminate_all();
      }
    }
  }
  result.console_error = sup.console_error();
  if (interrupt_seen && result.failure.empty()) {
    result.failure =
        fmt::format("the launcher received {}; the workers were asked to save and stop",
                    signal_name(sup.interrupt_signal()));
    result.exit_code = 128 + sup.interrupt_signal();
  }
  return result;
}

}  // namespace tessel::process
