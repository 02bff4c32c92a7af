#include "tessel/elastic/coordinator.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <vector>

#include "tessel/comm/etcd_store.h"
#include "tessel/comm/memory_store.h"
#include "tessel/comm/store_server.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/elastic/control_command.h"
#include "tessel/elastic/reconfiguration.h"

namespace tessel::elastic {

namespace fs = std::filesystem;

std::string control_dir() {
  const char* d = std::getenv("TESSEL_CTL_DIR");
  return d != nullptr && *d != '\0' ? d : "/tmp/tessel-ctl";
}

namespace {

sockaddr_un address_of(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  TESSEL_CHECK(path.size() < sizeof(a.sun_path), IoError,
               "control socket path '{}' is too long; set TESSEL_CTL_DIR to a shorter directory",
               path);
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return a;
}

// Reads one line (up to '\n' or EOF, at most max_bytes) within timeout_ms in all: a client
// that sends a byte at a time cannot hold the reader longer than that (the coordinator's reads
// run on the launcher's loop).
std::string read_line(int fd, int timeout_ms, size_t max_bytes) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string line;
  char buf[256];
  while (line.size() < max_bytes) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, int(left.count())) <= 0) break;
    // Peek, then take up to the newline only: nothing after it is consumed.
    const ssize_t seen = ::recv(fd, buf, std::min(sizeof buf, max_bytes - line.size()), MSG_PEEK);
    if (seen <= 0) break;
    const auto* nl = static_cast<const char*>(std::memchr(buf, '\n', size_t(seen)));
    const size_t take = nl != nullptr ? size_t(nl - buf) + 1 : size_t(seen);
    if (::recv(fd, buf, take, 0) != ssize_t(take)) break;
    line.append(buf, nl != nullptr ? take - 1 : take);
    if (nl != nullptr) break;
  }
  return line;
}

// Whether a process listens on the Unix socket at `path` (a refused connection: a leftover).
// Non-blocking: a live job whose backlog is full answers EAGAIN at once instead of making the
// caller wait.
bool listening(const std::string& path) {
  const auto addr = address_of(path);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // cannot tell: keep it, connecting later names the error
  const bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
  const int err = errno;
  ::close(fd);
  return ok || err != ECONNREFUSED;
}

// Removes the sockets of jobs whose launcher was killed (SIGKILL, a crash): nobody listens on them
// any more. Only those older than a minute: a job that has just bound its socket may not listen
// yet, and refuses connections for that instant.
void remove_stale_sockets(const std::string& dir) {
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".sock" || !e.is_socket(ec)) continue;
    const auto written = fs::last_write_time(e.path(), ec);
    if (ec || now - written < std::chrono::minutes(1) || listening(e.path().string())) continue;
    if (fs::remove(e.path(), ec))
      spdlog::info("removed {}, a stale control socket", e.path().string());
  }
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;  // the client went away: nothing to tell it
    off += size_t(n);
  }
}

}  // namespace

Coordinator::Coordinator(config::TrainConfig cfg, std::string job_id, int initial_workers,
                         int64_t start_step)
    : cfg_(std::move(cfg)), job_id_(std::move(job_id)) {
  if (cfg_.control_store == "embedded") {
    auto memory = std::make_shared<comm::MemoryStore>();
    server_ = std::make_unique<comm::StoreServer>(memory);
    endpoint_ = server_->endpoint();
    store_ = std::move(memory);  // this process reads its own store without HTTP
  } else {
    endpoint_ = cfg_.control_store;
    store_ = std::make_shared<comm::EtcdStore>(endpoint_);
    try {
      store_->revision();
    } catch (const Error& e) {
      TESSEL_THROW(PeerLostError,
                   "elastic.control_store: no etcd answers at {}: {} (start etcd there, or use "
                   "control_store: embedded for a job on one host)",
                   endpoint_, e.what());
    }
  }
  decider_ = std::make_unique<Decider>(cfg_, store_, job_id_, initial_workers, start_step);

  const std::string dir = control_dir();
  std::error_code ec;
  // Only this user may reach the job: the directory 0700 (when it is ours), the socket 0600.
  if (fs::create_directories(dir, ec)) ::chmod(dir.c_str(), 0700);
  remove_stale_sockets(dir);
  socket_path_ = (fs::path(dir) / (job_id_ + ".sock")).string();
  const auto addr = address_of(socket_path_);
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  TESSEL_CHECK(listen_fd_ >= 0, IoError, "cannot create a control socket: {}",
               std::strerror(errno));
  ::unlink(socket_path_.c_str());
  if (::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
      ::chmod(socket_path_.c_str(), 0600) != 0 || ::listen(listen_fd_, 8) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    TESSEL_THROW(IoError, "cannot listen on control socket {}: {}", socket_path_,
                 std::strerror(err));
  }
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  TESSEL_CHECK(wake_fd_ >= 0, IoError, "cannot create an eventfd: {}", std::strerror(errno));
  if (!cfg_.hosts_file.empty()) {
    // The directory, not the file: editors and `mv` replace the file.
    hosts_fd_ = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    const auto parent = fs::path(cfg_.hosts_file).parent_path();
    if (hosts_fd_ >= 0 &&
        ::inotify_add_watch(hosts_fd_, parent.empty() ? "." : parent.c_str(),
                            IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_ATTRIB | IN_DELETE) < 0)
      spdlog::warn("cannot watch {} for changes: {}", parent.string(), std::strerror(errno));
  }
  reports_watcher_ = std::thread([this] { watch_reports(); });
}

Coordinator::~Coordinator() {
  stop_ = true;
  if (reports_watcher_.joinable()) reports_watcher_.join();
  for (int fd : {listen_fd_, wake_fd_, hosts_fd_})
    if (fd >= 0) ::close(fd);
  ::unlink(socket_path_.c_str());
  if (!server_) {
    // etcd outlives the job: leave nothing behind (a later job may reuse the id).
    try {
      for (const auto& kv : store_->list(job_prefix(job_id_))) store_->erase(kv.key);
    } catch (const std::exception& e) {
      spdlog::warn("could not remove job {}'s keys from {}: {}", job_id_, endpoint_, e.what());
    }
  }
}

std::vector<int> Coordinator::wake_fds() const {
  std::vector<int> fds = {wake_fd_, listen_fd_};
  if (hosts_fd_ >= 0) fds.push_back(hosts_fd_);
  return fds;
}

void Coordinator::watch_reports() {
  // One long watch on what workers write; each change wakes the launcher's loop.
  const std::string prefix = job_prefix(job_id_) + "reports/";
  int64_t after = 0;
  while (!stop_) {
    try {
      if (after == 0) after = store_->revision();
      auto got = store_->watch(prefix, after, std::chrono::milliseconds(200));
      after = got.revision;
      if (got.events.empty()) continue;
    } catch (const CorruptDataError&) {
      after = 0;  // compacted: start from now, tick() reads the keys themselves
    } catch (const std::exception& e) {
      // The store is unreachable: tick() meets the same error and ends the job with it.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    const uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof one) < 0) {
      // The counter is full: a wakeup is pending anyway.
    }
  }
}

std::string Coordinator::handle(const std::string& line) {
  const auto c = parse_control_command(line);
  switch (c.kind) {
    case ControlCommand::Kind::status:
      return decider_->status();
    case ControlCommand::Kind::stop:
      stop("`tessel ctl stop`");
      return "ok: the workers save a checkpoint at their next step boundary and stop";
    case ControlCommand::Kind::scale:
      return decider_->scale(c.workers);
    case ControlCommand::Kind::refused:
      break;
  }
  return c.refusal;
}

void Coordinator::watch_hosts_file() {
  if (cfg_.hosts_file.empty()) return;
  if (hosts_read_) {
    // Only when the directory changed (the first reading always).
    char buf[4096];
    bool changed = false;
    while (hosts_fd_ >= 0 && ::read(hosts_fd_, buf, sizeof buf) > 0) changed = true;
    if (!changed) return;
  }
  hosts_read_ = true;
  std::error_code ec;
  const auto t = fs::last_write_time(cfg_.hosts_file, ec);
  if (ec) return;  // absent for now (being rewritten): keep the current count
  const int64_t mtime = t.time_since_epoch().count();
  if (mtime == hosts_mtime_) return;
  hosts_mtime_ = mtime;
  std::ifstream in(cfg_.hosts_file, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  const int slots = count_host_slots(text);
  // A new count (the file's first reading included) that differs from the job's asks for it.
  const bool changed = slots != hosts_slots_;
  hosts_slots_ = slots;
  if (!changed || slots == decider_->workers()) return;
  const std::string reply = handle(fmt::format("scale {}", slots));
  spdlog::info("{} lists {} worker slots: {}", cfg_.hosts_file, slots, reply);
}

void Coordinator::stop(const std::string& reason) {
  decider_->stop(reason);
}

void Coordinator::tick(const process::LaunchOptions::Workers& workers) {
  uint64_t wakeups = 0;
  if (::read(wake_fd_, &wakeups, sizeof wakeups) < 0) {
    // EAGAIN: this tick was not woken by a report.
  }
  watch_hosts_file();
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) break;  // EAGAIN: nobody waiting
    // A command is short; a slow or silent client gets 200 ms in all, then an answer to what it
    // sent.
    const std::string line = read_line(fd, 200, 256);
    write_all(fd, handle(line) + "\n");
    ::close(fd);
  }
  const auto starts = decider_->update();
  for (int process : decider_->take_fences())
    if (!workers.kill || !workers.kill(process))
      spdlog::warn("worker {} could not be fenced: it is not running here", process);
  for (const auto& s : starts)
    workers.spawn(s.process, {{"TESSEL_JOIN_GENERATION", std::to_string(s.generation)}});
}

bool Coordinator::on_exit(const process::WorkerExit& e) {
  return decider_->on_exit(e.rank, e.ok(), e.signaled, e.describe(), e.crashed());
}

std::string send_control_command(const std::string& job_id, const std::string& command,
                                 int timeout_ms) {
  const std::string dir = control_dir();
  std::string path;
  if (!job_id.empty()) {
    path = (fs::path(dir) / (job_id + ".sock")).string();
  } else {
    // Only sockets something listens on: a job whose launcher was killed leaves its socket
    // behind, and such leftovers must not make "several jobs" of one.
    std::vector<std::string> found;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().extension() == ".sock" && listening(e.path().string()))
        found.push_back(e.path().string());
    TESSEL_CHECK(!found.empty(), IoError,
                 "no running tessel job has a control socket in {} (is `tessel train` running "
                 "with more than one worker? TESSEL_CTL_DIR must match)",
                 dir);
    std::string list;
    for (const auto& f : found) list += " " + fs::path(f).stem().string();
    TESSEL_CHECK(found.size() == 1, IoError,
                 "several jobs have control sockets in {}:{}; pick one "
                 "with --job",
                 dir, list);
    path = found.front();
  }
  const auto addr = address_of(path);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TESSEL_CHECK(fd >= 0, IoError, "cannot create a socket: {}", std::strerror(errno));
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(fd);
    TESSEL_THROW(IoError, "cannot reach the job at {}: {} (the job is not running?)", path,
                 std::strerror(err));
  }
  write_all(fd, command + "\n");
  std::string reply = read_line(fd, timeout_ms, 4096);
  ::close(fd);
  TESSEL_CHECK(!reply.empty(), TimeoutError, "the job at {} did not answer within {} ms", path,
               timeout_ms);
  return reply;
}

}  // namespace tessel::elastic
