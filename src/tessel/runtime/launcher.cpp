#include "tessel/runtime/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "tessel/core/check.h"

extern char** environ;

namespace tessel::runtime {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr size_t kMaxLine = 64 * 1024;    // longer lines are cut so one worker cannot grow memory
constexpr milliseconds kTick{100};        // poll wakes at least this often (lost-wakeup safety net)
constexpr milliseconds kDrain{1000};      // output still arriving after everyone was reaped
constexpr milliseconds kExecWait{10000};  // a child that neither execs nor fails: give up asking

// ---- Process-wide signal plumbing (self-pipe). Serialised by g_launch_mutex. ----

std::mutex g_launch_mutex;
std::atomic<int> g_signal_fd{-1};
static_assert(std::atomic<int>::is_always_lock_free, "used from a signal handler");

extern "C" void on_launcher_signal(int sig) {
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

// Moves fd to a number >= 3 so dup2 onto 0/1/2 in the child never collides with it (the launcher
// may have been started with its stdio closed).
int above_stdio(int fd) {
  if (fd >= 3) return fd;
  int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  int err = errno;
  close(fd);
  if (moved < 0) TESSEL_THROW(IoError, "launcher: cannot duplicate a pipe: {}", std::strerror(err));
  return moved;
}

// A close-on-exec pipe with both ends >= 3.
std::pair<Fd, Fd> make_pipe() {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    TESSEL_THROW(IoError, "launcher: cannot create a pipe: {} (raise `ulimit -n` or lower --nproc)",
                 std::strerror(errno));
  }
  Fd r(above_stdio(p[0]));
  Fd w(above_stdio(p[1]));
  return {std::move(r), std::move(w)};
}

// Installs the launcher's handlers for the duration of launch() and restores the caller's.
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
    sa.sa_handler = on_launcher_signal;
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

// Writes all of data; handles EINTR and a non-blocking fd (bounded wait). False on error.
bool write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, 1000) <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

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

struct Stream {
  Fd fd;
  std::string partial;
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  Clock::time_point start;
  WorkerExit exit;
  Stream out, err;
  Fd log;
};

class Launch {
 public:
  explicit Launch(const LaunchOptions& o) : o_(o), console_(o.console_fd) {}

  ~Launch() {
    // Reached with live workers only when something threw: do not leave them behind.
    for (auto& w : workers_) {
      if (w.alive) kill(-w.pid, SIGKILL);
    }
    for (auto& w : workers_) {
      if (!w.alive) continue;
      int status;
      while (waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    if (owns_store_ && !store_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(store_dir_, ec);
    }
  }

  LaunchResult run() {
    prepare();
    SignalScope signals;
    signals_ = &signals;
    spawn_all();
    loop();
    return finish();
  }

 private:
  void prepare() {
    job_id_ = o_.job_id.empty() ? random_job_id() : o_.job_id;
    std::error_code ec;
    if (!o_.log_dir.empty()) {
      std::filesystem::create_directories(o_.log_dir, ec);
      TESSEL_CHECK(!ec, IoError, "launcher: cannot create log dir '{}': {}", o_.log_dir,
                   ec.message());
    }
    if (!o_.store_dir.empty()) {
      std::filesystem::create_directories(o_.store_dir, ec);
      TESSEL_CHECK(!ec, IoError, "launcher: cannot create store dir '{}': {}", o_.store_dir,
                   ec.message());
      store_dir_ = abs_path(o_.store_dir);
    } else {
      std::string base = o_.log_dir;
      if (base.empty()) {
        const char* tmp = std::getenv("TMPDIR");
        base = (tmp && *tmp) ? tmp : "/tmp";
      }
      std::string tmpl = base + "/tessel-store-" + job_id_ + "-XXXXXX";
      std::vector<char> buf(tmpl.begin(), tmpl.end());
      buf.push_back('\0');
      TESSEL_CHECK(mkdtemp(buf.data()) != nullptr, IoError,
                   "launcher: cannot create a store dir under '{}': {}", base,
                   std::strerror(errno));
      store_dir_ = abs_path(buf.data());
      owns_store_ = true;
    }

    workers_.resize(static_cast<size_t>(o_.nproc));
    for (int r = 0; r < o_.nproc; ++r) {
      Worker& w = workers_[static_cast<size_t>(r)];
      w.rank = r;
      w.exit.rank = r;
      if (!o_.log_dir.empty()) {
        std::string path = log_path(r);
        int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
        TESSEL_CHECK(fd >= 0, IoError, "launcher: cannot open log file '{}': {}", path,
                     std::strerror(errno));
        w.log.reset(fd);
      }
    }
    devnull_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
    TESSEL_CHECK(devnull_.get() >= 0, IoError, "launcher: cannot open /dev/null: {}",
                 std::strerror(errno));
    devnull_.reset(above_stdio(devnull_.release()));

    // The base environment every rank shares.
    std::map<std::string, std::string> env;
    for (char** e = environ; e && *e; ++e) {
      std::string kv = *e;
      size_t eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    if (!env.count("OMP_NUM_THREADS") && !o_.extra_env.count("OMP_NUM_THREADS")) {
      env["OMP_NUM_THREADS"] = std::to_string(default_omp_threads(o_.nproc));
    }
    for (const auto& [k, v] : o_.extra_env) env[k] = v;
    env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = env["TESSEL_WORLD_SIZE"] =
        std::to_string(o_.nproc);
    env["TESSEL_JOB_ID"] = job_id_;
    env["TESSEL_STORE_DIR"] = store_dir_;
    env["TESSEL_GENERATION"] = "0";
    base_env_ = std::move(env);
  }

  std::string log_path(int rank) const {
    return (std::filesystem::path(o_.log_dir) / fmt::format("rank{}.log", rank)).string();
  }

  void spawn_all() {
    // argv and envp are built before fork: the child may only make async-signal-safe calls.
    std::vector<char*> argv;
    for (const auto& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (auto& w : workers_) {
      auto env = base_env_;
      env["RANK"] = env["LOCAL_RANK"] = env["TESSEL_RANK"] = std::to_string(w.rank);
      std::vector<std::string> strings;
      for (const auto& [k, v] : env) strings.push_back(k + "=" + v);
      std::vector<char*> envp;
      for (auto& s : strings) envp.push_back(s.data());
      envp.push_back(nullptr);
      spawn(w, argv.data(), envp.data());
    }
  }

  void spawn(Worker& w, char* const* argv, char* const* envp) {
    auto [out_r, out_w] = make_pipe();
    auto [err_r, err_w] = make_pipe();
    auto [status_r, status_w] = make_pipe();
    const pid_t parent = getpid();

    // Block every signal across fork so no launcher handler runs in the child before it resets
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
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the launcher died before PDEATHSIG was armed
      dup2(devnull_.get(), 0);
      dup2(out_w.get(), 1);
      dup2(err_w.get(), 2);
      sigprocmask(SIG_SETMASK, &old, nullptr);
      execvpe(argv[0], argv, envp);
      int e = errno;
      if (write(status_w.get(), &e, sizeof e) < 0) {
      }
      _exit(127);
    }
    int fork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    TESSEL_CHECK(pid > 0, IoError, "launcher: cannot fork rank {}: {}", w.rank,
                 std::strerror(fork_errno));
    setpgid(pid, pid);  // also from the parent, so signalling the group works right away
    w.pid = pid;
    w.alive = true;
    w.start = Clock::now();
    w.exit.pid = pid;
    out_w.reset();
    err_w.reset();
    status_w.reset();

    // The status pipe closes on a successful exec, or carries errno when exec failed.
    pollfd p{status_r.get(), POLLIN, 0};
    auto deadline = Clock::now() + kExecWait;
    for (;;) {
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      int n = poll(&p, 1, static_cast<int>(std::max<long long>(left, 0)));
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) {
        int e = 0;
        ssize_t got;
        while ((got = read(status_r.get(), &e, sizeof e)) < 0 && errno == EINTR) {
        }
        if (got == static_cast<ssize_t>(sizeof e)) {
          w.exit.could_not_run = true;
          w.exit.exec_error = std::strerror(e);
        }
      }
      break;
    }
    for (auto* s : {&out_r, &err_r}) fcntl(s->get(), F_SETFL, O_NONBLOCK);
    w.out.fd = std::move(out_r);
    w.err.fd = std::move(err_r);
  }

  // ---- output ----

  void notice(const std::string& text) {
    if (console_ < 0) return;
    std::string line = "[launcher] " + text + "\n";
    if (!write_all(console_, line.data(), line.size())) console_ = -1;
  }

  void emit(Worker& w, std::string_view line, std::string& console, std::string& log) {
    if (console_ >= 0) {
      if (o_.prefix_console) console += fmt::format("[rank {}] ", w.rank);
      console.append(line);
      console += '\n';
    }
    if (w.log) {
      log.append(line);
      log += '\n';
    }
  }

  void flush(Worker& w, const std::string& console, const std::string& log) {
    if (!console.empty() && !write_all(console_, console.data(), console.size())) {
      console_ = -1;  // console closed (EPIPE) or stuck: keep running, the logs still get it
    }
    if (!log.empty() && !write_all(w.log.get(), log.data(), log.size())) {
      int e = errno;
      w.log.reset();
      notice(fmt::format("cannot write {}: {}; no more log for rank {}", log_path(w.rank),
                         std::strerror(e), w.rank));
    }
  }

  // Reads what is available on one stream; emits complete lines. Returns false at EOF.
  bool pump(Worker& w, Stream& s) {
    char buf[65536];
    ssize_t n;
    while ((n = read(s.fd.get(), buf, sizeof buf)) < 0 && errno == EINTR) {
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    std::string console, log;
    if (n <= 0) {  // EOF (or a read error, treated alike): complete the last line
      if (!s.partial.empty()) emit(w, s.partial, console, log);
      s.partial.clear();
      s.fd.reset();
      flush(w, console, log);
      return false;
    }
    s.partial.append(buf, static_cast<size_t>(n));
    size_t begin = 0;
    for (;;) {
      size_t nl = s.partial.find('\n', begin);
      if (nl == std::string::npos) {
        if (s.partial.size() - begin < kMaxLine) break;
        nl = begin + kMaxLine;
        emit(w, std::string_view(s.partial).substr(begin, kMaxLine), console, log);
        begin = nl;
        continue;
      }
      emit(w, std::string_view(s.partial).substr(begin, nl - begin), console, log);
      begin = nl + 1;
    }
    s.partial.erase(0, begin);
    flush(w, console, log);
    return true;
  }

  // ---- process control ----

  // Signals every live worker's process group; marks them as stopped by the launcher.
  void signal_alive(int sig, int except_rank = -1) {
    for (auto& w : workers_) {
      if (!w.alive || w.rank == except_rank) continue;
      kill(-w.pid, sig);
      w.exit.stopped_by_launcher = true;
    }
  }

  int alive_count() const {
    return static_cast<int>(
        std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.alive; }));
  }

  void start_stop(int failed_rank, Clock::time_point now) {
    shutting_down_ = true;
    if (o_.peer_grace.count() > 0) {
      term_at_ = now + o_.peer_grace;
    } else {
      signal_alive(SIGTERM, failed_rank);
      kill_at_ = now + o_.stop_timeout;
    }
  }

  void record_exit(Worker& w, int status, Clock::time_point now) {
    w.alive = false;
    w.exit.wall = std::chrono::duration_cast<milliseconds>(now - w.start);
    if (WIFSIGNALED(status)) {
      w.exit.signaled = true;
      w.exit.signal = WTERMSIG(status);
      w.exit.core_dumped = WCOREDUMP(status);
    } else {
      w.exit.code = WEXITSTATUS(status);
    }
    if (w.exit.ok() || !failure_.empty()) return;
    failed_rank_ = w.rank;
    failure_ = fmt::format("rank {} (pid {}) {}", w.rank, w.pid, w.exit.describe(o_.command[0]));
    exit_code_ = w.exit.signaled ? 128 + w.exit.signal : w.exit.code;
    int others = alive_count();
    if (others == 0) {
      notice(failure_);
      return;
    }
    notice(fmt::format(
        "{}; stopping the other {} worker(s): SIGTERM{}, SIGKILL {} ms later", failure_, others,
        o_.peer_grace.count() > 0 ? fmt::format(" after {} ms", o_.peer_grace.count())
                                  : std::string(),
        o_.stop_timeout.count()));
    start_stop(w.rank, now);
  }

  void reap(Clock::time_point now) {
    for (auto& w : workers_) {
      if (!w.alive) continue;
      int status = 0;
      pid_t r;
      while ((r = waitpid(w.pid, &status, WNOHANG)) < 0 && errno == EINTR) {
      }
      if (r == w.pid) {
        record_exit(w, status, now);
      } else if (r < 0) {
        // ECHILD: someone else reaped it (a foreign waitpid(-1)); the status is lost.
        w.alive = false;
        w.exit.wall = std::chrono::duration_cast<milliseconds>(now - w.start);
        w.exit.code = 255;
        if (failure_.empty()) {
          failed_rank_ = w.rank;
          failure_ = fmt::format("rank {} (pid {}) was reaped by someone else; status unknown",
                                 w.rank, w.pid);
          exit_code_ = 255;
          start_stop(w.rank, now);
        }
      }
    }
  }

  void on_signal(int sig, Clock::time_point now) {
    if (sig != SIGINT && sig != SIGTERM) return;  // SIGCHLD: just a wakeup
    if (!shutting_down_ || term_at_) {
      shutting_down_ = true;
      term_at_.reset();
      if (failure_.empty()) {
        failure_ = fmt::format("the launcher received {} and forwarded it to all workers",
                               signal_name(sig));
        exit_code_ = 128 + sig;
      }
      notice(fmt::format("received {}; forwarding it to all workers (SIGKILL {} ms later)",
                         signal_name(sig), o_.stop_timeout.count()));
      signal_alive(sig);
      kill_at_ = now + o_.stop_timeout;
    } else {
      notice(fmt::format("received {} during shutdown; sending SIGKILL to all workers",
                         signal_name(sig)));
      signal_alive(SIGKILL);
      kill_at_.reset();
    }
  }

  void loop() {
    std::optional<Clock::time_point> drain_until;
    for (;;) {
      auto now = Clock::now();
      if (term_at_ && now >= *term_at_) {
        term_at_.reset();
        signal_alive(SIGTERM);
        kill_at_ = now + o_.stop_timeout;
      }
      if (kill_at_ && now >= *kill_at_) {
        kill_at_.reset();
        std::string ranks;
        for (auto& w : workers_) {
          if (w.alive) ranks += (ranks.empty() ? "" : ", ") + std::to_string(w.rank);
        }
        if (!ranks.empty()) {
          notice(fmt::format("stop timeout ({} ms) passed; sending SIGKILL to rank(s) {}",
                             o_.stop_timeout.count(), ranks));
        }
        signal_alive(SIGKILL);
      }
      if (alive_count() == 0 && !drain_until) {
        term_at_.reset();
        kill_at_.reset();
        // Everyone is reaped; children they left behind in their groups would hold the pipes
        // open (and outlive the job), so they go too.
        for (auto& w : workers_) kill(-w.pid, SIGKILL);
        drain_until = now + kDrain;
      }

      std::vector<pollfd> fds;
      std::vector<std::pair<Worker*, Stream*>> owners;
      fds.push_back({signals_->fd(), POLLIN, 0});
      owners.emplace_back(nullptr, nullptr);
      for (auto& w : workers_) {
        for (Stream* s : {&w.out, &w.err}) {
          if (!s->fd) continue;
          fds.push_back({s->fd.get(), POLLIN, 0});
          owners.emplace_back(&w, s);
        }
      }
      if (drain_until && (fds.size() == 1 || now >= *drain_until)) break;

      auto wait = kTick;
      for (const auto& t : {term_at_, kill_at_, drain_until}) {
        if (t) wait = std::min(wait, std::chrono::ceil<milliseconds>(*t - now));
      }
      int n = poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait.count(), 0)));
      if (n < 0 && errno != EINTR) {
        TESSEL_THROW(IoError, "launcher: poll failed: {}", std::strerror(errno));
      }
      now = Clock::now();
      if (n > 0) {
        for (size_t i = 1; i < fds.size(); ++i) {
          if (fds[i].revents) pump(*owners[i].first, *owners[i].second);
        }
      }
      for (int sig : signals_->take()) on_signal(sig, now);
      reap(now);
    }
  }

  LaunchResult finish() {
    // Output from leftovers that never closed their pipes within the drain window is cut here.
    for (auto& w : workers_) {
      for (Stream* s : {&w.out, &w.err}) {
        if (!s->fd) continue;
        std::string console, log;
        if (!s->partial.empty()) emit(w, s->partial, console, log);
        flush(w, console, log);
        s->fd.reset();
      }
    }
    LaunchResult r;
    r.exit_code = exit_code_;
    r.failure = failure_;
    r.failed_rank = failed_rank_;
    r.job_id = job_id_;
    r.store_dir = store_dir_;
    for (auto& w : workers_) r.workers.push_back(w.exit);
    return r;
  }

  const LaunchOptions& o_;
  int console_;
  std::string job_id_, store_dir_;
  bool owns_store_ = false;
  std::map<std::string, std::string> base_env_;
  Fd devnull_;
  std::vector<Worker> workers_;
  SignalScope* signals_ = nullptr;

  bool shutting_down_ = false;
  std::optional<Clock::time_point> term_at_, kill_at_;
  std::string failure_;
  int failed_rank_ = -1;
  int exit_code_ = 0;
};

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  if (abbrev) return std::string("SIG") + abbrev;
  return fmt::format("signal {}", sig);
}

int default_omp_threads(int nproc) {
  int cores = 0;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cores / std::max(1, nproc));
}

std::string WorkerExit::describe(const std::string& program) const {
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

LaunchResult launch(const LaunchOptions& options) {
  TESSEL_CHECK(options.nproc >= 1, ConfigError, "launcher: nproc must be at least 1, got {}",
               options.nproc);
  TESSEL_CHECK(!options.command.empty() && !options.command[0].empty(), ConfigError,
               "launcher: no worker command given (e.g. `tessel launch -n 2 -- ./worker`)");
  TESSEL_CHECK(options.stop_timeout.count() >= 0 && options.peer_grace.count() >= 0, ConfigError,
               "launcher: stop_timeout ({} ms) and peer_grace ({} ms) must not be negative",
               options.stop_timeout.count(), options.peer_grace.count());
  for (const auto& [k, v] : options.extra_env) {
    TESSEL_CHECK(!k.empty() && k.find('=') == std::string::npos, ConfigError,
                 "launcher: invalid environment variable name '{}'", k);
  }
  std::lock_guard lock(g_launch_mutex);
  Launch l(options);
  return l.run();
}

}  // namespace tessel::runtime
