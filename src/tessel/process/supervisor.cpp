#include "tessel/process/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "tessel/core/check.h"
#include "tessel/core/write_all.h"

extern char** environ;

namespace tessel::process {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr size_t kMaxLine = 64 * 1024;    // longer lines are cut so one worker cannot grow memory
constexpr milliseconds kTick{100};        // poll wakes at least this often (lost-wakeup safety net)
constexpr milliseconds kDrain{1000};      // output still arriving after a worker was reaped
constexpr milliseconds kExecWait{10000};  // a child that neither execs nor fails: give up asking

// ---- One supervisor per process: the signal plumbing is process-wide. ----

// A gate rather than a std::mutex: the supervisor may be destroyed on another thread than the
// one that created it, and a second supervisor on the owning thread must fail, not deadlock.
std::mutex g_gate_mutex;
std::condition_variable g_gate_cv;
bool g_gate_busy = false;
std::thread::id g_gate_owner;

class Gate {
 public:
  Gate() {
    std::unique_lock lock(g_gate_mutex);
    TESSEL_CHECK(!(g_gate_busy && g_gate_owner == std::this_thread::get_id()), ConfigError,
                 "supervisor: another Supervisor (or launch()) is alive on this thread; only one "
                 "can own the process's signals at a time, destroy the first one before");
    g_gate_cv.wait(lock, [] { return !g_gate_busy; });
    g_gate_busy = true;
    g_gate_owner = std::this_thread::get_id();
  }
  ~Gate() {
    {
      std::lock_guard lock(g_gate_mutex);
      g_gate_busy = false;
      g_gate_owner = {};
    }
    g_gate_cv.notify_one();
  }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;
};

std::atomic<int> g_signal_fd{-1};
static_assert(std::atomic<int>::is_always_lock_free, "used from a signal handler");

extern "C" void on_supervisor_signal(int sig) {
  int saved = errno;
  int fd = g_signal_fd.load(std::memory_order_relaxed);
  unsigned char byte = static_cast<unsigned char>(sig);
  if (fd >= 0 && write(fd, &byte, 1) < 0) {
    // Pipe full: a wakeup is already pending, and SIGCHLD is re-checked every tick anyway.
  }
  errno = saved;
}

// Closes an fd on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Moves fd to a number >= 3 so dup2 onto 0/1/2 in the child never collides with it (this process
// may have been started with its stdio closed).
int above_stdio(int fd) {
  if (fd >= 3) return fd;
  int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  int err = errno;
  close(fd);
  if (moved < 0) {
    TESSEL_THROW(IoError, "supervisor: cannot duplicate a pipe: {}", std::strerror(err));
  }
  return moved;
}

// A close-on-exec pipe with both ends >= 3.
std::pair<Fd, Fd> make_pipe() {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    TESSEL_THROW(IoError,
                 "supervisor: cannot create a pipe: {} (raise `ulimit -n` or run fewer workers)",
                 std::strerror(errno));
  }
  Fd r(above_stdio(p[0]));
  Fd w(above_stdio(p[1]));
  return {std::move(r), std::move(w)};
}

// Installs the supervisor's handlers for its lifetime and restores the caller's.
class SignalScope {
 public:
  SignalScope() {
    auto [r, w] = make_pipe();
    fcntl(r.get(), F_SETFL, O_NONBLOCK);
    fcntl(w.get(), F_SETFL, O_NONBLOCK);
    read_ = std::move(r);
    write_ = std::move(w);
    g_signal_fd.store(write_.get());
    struct sigaction sa {};
    sa.sa_handler = on_supervisor_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    // Also makes children reapable when the caller had set SIGCHLD to SIG_IGN (auto-reaping).
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, &old_chld_);
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, &old_pipe_);
  }
  ~SignalScope() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGCHLD, &old_chld_, nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
    g_signal_fd.store(-1);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  int fd() const { return read_.get(); }

  // Signals received since the last call, in order.
  std::vector<int> take() {
    std::vector<int> out;
    unsigned char buf[64];
    for (;;) {
      ssize_t n = read(read_.get(), buf, sizeof buf);
      if (n > 0) {
        out.insert(out.end(), buf, buf + n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      break;
    }
    return out;
  }

 private:
  Fd read_, write_;
  struct sigaction old_int_ {
  }, old_term_{}, old_chld_{}, old_pipe_{};
};

void check_env_names(const std::map<std::string, std::string>& env, const char* what) {
  for (const auto& [k, v] : env) {
    TESSEL_CHECK(!k.empty() && k.find('=') == std::string::npos, ConfigError,
                 "supervisor: invalid environment variable name '{}' in {}", k, what);
  }
}

milliseconds until(Clock::time_point t, Clock::time_point now) {
  return std::max(milliseconds(0), std::chrono::ceil<milliseconds>(t - now));
}

struct Stream {
  Fd fd;
  std::string partial;
};

struct Worker {
  int id = 0;
  pid_t pid = -1;
  std::string prefix;    // console prefix
  std::string log_path;  // "" when no log
  Fd log;
  Stream out, err;
  Clock::time_point start;
  bool reaped = false;    // waited for; pid no longer ours
  bool ready = false;     // reaped and output drained: the exit is in the ready queue
  bool reported = false;  // the exit was handed to the caller
  std::optional<Clock::time_point> kill_at;      // SIGKILL deadline after a SIGTERM
  std::optional<Clock::time_point> drain_until;  // after the reap
  WorkerExit exit;
};

}  // namespace

struct Supervisor::Impl {
  // Declaration order is destruction order reversed: workers are killed in ~Impl's body, then
  // fds close, then the caller's signal handlers come back, then the next supervisor may start.
  Gate gate;
  SupervisorOptions o;
  int console = -1;
  std::string console_error;  // why the console was given up (empty: it was not)
  SignalScope signals;
  Fd devnull;
  std::map<std::string, std::string> base_env;
  std::map<int, std::unique_ptr<Worker>> workers;  // every worker ever spawned, by id
  std::deque<int> ready;                           // ids whose exit is reportable, in reap order
  bool shutting_down = false;
  int interrupt_sig = 0;

  explicit Impl(SupervisorOptions options) : o(std::move(options)), console(o.console_fd) {
    TESSEL_CHECK(o.stop_timeout.count() >= 0, ConfigError,
                 "supervisor: stop_timeout ({} ms) must not be negative", o.stop_timeout.count());
    TESSEL_CHECK(o.parent_death_signal >= 0 && o.parent_death_signal < NSIG, ConfigError,
                 "supervisor: parent_death_signal {} is not a signal number",
                 o.parent_death_signal);
    check_env_names(o.env, "SupervisorOptions::env");
    if (!o.log_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o.log_dir, ec);
      TESSEL_CHECK(!ec, IoError, "supervisor: cannot create log dir '{}': {}", o.log_dir,
                   ec.message());
    }
    devnull.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
    TESSEL_CHECK(devnull.get() >= 0, IoError, "supervisor: cannot open /dev/null: {}",
                 std::strerror(errno));
    devnull.reset(above_stdio(devnull.release()));
    if (o.inherit_env) {
      for (char** e = environ; e && *e; ++e) {
        std::string kv = *e;
        size_t eq = kv.find('=');
        if (eq != std::string::npos) base_env[kv.substr(0, eq)] = kv.substr(eq + 1);
      }
    }
    for (const auto& [k, v] : o.env) base_env[k] = v;
  }

  ~Impl() {
    for (auto& [id, w] : workers) {
      if (!w->reaped) ::kill(-w->pid, SIGKILL);
    }
    for (auto& [id, w] : workers) {
      if (w->reaped) continue;
      int status;
      while (waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }

  Worker& find(int id) const {
    auto it = workers.find(id);
    TESSEL_CHECK(it != workers.end(), InvalidArgumentError,
                 "supervisor: no worker with id {} was spawned", id);
    return *it->second;
  }

  // ---- spawning ----

  pid_t spawn(const WorkerSpec& spec) {
    TESSEL_CHECK(spec.id >= 0, ConfigError, "supervisor: worker id must not be negative, got {}",
                 spec.id);
    TESSEL_CHECK(!workers.count(spec.id), ConfigError,
                 "supervisor: worker id {} was already used; give a replacement a new id", spec.id);
    TESSEL_CHECK(!spec.command.empty() && !spec.command[0].empty(), ConfigError,
                 "supervisor: worker {} has no command", spec.id);
    check_env_names(spec.env, "WorkerSpec::env");
    TESSEL_CHECK(spec.log_name.find('/') == std::string::npos && spec.log_name != "." &&
                     spec.log_name != "..",
                 ConfigError, "supervisor: log_name '{}' of worker {} must be a plain file name",
                 spec.log_name, spec.id);

    auto w = std::make_unique<Worker>();
    w->id = spec.id;
    w->exit.id = w->exit.rank = spec.id;
    w->prefix = spec.console_prefix ? *spec.console_prefix
                : o.prefix_console  ? fmt::format("[rank {}] ", spec.id)
                                    : std::string();
    if (!o.log_dir.empty()) {
      std::string name = spec.log_name.empty() ? fmt::format("rank{}.log", spec.id) : spec.log_name;
      w->log_path = (std::filesystem::path(o.log_dir) / name).string();
      int flags = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (spec.append_log ? 0 : O_TRUNC);
      int fd = open(w->log_path.c_str(), flags, 0644);
      TESSEL_CHECK(fd >= 0, IoError, "supervisor: cannot open log file '{}': {}", w->log_path,
                   std::strerror(errno));
      w->log.reset(fd);
    }

    // argv and envp are built before fork: the child may only make async-signal-safe calls.
    std::vector<char*> argv;
    for (const auto& a : spec.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    auto env = base_env;
    for (const auto& [k, v] : spec.env) env[k] = v;
    std::vector<std::string> strings;
    for (const auto& [k, v] : env) strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : strings) envp.push_back(s.data());
    envp.push_back(nullptr);

    auto [out_r, out_w] = make_pipe();
    auto [err_r, err_w] = make_pipe();
    auto [status_r, status_w] = make_pipe();
    const pid_t parent = getpid();
    const int death_signal = o.parent_death_signal;

    // Block every signal across fork so no supervisor handler runs in the child before it resets
    // them to the defaults.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = fork();
    if (pid == 0) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) sigaction(sig, &dfl, nullptr);
      setpgid(0, 0);
      if (death_signal != 0) prctl(PR_SET_PDEATHSIG, death_signal);
      if (getppid() != parent) _exit(127);  // the supervisor died before PDEATHSIG was armed
      dup2(devnull.get(), 0);
      dup2(out_w.get(), 1);
      dup2(err_w.get(), 2);
      sigprocmask(SIG_SETMASK, &old, nullptr);
      execvpe(argv[0], argv.data(), envp.data());
      int e = errno;
      if (write(status_w.get(), &e, sizeof e) < 0) {
      }
      _exit(127);
    }
    int fork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    TESSEL_CHECK(pid > 0, IoError, "supervisor: cannot fork worker {}: {}", spec.id,
                 std::strerror(fork_errno));
    setpgid(pid, pid);  // also from the parent, so signalling the group works right away
    w->pid = pid;
    w->start = Clock::now();
    w->exit.pid = pid;
    Worker& wr = *w;
    workers.emplace(spec.id, std::move(w));  // from here on ~Impl kills and reaps it
    out_w.reset();
    err_w.reset();
    status_w.reset();

    // The status pipe closes on a successful exec, or carries errno when exec failed.
    pollfd p{status_r.get(), POLLIN, 0};
    auto deadline = Clock::now() + kExecWait;
    for (;;) {
      int n = ::poll(&p, 1, static_cast<int>(until(deadline, Clock::now()).count()));
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) {
        int e = 0;
        ssize_t got;
        while ((got = read(status_r.get(), &e, sizeof e)) < 0 && errno == EINTR) {
        }
        if (got == static_cast<ssize_t>(sizeof e)) {
          wr.exit.could_not_run = true;
          wr.exit.exec_error = std::strerror(e);
        }
      }
      break;
    }
    for (auto* s : {&out_r, &err_r}) fcntl(s->get(), F_SETFL, O_NONBLOCK);
    wr.out.fd = std::move(out_r);
    wr.err.fd = std::move(err_r);
    return pid;
  }

  // ---- output ----

  void notice(const std::string& text) {
    if (console < 0) return;
    std::string line = "[" + o.name + "] " + text + "\n";
    if (!write_all(console, line.data(), line.size())) lose_console();
  }

  // The console cannot be written (closed, full, stuck): keep running, the logs still get every
  // line; the caller says at the end that the console's copy is incomplete.
  void lose_console() {
    console_error = std::strerror(errno);
    console = -1;
  }

  void emit(const Worker& w, std::string_view line, std::string& con, std::string& log) const {
    if (console >= 0) {
      con += w.prefix;
      con.append(line);
      con += '\n';
    }
    if (w.log) {
      log.append(line);
      log += '\n';
    }
  }

  void flush(Worker& w, const std::string& con, const std::string& log) {
    if (!con.empty() && console >= 0 && !write_all(console, con.data(), con.size())) lose_console();
    if (!log.empty() && w.log && !write_all(w.log.get(), log.data(), log.size())) {
      int e = errno;
      w.log.reset();
      notice(fmt::format("cannot write {}: {}; no more log for rank {}", w.log_path,
                         std::strerror(e), w.id));
    }
  }

  // Emits what is left of a stream (a last line without '\n') and closes it.
  void close_stream(Worker& w, Stream& s) {
    std::string con, log;
    if (!s.partial.empty()) emit(w, s.partial, con, log);
    s.partial.clear();
    s.fd.reset();
    flush(w, con, log);
  }

  // Reads what is available on one stream and emits complete lines; closes it at EOF.
  void pump(Worker& w, Stream& s) {
    char buf[65536];
    ssize_t n;
    while ((n = read(s.fd.get(), buf, sizeof buf)) < 0 && errno == EINTR) {
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // EOF (or a read error, treated alike)
      close_stream(w, s);
      return;
    }
    s.partial.append(buf, static_cast<size_t>(n));
    std::string con, log;
    size_t begin = 0;
    for (;;) {
      size_t nl = s.partial.find('\n', begin);
      if (nl == std::string::npos) {
        if (s.partial.size() - begin < kMaxLine) break;
        emit(w, std::string_view(s.partial).substr(begin, kMaxLine), con, log);
        begin += kMaxLine;
        continue;
      }
      emit(w, std::string_view(s.partial).substr(begin, nl - begin), con, log);
      begin = nl + 1;
    }
    s.partial.erase(0, begin);
    flush(w, con, log);
  }

  // ---- process control ----

  // Sends sig to the group of a worker not reaped yet (its pid, a zombie at worst, is still ours,
  // so the group cannot be someone else's).
  bool signal_worker(Worker& w, int sig) {
    if (w.reaped) return false;
    ::kill(-w.pid, sig);
    w.exit.stopped_by_launcher = true;
    return true;
  }

  bool terminate(Worker& w, Clock::time_point now) {
    if (!signal_worker(w, SIGTERM)) return false;
    auto at = now + o.stop_timeout;
    if (!w.kill_at || at < *w.kill_at) w.kill_at = at;
    return true;
  }

  void terminate_all() {
    shutting_down = true;
    auto now = Clock::now();
    for (auto& [id, w] : workers) terminate(*w, now);
  }

  void on_signal(int sig, Clock::time_point now) {
    if (!interrupt_sig && !shutting_down && !o.forward_interrupts) {
      interrupt_sig = sig;  // the caller says what it does about it
      return;
    }
    if (!interrupt_sig && !shutting_down) {
      interrupt_sig = sig;
      notice(fmt::format("received {}; forwarding it to all workers (SIGKILL {} ms later)",
                         signal_name(sig), o.stop_timeout.count()));
      for (auto& [id, w] : workers) {
        if (!signal_worker(*w, sig)) continue;
        auto at = now + o.stop_timeout;
        if (!w->kill_at || at < *w->kill_at) w->kill_at = at;
      }
      return;
    }
    if (!interrupt_sig) interrupt_sig = sig;
    shutting_down = true;
    notice(fmt::format("received {} during shutdown; sending SIGKILL to all workers",
                       signal_name(sig)));
    for (auto& [id, w] : workers) {
      if (signal_worker(*w, SIGKILL)) w->kill_at.reset();
    }
  }

  void send_due_kills(Clock::time_point now) {
    std::string ids;
    for (auto& [id, w] : workers) {
      if (w->reaped || !w->kill_at || now < *w->kill_at) continue;
      w->kill_at.reset();
      signal_worker(*w, SIGKILL);
      ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    }
    if (!ids.empty()) {
      notice(fmt::format("stop timeout ({} ms) passed; sending SIGKILL to rank(s) {}",
                         o.stop_timeout.count(), ids));
    }
  }

  void record_status(Worker& w, int status) {
    if (WIFSIGNALED(status)) {
      w.exit.signaled = true;
      w.exit.signal = WTERMSIG(status);
      w.exit.core_dumped = WCOREDUMP(status);
    } else {
      w.exit.code = WEXITSTATUS(status);
    }
  }

  void reap(Clock::time_point now) {
    for (auto& [id, wp] : workers) {
      Worker& w = *wp;
      if (w.reaped) continue;
      // Look without reaping first: while the worker is a zombie its pid (and so its process
      // group id) cannot be reused, so SIGKILL to the group reaches only its leftovers.
      siginfo_t info{};
      int r;
      while ((r = waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT)) <
                 0 &&
             errno == EINTR) {
      }
      if (r == 0 && info.si_pid != w.pid) continue;  // still running
      if (r == 0) {
        ::kill(-w.pid, SIGKILL);
        int status = 0;
        pid_t got;
        while ((got = waitpid(w.pid, &status, 0)) < 0 && errno == EINTR) {
        }
        if (got == w.pid) {
          record_status(w, status);
        } else {
          w.exit.status_lost = true;
          w.exit.code = 255;
        }
      } else {
        // ECHILD: someone else reaped it (a foreign waitpid(-1)); the status is lost.
        w.exit.status_lost = true;
        w.exit.code = 255;
      }
      w.reaped = true;
      w.kill_at.reset();
      w.exit.wall = std::chrono::duration_cast<milliseconds>(now - w.start);
      w.drain_until = now + kDrain;
    }
  }

  // Reaped workers whose output is read to the end (or whose drain time is up) become ready.
  void finish_drained(Clock::time_point now) {
    for (auto& [id, w] : workers) {
      if (!w->reaped || w->ready) continue;
      bool open = w->out.fd || w->err.fd;
      if (open && now < *w->drain_until) continue;
      // Output from leftovers that escaped the process group and still hold the pipes is cut.
      for (Stream* s : {&w->out, &w->err}) {
        if (s->fd) close_stream(*w, *s);
      }
      w->ready = true;
      ready.push_back(id);
    }
  }

  // One round: due deadlines, a wait of at most `wait` for output/signals, pumping, signals,
  // reaping. Returns true when a SIGINT/SIGTERM arrived; sets *woken when one of `wake` became
  // readable.
  bool step(milliseconds wait, const std::vector<int>& wake = {}, bool* woken = nullptr) {
    auto now = Clock::now();
    send_due_kills(now);
    finish_drained(now);
    if (!ready.empty()) wait = milliseconds(0);
    wait = std::min(wait, kTick);
    for (auto& [id, w] : workers) {
      if (!w->reaped && w->kill_at) wait = std::min(wait, until(*w->kill_at, now));
      if (w->reaped && !w->ready) wait = std::min(wait, until(*w->drain_until, now));
    }

    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, Stream*>> owners;
    fds.push_back({signals.fd(), POLLIN, 0});
    owners.emplace_back(nullptr, nullptr);
    for (int fd : wake) {
      fds.push_back({fd, POLLIN, 0});
      owners.emplace_back(nullptr, nullptr);
    }
    for (auto& [id, w] : workers) {
      for (Stream* s : {&w->out, &w->err}) {
        if (!s->fd) continue;
        fds.push_back({s->fd.get(), POLLIN, 0});
        owners.emplace_back(w.get(), s);
      }
    }
    int n = ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
    if (n < 0 && errno != EINTR) {
      TESSEL_THROW(IoError, "supervisor: poll failed: {}", std::strerror(errno));
    }
    now = Clock::now();
    if (n > 0) {
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        if (owners[i].first != nullptr)
          pump(*owners[i].first, *owners[i].second);
        else if (woken != nullptr)
          *woken = true;
      }
    }
    bool interrupt = false;
    for (int sig : signals.take()) {
      if (sig != SIGINT && sig != SIGTERM) continue;  // SIGCHLD: just a wakeup
      on_signal(sig, now);
      interrupt = true;
    }
    reap(now);
    finish_drained(now);
    return interrupt;
  }

  std::vector<WorkerExit> take_ready() {
    std::vector<WorkerExit> out;
    for (int id : ready) {
      Worker& w = *workers.at(id);
      w.reported = true;
      out.push_back(w.exit);
    }
    ready.clear();
    return out;
  }

  std::vector<WorkerExit> poll(milliseconds timeout, const std::vector<int>& wake) {
    auto deadline = Clock::now() + std::max(timeout, milliseconds(0));
    for (;;) {
      bool woken = false;
      bool interrupt = step(until(deadline, Clock::now()), wake, &woken);
      if (interrupt || woken || !ready.empty() || Clock::now() >= deadline) break;
    }
    return take_ready();
  }

  WorkerExit stop(int id) {
    Worker& w = find(id);
    TESSEL_CHECK(!w.reported, InvalidArgumentError,
                 "supervisor: worker {} has already ended and been reported", id);
    terminate(w, Clock::now());
    while (!w.ready) step(kTick);
    ready.erase(std::find(ready.begin(), ready.end(), id));
    w.reported = true;
    return w.exit;
  }

  std::vector<WorkerExit> stop_all() {
    terminate_all();
    auto unfinished = [&] {
      return std::any_of(workers.begin(), workers.end(),
                         [](const auto& kv) { return !kv.second->ready; });
    };
    while (unfinished()) step(kTick);
    return take_ready();
  }
};

Supervisor::Supervisor(SupervisorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

Supervisor::~Supervisor() = default;

pid_t Supervisor::spawn(const WorkerSpec& spec) {
  return impl_->spawn(spec);
}

std::vector<WorkerExit> Supervisor::poll(std::chrono::milliseconds timeout,
                                         const std::vector<int>& wake_fds) {
  return impl_->poll(timeout, wake_fds);
}

bool Supervisor::terminate(int id) {
  return impl_->terminate(impl_->find(id), Clock::now());
}

bool Supervisor::kill(int id) {
  Worker& w = impl_->find(id);
  if (!impl_->signal_worker(w, SIGKILL)) return false;
  w.kill_at.reset();
  return true;
}

WorkerExit Supervisor::stop(int id) {
  return impl_->stop(id);
}

void Supervisor::terminate_all() {
  impl_->terminate_all();
}

std::vector<WorkerExit> Supervisor::stop_all() {
  return impl_->stop_all();
}

std::vector<int> Supervisor::running() const {
  std::vector<int> ids;
  for (const auto& [id, w] : impl_->workers) {
    if (!w->reported) ids.push_back(id);
  }
  return ids;
}

pid_t Supervisor::pid(int id) const {
  return impl_->find(id).pid;
}

bool Supervisor::interrupted() const {
  return impl_->interrupt_sig != 0;
}

const std::string& Supervisor::console_error() const {
  return impl_->console_error;
}

bool Supervisor::shutting_down() const {
  return impl_->shutting_down;
}

int Supervisor::interrupt_signal() const {
  return impl_->interrupt_sig;
}

void Supervisor::notice(const std::string& text) {
  impl_->notice(text);
}

std::string Supervisor::log_path(int id) const {
  return impl_->find(id).log_path;
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  if (abbrev) return std::string("SIG") + abbrev;
  return fmt::format("signal {}", sig);
}

std::string WorkerExit::describe(const std::string& program) const {
  if (status_lost) return "was reaped by someone else; status unknown";
  if (could_not_run && !signaled) {
    return fmt::format("could not run '{}': {} (exit code {})", program, exec_error, code);
  }
  if (could_not_run) {
    return fmt::format("could not run '{}': {}, then was killed by signal {} ({})", program,
                       exec_error, signal, signal_name(signal));
  }
  if (signaled) {
    return fmt::format("was killed by signal {} ({}){}", signal, signal_name(signal),
                       core_dumped ? ", core dumped" : "");
  }
  return fmt::format("exited with code {}", code);
}

}  // namespace tessel::process
