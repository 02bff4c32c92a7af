#include "tessel/store/checkpoint_root_server.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <variant>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/net/guarded_server.h"
#include "tessel/store/http_endpoint.h"

namespace tessel::store {

namespace fs = std::filesystem;
using detail::send_error;
using nlohmann::json;

namespace {

std::vector<std::string> split(const std::string& path) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t slash = path.find('/', start);
    out.push_back(
        path.substr(start, slash == std::string::npos ? std::string::npos : slash - start));
    if (slash == std::string::npos) return out;
    start = slash + 1;
  }
}

std::string join(const std::vector<std::string>& parts, size_t from, size_t to) {
  std::string out;
  for (size_t i = from; i < to; ++i) out += (i > from ? "/" : "") + parts[i];
  return out;
}

// What a request under /v1/checkpoints/ asks for.
struct Target {
  enum class Kind { list, tensor, file } kind;
  std::string rel;   // checkpoint (or staging) directory under the root
  std::string name;  // tensor or rank file
};

// A request's answer when it cannot be served: status and message.
struct Refusal {
  int status;
  std::string message;
};

// Where a directory and its manifest stood when a reader opened them. A save published over the
// directory renames a new directory into place: another inode, and another manifest.json. (The
// directory's own times are left out: they change with every temporary file created in it, e.g.
// while a copy of a rank file is written there.)
struct Identity {
  dev_t dir_dev = 0, manifest_dev = 0;
  ino_t dir_ino = 0, manifest_ino = 0;
  off_t manifest_size = 0;
  int64_t manifest_mtime = 0, manifest_ctime = 0;
  bool operator==(const Identity&) const = default;
};

int64_t nanoseconds(const timespec& t) {
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// Nothing when the directory or its manifest is absent (not a checkpoint now).
std::optional<Identity> identity_of(const fs::path& dir) {
  struct stat d, m;
  if (::stat(dir.c_str(), &d) != 0 || !S_ISDIR(d.st_mode)) return std::nullopt;
  if (::stat((dir / "manifest.json").c_str(), &m) != 0) return std::nullopt;
  Identity id;
  id.dir_dev = d.st_dev;
  id.dir_ino = d.st_ino;
  id.manifest_dev = m.st_dev;
  id.manifest_ino = m.st_ino;
  id.manifest_size = m.st_size;
  id.manifest_mtime = nanoseconds(m.st_mtim);
  id.manifest_ctime = nanoseconds(m.st_ctim);
  return id;
}

// A rank file streamed from one open descriptor: a save published meanwhile replaces the
// directory, not the bytes this response sends.
class FileBody {
 public:
  FileBody(int fd, uint64_t size, uint64_t chunk) : fd_(fd), size_(size), chunk_(chunk) {}
  ~FileBody() { ::close(fd_); }
  FileBody(const FileBody&) = delete;
  FileBody& operator=(const FileBody&) = delete;

  bool send(uint64_t offset, uint64_t length, httplib::DataSink& sink) {
    if (offset >= size_) return false;
    const uint64_t n = std::min({length, chunk_, size_ - offset});
    buffer_.resize(n);
    uint64_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(fd_, buffer_.data() + got, n - got, off_t(offset + got));
      if (r < 0 && errno == EINTR) continue;
      // The file shrank or cannot be read: end the response before its length, which the
      // client reports as an error.
      if (r <= 0) return false;
      got += uint64_t(r);
    }
    return sink.write(buffer_.data(), n);
  }

 private:
  const int fd_;
  const uint64_t size_, chunk_;
  std::vector<char> buffer_;
};

}  // namespace

struct CheckpointRootServer::Impl {
  fs::path root;       // canonical
  std::string prefix;  // root + "/": every served path starts with it
  CheckpointRootServerOptions options;

  struct Cached {
    std::shared_ptr<const CheckpointReader> reader;
    Identity id;
    uint64_t used = 0;
  };
  std::mutex mu;
  std::map<std::string, Cached> cache;  // by rel
  uint64_t tick = 0;
  std::atomic<size_t> opened{0};
  // Last: destroyed first, so no handler runs on the members above once they are gone.
  std::unique_ptr<net::GuardedServer> server;

  // Splits the path after /v1/checkpoints/ into a target, or says why it cannot be served.
  std::variant<Target, Refusal> parse(const std::string& path) const {
    const auto parts = split(path);
    std::vector<Target> candidates;
    for (size_t i = 1; i < parts.size(); ++i) {
      if (parts[i] == "tensors") {
        const bool list = i + 1 == parts.size();
        candidates.push_back({list ? Target::Kind::list : Target::Kind::tensor, join(parts, 0, i),
                              join(parts, i + 1, parts.size())});
      } else if (parts[i] == "files" && i + 2 == parts.size()) {
        candidates.push_back({Target::Kind::file, join(parts, 0, i), parts[i + 1]});
      }
    }
    if (candidates.empty())
      return Refusal{400,
                     "expected /v1/checkpoints/<dir>/tensors[/<name>] or "
                     "/v1/checkpoints/<dir>/files/<rank file>"};
    // A component that is not allowed ends every candidate that includes it.
    size_t first_bad = parts.size();
    for (size_t i = 0; i < parts.size() && first_bad == parts.size(); ++i)
      if (!detail::valid_path_component(parts[i])) first_bad = i;
    std::optional<Target> first_valid;
    for (const auto& c : candidates) {
      const size_t rel_parts = size_t(std::count(c.rel.begin(), c.rel.end(), '/')) + 1;
      if (rel_parts > first_bad) break;
      if (!first_valid) first_valid = c;
      std::error_code ec;
      if (fs::is_directory(root / c.rel, ec)) return checked(c);
    }
    if (!first_valid)
      return Refusal{400, "'" + parts[first_bad] +
                              "' cannot be part of a checkpoint path: components are letters, "
                              "digits, '.', '_' and '-', not empty, '.' or '..'"};
    return Refusal{404, "no directory '" + first_valid->rel + "' under this checkpoint root"};
  }

  // Symbolic links inside the root may point anywhere; what is served must lie inside it.
  std::variant<Target, Refusal> checked(const Target& t) const {
    std::error_code ec;
    const auto real = fs::canonical(root / t.rel, ec);
    if (ec || !real.string().starts_with(prefix))
      return Refusal{400, "'" + t.rel + "' lies outside this checkpoint root"};
    return t;
  }

  // The partial reader of ROOT/rel as it is now; null when it is no checkpoint. `stale`: a cached
  // reader must not be returned.
  std::shared_ptr<const CheckpointReader> reader(const std::string& rel, bool stale = false) {
    const fs::path dir = root / rel;
    // Taken before the reader opens: a save published in between then makes the next request
    // reopen, whereas an identity taken after could pair the old reader with the new directory.
    const auto id = identity_of(dir);
    if (!id) return nullptr;
    if (!stale) {
      std::lock_guard lock(mu);
      auto it = cache.find(rel);
      if (it != cache.end() && it->second.id == *id) {
        it->second.used = ++tick;
        return it->second.reader;
      }
    }
    CheckpointReaderOptions ro;
    ro.allow_missing_files = true;
    auto opened_reader = std::make_shared<const CheckpointReader>(dir.string(), ro);
    opened.fetch_add(1);
    std::lock_guard lock(mu);
    cache[rel] = {opened_reader, *id, ++tick};
    while (cache.size() > options.max_open_checkpoints) {
      auto oldest = cache.begin();
      for (auto it = cache.begin(); it != cache.end(); ++it)
        if (it->second.used < oldest->second.used) oldest = it;
      cache.erase(oldest);
    }
    return opened_reader;
  }

  void get(const httplib::Request& req, httplib::Response& res) {
    auto parsed = parse(req.matches[1]);
    if (auto* r = std::get_if<Refusal>(&parsed)) return send_error(res, r->status, r->message);
    const auto& t = std::get<Target>(parsed);
    if (t.kind == Target::Kind::file) return send_file(t, res);
    auto r = reader(t.rel);
    if (!r)
      return send_error(res, 404, "'" + t.rel + "' is not a checkpoint (it has no manifest.json)");
    if (t.kind == Target::Kind::list) return detail::send_tensor_list(*r, res);
    // A file the box needs may have been copied here since the reader opened (the checkpoint is
    // the same, so its identity is): looked for only when a request needs it, so a host missing
    // most files pays nothing for them.
    const auto missing = detail::missing_files_for(*r, t.name, req);
    std::error_code ec;
    if (std::any_of(missing.begin(), missing.end(),
                    [&](const std::string& f) { return fs::exists(root / t.rel / f, ec); }))
      r = reader(t.rel, /*stale=*/true);
    if (!r)
      return send_error(res, 404, "'" + t.rel + "' is not a checkpoint (it has no manifest.json)");
    detail::send_tensor(std::move(r), t.name, req, res, options.server);
  }

  void send_file(const Target& t, httplib::Response& res) const {
    if (!rank_of_file_name(t.name))
      return send_error(res, 400,
                        "'" + t.name + "' is not a rank file name (" + rank_file_name(0) + ")");
    const fs::path path = root / t.rel / t.name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
      const int err = errno;
      if (err == ENOENT)
        return send_error(res, 404, "'" + t.rel + "' holds no " + t.name + " on this host",
                          json{{"missing_files", {t.name}}});
      return send_error(res, err == ELOOP ? 400 : 500,
                        "cannot open " + t.name + " in '" + t.rel + "': " + std::strerror(err));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return send_error(res, 400, t.name + " in '" + t.rel + "' is not a regular file");
    }
    auto body = std::make_shared<FileBody>(fd, uint64_t(st.st_size), options.server.chunk_bytes);
    res.set_content_provider(size_t(st.st_size), "application/octet-stream",
                             [body](size_t offset, size_t length, httplib::DataSink& sink) {
                               return body->send(offset, length, sink);
                             });
  }
};

CheckpointRootServer::CheckpointRootServer(const std::string& root,
                                           CheckpointRootServerOptions options)
    : impl_(std::make_unique<Impl>()) {
  std::error_code ec;
  TESSEL_CHECK(fs::is_directory(root, ec), IoError, "checkpoint root '{}' is not a directory",
               root);
  TESSEL_CHECK(options.max_open_checkpoints > 0, ConfigError,
               "the checkpoint root server must keep at least one checkpoint open");
  impl_->root = fs::canonical(root);
  impl_->prefix = (impl_->root / "").string();
  impl_->options = std::move(options);
  impl_->server = detail::make_store_server(impl_->options.server);
  Impl* impl = impl_.get();
  impl_->server->Get(
      "/v1/checkpoints/(.*)",
      [impl](const httplib::Request& req, httplib::Response& res) { impl->get(req, res); });
}

CheckpointRootServer::~CheckpointRootServer() {
  stop();
}

int CheckpointRootServer::start() {
  return impl_->server->start();
}

void CheckpointRootServer::stop() {
  if (impl_ && impl_->server) impl_->server->stop();
}

int CheckpointRootServer::port() const {
  return impl_->server->port();
}
const std::string& CheckpointRootServer::host() const {
  return impl_->server->host();
}
bool CheckpointRootServer::requires_token() const {
  return impl_->server->requires_token();
}
size_t CheckpointRootServer::readers_opened() const {
  return impl_->opened.load();
}

}  // namespace tessel::store
