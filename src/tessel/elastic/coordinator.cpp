#include "tessel/elastic/coordinator.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/elastic/recovery.h"
#include "tessel/elastic/switch_marker.h"

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

// Reads one line (up to '\n' or EOF) within timeout_ms.
std::string read_line(int fd, int timeout_ms) {
  std::string line;
  char c = 0;
  while (line.size() < 4096) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) break;
    const ssize_t n = ::read(fd, &c, 1);
    if (n <= 0 || c == '\n') break;
    line += c;
  }
  return line;
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

Coordinator::Coordinator(config::TrainConfig cfg, std::string job_id, int initial_workers)
    : cfg_(std::move(cfg)),
      job_id_(std::move(job_id)),
      workers_(initial_workers),
      next_process_id_(initial_workers) {
  for (int p = 0; p < initial_workers; ++p) running_.insert(p);
  const std::string dir = control_dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  socket_path_ = (fs::path(dir) / (job_id_ + ".sock")).string();
  const auto addr = address_of(socket_path_);
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  TESSEL_CHECK(listen_fd_ >= 0, IoError, "cannot create a control socket: {}",
               std::strerror(errno));
  ::unlink(socket_path_.c_str());
  if (::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, 8) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    TESSEL_THROW(IoError, "cannot listen on control socket {}: {}", socket_path_,
                 std::strerror(err));
  }
}

Coordinator::~Coordinator() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  ::unlink(socket_path_.c_str());
}

std::string Coordinator::handle(const std::string& line, const std::string& store_dir) {
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  if (cmd == "status") {
    return fmt::format("ok: job {}, {} workers, {} scale requests, {} switches, {} failures",
                       job_id_, workers_, requests_, next_generation_ - 1, failures_);
  }
  if (cmd != "scale")
    return fmt::format("refused: unknown command '{}'; try: scale N, status", cmd);
  int n = 0;
  if (!(in >> n) || n < 1) return "refused: scale needs a worker count >= 1 (scale N)";
  layout::Plan plan;
  try {
    plan = cfg_.plan_for_workers(n);
  } catch (const Error& e) {
    return fmt::format("refused: {}", e.what());
  }
  const int64_t r = ++requests_;
  const nlohmann::json req = {{"request", r}, {"workers", n}, {"plan", layout::to_json(plan)}};
  write_json_file(scale_request_path(store_dir, job_id_, r), req);
  const std::string when =
      cfg_.prepare_steps > 0
          ? fmt::format("prepared from the next step boundary on, switched {} steps later",
                        cfg_.prepare_steps)
          : std::string("at the next step boundary");
  spdlog::info("scale request {}: {} workers ({}) {}", r, n, plan.describe(), when);
  return fmt::format("ok: request {}: {} workers ({}) {}", r, n, plan.describe(), when);
}

void Coordinator::start_joiners(const process::LaunchOptions::Spawn& spawn,
                                const std::string& store_dir) {
  if (pending_) return;  // a failure is being recovered from: its decision says who starts
  auto start = [&](const SwitchMarker& m) {
    for (int p : m.spawn) {
      spawn(p, {{"TESSEL_JOIN_GENERATION", std::to_string(next_generation_)}});
      running_.insert(p);
    }
  };
  for (;;) {
    const auto path = switch_marker_path(store_dir, job_id_, next_generation_);
    if (!fs::exists(path)) {
      // Announced ahead: its processes start now and prepare while the job trains.
      const auto early = prepare_marker_path(store_dir, job_id_, next_generation_);
      if (prepared_generation_ == next_generation_ || !fs::exists(early)) return;
      const auto m = SwitchMarker::from_json(read_json_file(early), early);
      start(m);
      preparing_.insert(m.spawn.begin(), m.spawn.end());
      prepared_generation_ = next_generation_;
      next_process_id_ = std::max(next_process_id_, m.next_process_id);
      return;
    }
    const auto m = SwitchMarker::from_json(read_json_file(path), path);
    if (prepared_generation_ != next_generation_) start(m);  // else started from its announcement
    preparing_.clear();
    next_process_id_ = std::max(next_process_id_, m.next_process_id);
    workers_ = m.to.world();
    ++next_generation_;
  }
}

bool Coordinator::on_exit(const process::WorkerExit& e) {
  const int process = e.rank;
  running_.erase(process);
  preparing_.erase(process);
  if (e.ok()) {
    if (pending_) {
      pending_->expected.erase(process);
      pending_->someone_finished = true;
    }
    return true;
  }
  // Only a death by a signal is a lost worker; an error exit ends the job with its message.
  if (!e.signaled) return false;
  const std::string cause = fmt::format("worker {} {}", process, e.describe());
  if (pending_)
    pending_->cause += "; " + cause;
  else
    start_recovery(cause);
  pending_->dead.insert(process);
  pending_->expected = state_holders();
  return true;
}

std::set<int> Coordinator::state_holders() const {
  std::set<int> out;
  for (int p : running_)
    if (!preparing_.contains(p)) out.insert(p);
  return out;
}

void Coordinator::start_recovery(const std::string& cause) {
  ++failures_;
  pending_.emplace();
  pending_->cause = cause;
  pending_->detected = std::chrono::steady_clock::now();
  pending_->deadline = pending_->detected + recovery_deadline(cfg_.comm_timeout_s);
  pending_->expected = state_holders();
  spdlog::warn("{}: recovering (failure {})", cause, failures_);
}

void Coordinator::notice_reported_failures(const std::string& store_dir) {
  if (pending_) return;
  // Workers that met a failure nobody died of (a collective timed out, a connection reset) report
  // it as the next failure; recover from it the same way, with every process surviving.
  for (int process : running_) {
    const auto path = failure_report_path(store_dir, job_id_, failures_ + 1, process);
    if (!fs::exists(path)) continue;
    const auto r = FailureReport::from_json(read_json_file(path), path);
    start_recovery(fmt::format("process {} met: {}", process, r.error));
    return;
  }
}

void Coordinator::recover(const std::string& store_dir) {
  auto& p = *pending_;
  std::vector<FailureReport> reports;
  std::vector<int> missing;
  for (int process : p.expected) {
    const auto path = failure_report_path(store_dir, job_id_, failures_, process);
    if (!fs::exists(path)) {
      missing.push_back(process);
      continue;
    }
    reports.push_back(FailureReport::from_json(read_json_file(path), path));
  }
  if (!missing.empty()) {
    std::string list;
    for (int m : missing) list += fmt::format("{}{}", list.empty() ? "" : ", ", m);
    TESSEL_CHECK(std::chrono::steady_clock::now() < p.deadline, TimeoutError,
                 "{}: workers {} did not report within {} s of it; stopping the job", p.cause, list,
                 int64_t(cfg_.comm_timeout_s * 2) + 30);
    return;
  }
  if (reports.empty() && p.someone_finished) {
    spdlog::info("{}: every other worker had finished the run; nothing to recover", p.cause);
    pending_.reset();
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  RecoveryInput in;
  in.reports = std::move(reports);
  in.dead.assign(p.dead.begin(), p.dead.end());
  in.cause = p.cause;
  in.failures = failures_;
  // Above every generation used so far, including switch markers not yet read...
  int g = next_generation_;
  while (fs::exists(switch_marker_path(store_dir, job_id_, g)) ||
         fs::exists(prepare_marker_path(store_dir, job_id_, g)))
    ++g;
  for (const auto& r : in.reports) g = std::max(g, r.generation + 1);
  // ...and above the one after them: a switch every rank agrees on is begun without waiting for
  // its marker, so processes (dead ones too, which report nothing) may have registered in that
  // generation's store prefix already. None can be further on: finishing that switch needs the old
  // rank 0, which writes the marker first.
  ++g;
  in.generation = g;
  in.next_process_id = next_process_id_;
  in.replace_failed = cfg_.replace_failed;
  if (!cfg_.checkpoint.dir.empty())
    in.checkpoint = checkpoint::latest_sharded_checkpoint(cfg_.checkpoint.dir);
  auto m = decide_recovery(cfg_, in);
  const auto now = std::chrono::steady_clock::now();
  m.record["detection_s"] = std::chrono::duration<double>(t0 - p.detected).count();
  m.record["planning_s_coordinator"] = std::chrono::duration<double>(now - t0).count();
  write_json_file(switch_marker_path(store_dir, job_id_, g), m.to_json());
  write_json_file(recovery_path(store_dir, job_id_, failures_), m.to_json());
  spdlog::warn(
      "failure {}: continuing at step {} with {} workers ({}) {}{}", failures_, m.step,
      m.to.world(), m.to.describe(),
      m.checkpoint.empty() ? "from the survivors' state" : "from checkpoint " + m.checkpoint,
      m.record.contains("lost") ? " (lost: " + m.record["lost"].get<std::string>() + ")"
                                : std::string());
  pending_.reset();
  // Markers before g were written before the failure and are void now: their switches failed.
  // Processes started for one of them leave (they see this decision).
  next_generation_ = g;
  preparing_.clear();
}

void Coordinator::watch_hosts_file(const std::string& store_dir) {
  if (cfg_.hosts_file.empty()) return;
  std::error_code ec;
  const auto t = fs::last_write_time(cfg_.hosts_file, ec);
  if (ec) return;  // absent for now (being rewritten): keep the current count
  const int64_t mtime = t.time_since_epoch().count();
  if (mtime == hosts_mtime_) return;
  hosts_mtime_ = mtime;
  std::ifstream in(cfg_.hosts_file);
  int slots = 0;
  for (std::string line; std::getline(in, line);) {
    const auto first = line.find_first_not_of(" \t\r");
    if (first != std::string::npos && line[first] != '#') ++slots;
  }
  // A new count (the file's first reading included) that differs from the job's asks for it.
  const bool changed = slots != hosts_slots_;
  hosts_slots_ = slots;
  if (!changed || slots == workers_) return;
  const std::string reply = handle(fmt::format("scale {}", slots), store_dir);
  spdlog::info("{} lists {} worker slots: {}", cfg_.hosts_file, slots, reply);
}

void Coordinator::tick(const process::LaunchOptions::Spawn& spawn,
                       const process::LaunchResult& job) {
  watch_hosts_file(job.store_dir);
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) break;  // EAGAIN: nobody waiting
    const std::string line = read_line(fd, 1000);
    write_all(fd, handle(line, job.store_dir) + "\n");
    ::close(fd);
  }
  notice_reported_failures(job.store_dir);
  if (pending_) recover(job.store_dir);
  start_joiners(spawn, job.store_dir);
}

std::string send_control_command(const std::string& job_id, const std::string& command,
                                 int timeout_ms) {
  const std::string dir = control_dir();
  std::string path;
  if (!job_id.empty()) {
    path = (fs::path(dir) / (job_id + ".sock")).string();
  } else {
    std::vector<std::string> found;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().extension() == ".sock") found.push_back(e.path().string());
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
  std::string reply = read_line(fd, timeout_ms);
  ::close(fd);
  TESSEL_CHECK(!reply.empty(), TimeoutError, "the job at {} did not answer within {} ms", path,
               timeout_ms);
  return reply;
}

}  // namespace tessel::elastic
