#include "tessel/runtime/metrics.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/core/write_all.h"

namespace tessel::runtime {

namespace {

std::mutex g_incomplete_mu;
std::vector<std::string> g_incomplete;

}  // namespace

std::vector<std::string> incomplete_outputs() {
  std::lock_guard lock(g_incomplete_mu);
  return g_incomplete;
}

void record_incomplete_output(const std::string& what) {
  std::lock_guard lock(g_incomplete_mu);
  g_incomplete.push_back(what);
}

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  if (path.empty()) return;
  auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  TESSEL_CHECK(fd_ >= 0, IoError, "cannot open metrics file '{}' for writing: {}", path,
               std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0 && ::close(fd_) != 0 && !failed_) fail(std::strerror(errno));
}

MetricsWriter::MetricsWriter(MetricsWriter&& o) noexcept
    : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), failed_(o.failed_) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    failed_ = o.failed_;
  }
  return *this;
}

void MetricsWriter::fail(const std::string& why) {
  failed_ = true;
  spdlog::error("cannot write {}: {}; training goes on, but this output is incomplete", path_, why);
  std::lock_guard lock(g_incomplete_mu);
  g_incomplete.push_back(fmt::format("{}: {}", path_, why));
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (fd_ < 0 || failed_) return;
  const std::string line = record.dump() + "\n";
  if (!write_all(fd_, line.data(), line.size())) fail(std::strerror(errno));
}

ProgressLine::ProgressLine(int64_t total_steps, int64_t log_every)
    : total_(total_steps),
      log_every_(std::max<int64_t>(1, log_every)),
      tty_(::isatty(STDOUT_FILENO)) {}

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  auto s = int64_t(seconds + 0.5);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

std::string format_rate(double v) {
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

void ProgressLine::step(int64_t step, double loss, double lr, double tokens_per_s,
                        double seconds_per_step) {
  int64_t done = step + 1;
  std::string line = fmt::format("step {}/{} | loss {:.4f} | lr {:.2e} | {} tok/s | ETA {}", done,
                                 total_, loss, lr, format_rate(tokens_per_s),
                                 format_duration(seconds_per_step * double(total_ - done)));
  if (tty_) {
    std::fputs(("\r\033[K" + line).c_str(), stdout);
    line_open_ = true;
  } else if (done % log_every_ == 0 || done == total_ || done == 1) {
    std::puts(line.c_str());
  }
  std::fflush(stdout);
}

void ProgressLine::message(const std::string& text) {
  if (line_open_) std::fputs("\n", stdout);
  line_open_ = false;
  std::puts(text.c_str());
  std::fflush(stdout);
}

void ProgressLine::finish() {
  if (line_open_) std::fputs("\n", stdout);
  line_open_ = false;
  std::fflush(stdout);
}

}  // namespace tessel::runtime
