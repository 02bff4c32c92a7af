#include "tessel/store/remote_pieces.h"

#include <pthread.h>
#include <signal.h>

#include <httplib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>

#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/net/sigpipe_hold.h"
#include "tessel/store/checkpoint_format.h"
#include "tessel/store/checksum.h"
#include "tessel/store/http_endpoint.h"

namespace tessel::store {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// Safetensors' own limit (safetensors.h): a longer header is no rank file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Bytes gathered before each write of a download.
constexpr size_t kWriteBytes = size_t(1) << 20;
// Of an error body kept for the message.
constexpr size_t kMaxErrorBody = 4096;

struct ClientDeleter {
  void operator()(httplib::Client* c) const {
    net::SigpipeHold hold;  // closing a TLS connection writes
    delete c;
  }
};
using ClientPtr = std::unique_ptr<httplib::Client, ClientDeleter>;

void check_base_url(const std::string& url) {
  TESSEL_CHECK((url.starts_with("http://") || url.starts_with("https://")) &&
                   httplib::Client(url).is_valid(),
               ConfigError, "'{}' is not a base URL of a tensor store (http://host:port)", url);
}

void check_rel(const std::string& rel) {
  size_t start = 0;
  for (;;) {
    const size_t slash = rel.find('/', start);
    const std::string part = rel.substr(start, slash == std::string::npos ? slash : slash - start);
    TESSEL_CHECK(detail::valid_path_component(part), ConfigError,
                 "checkpoint path '{}' must be relative, of components of letters, digits, '.', "
                 "'_' and '-' (no empty, '.' or '..' component)",
                 rel);
    if (slash == std::string::npos) return;
    start = slash + 1;
  }
}

ClientPtr make_client(const std::string& base, const RemoteOptions& o) {
  ClientPtr c(new httplib::Client(base));
  c->set_connection_timeout(o.timeout);
  c->set_read_timeout(o.timeout);
  c->set_write_timeout(o.timeout);
  c->set_keep_alive(true);
  // The path is escaped here (escape()); cpp-httplib would escape the '%' again.
  c->set_url_encode(false);
  if (!o.bearer_token.empty()) c->set_bearer_token_auth(o.bearer_token);
  return c;
}

// A tensor name as a URL path: '/' stays (the server's route takes the rest of the path), every
// byte that is not unreserved is %-escaped.
std::string escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || c == '/') {
      out += char(c);
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

std::string box_param(const Box& b) {
  std::string s;
  for (size_t d = 0; d < b.rank(); ++d) s += fmt::format("{}{}:{}", d ? "," : "", b.lo(d), b.hi(d));
  return s;
}

std::string shape_header(const Shape& s) {
  std::string out;
  for (size_t d = 0; d < s.rank(); ++d) out += (d ? "," : "") + std::to_string(s[d]);
  return out;
}

// The server's {"error": ...}, or the body as it came.
std::string error_text(int status, const std::string& body) {
  std::string message = body;
  try {
    const auto j = json::parse(body);
    if (j.is_object() && j.contains("error") && j["error"].is_string())
      message = j["error"].get<std::string>();
  } catch (const json::exception&) {
  }
  while (!message.empty() && (message.back() == '\n' || message.back() == '\r')) message.pop_back();
  return fmt::format("HTTP {}: {}", status, message);
}

class HttpFetcher {
 public:
  HttpFetcher(std::string rel, FileHosts hosts, RemoteOptions options)
      : rel_(std::move(rel)), hosts_(std::move(hosts)), options_(std::move(options)) {
    check_rel(rel_);
    TESSEL_CHECK(options_.timeout.count() > 0, ConfigError,
                 "the timeout of remote piece reads must be positive");
    for (const auto& [file, urls] : hosts_)
      for (const auto& url : urls) check_base_url(url);
  }

  void operator()(const CheckpointTensor& t, const CheckpointPiece& p, const Box& region,
                  void* out) const {
    const uint64_t expected = uint64_t(region.volume()) * dtype_size(t.dtype);
    std::string target = "/v1/checkpoints/" + rel_ + "/tensors/" + escape(t.name) + "?format=raw";
    if (region.rank() > 0) target += "&box=" + box_param(region);
    std::string tried;
    auto it = hosts_.find(p.file);
    if (it != hosts_.end()) {
      for (const auto& base : it->second) {
        auto [client, reused] = take(base);
        Attempt a = try_host(std::move(client), base, target, t, region, out, expected);
        // A kept connection the host closed meanwhile fails without saying anything about the
        // host: once more on a new connection before moving on.
        if (a.lost_connection && reused)
          a = try_host(make_client(base, options_), base, target, t, region, out, expected);
        if (a.problem.empty()) return;
        tried += fmt::format("{}{}: {}", tried.empty() ? "" : "; ", base, a.problem);
      }
    }
    TESSEL_THROW(PeerLostError,
                 "cannot read tensor '{}' box {} (piece {} in {} of checkpoint '{}') from "
                 "another host: {}",
                 t.name, region.str(), p.box.str(), p.file, rel_,
                 tried.empty() ? "no host is known to hold the file" : "tried " + tried);
  }

 private:
  struct Attempt {
    std::string problem;  // empty: `out` holds the region
    bool lost_connection = false;
  };

  Attempt try_host(ClientPtr client, const std::string& base, const std::string& target,
                   const CheckpointTensor& t, const Box& region, void* out,
                   uint64_t expected) const {
    const auto deadline = Clock::now() + options_.timeout;
    const std::string want_dtype(dtype_name(t.dtype)), want_shape = shape_header(region.shape());
    int status = 0;
    uint64_t got = 0;
    std::string error_body, problem;
    auto* dst = static_cast<char*>(out);
    auto res = [&] {
      net::SigpipeHold hold;
      return client->Get(
          target,
          [&](const httplib::Response& r) {
            status = r.status;
            if (status != 200) return true;  // its error body follows
            const auto dtype = r.get_header_value("X-Tessel-Dtype");
            const auto shape = r.get_header_value("X-Tessel-Shape");
            if (dtype != want_dtype || shape != want_shape) {
              problem = fmt::format("sent {} [{}] where {} [{}] was asked for", dtype, shape,
                                    want_dtype, want_shape);
              return false;
            }
            return true;
          },
          [&](const char* data, size_t n) {
            if (status != 200) {
              error_body.append(
                  data, std::min(n, kMaxErrorBody - std::min(kMaxErrorBody, error_body.size())));
            } else if (got + n > expected) {
              problem = fmt::format("sent more than the {} bytes of the region", expected);
              return false;
            } else {
              std::memcpy(dst + got, data, n);
              got += n;
            }
            if (Clock::now() > deadline) {
              problem = fmt::format("did not answer within {} ms", options_.timeout.count());
              return false;
            }
            return true;
          });
    }();
    if (!res && problem.empty()) return {httplib::to_string(res.error()), true};
    if (!res) return {problem};
    if (status != 200) return {error_text(status, error_body)};
    if (got != expected)
      return {fmt::format("sent {} bytes where the region has {}", got, expected)};
    give_back(base, std::move(client));
    return {};
  }

  // A kept client of `base` (second: true) or a new one.
  std::pair<ClientPtr, bool> take(const std::string& base) const {
    {
      std::lock_guard lock(mu_);
      auto& idle = idle_[base];
      if (!idle.empty()) {
        ClientPtr c = std::move(idle.back());
        idle.pop_back();
        return {std::move(c), true};
      }
    }
    return {make_client(base, options_), false};
  }

  // Only clients whose last request succeeded: a failed one may hold a half-read response.
  void give_back(const std::string& base, ClientPtr c) const {
    std::lock_guard lock(mu_);
    idle_[base].push_back(std::move(c));
  }

  const std::string rel_;
  const FileHosts hosts_;
  const RemoteOptions options_;
  mutable std::mutex mu_;
  mutable std::map<std::string, std::vector<ClientPtr>> idle_;
};

// The checks of a rank file download, fed its bytes as they arrive: the header (buffered) against
// the entry's header checksum, then each piece's bytes against its checksum, located through the
// header's data offsets.
class RankFileCheck {
 public:
  RankFileCheck(const json& entry, std::string what) : what_(std::move(what)) {
    const std::string ewhat = what_ + ": entry";
    try {
      total_ = detail::json_u64(detail::json_field(entry, "bytes", ewhat), ewhat);
      header_xxh3_ = detail::json_hash(entry, "header_xxh3", ewhat);
      const auto& pieces = detail::json_field(entry, "pieces", ewhat);
      TESSEL_CHECK(pieces.is_array(), CorruptDataError, "{}: \"pieces\" is not a list", ewhat);
      for (const auto& p : pieces) {
        Piece piece;
        piece.name = detail::json_str(p, "name", ewhat);
        piece.bytes = detail::json_u64(detail::json_field(p, "bytes", ewhat), ewhat);
        piece.xxh3 = detail::json_hash(p, "xxh3", ewhat);
        pieces_.push_back(std::move(piece));
      }
    } catch (const CorruptDataError& e) {
      TESSEL_THROW(InvalidArgumentError, "{}", e.what());
    }
  }

  uint64_t total() const { return total_; }

  // Throws CorruptDataError at the first byte that cannot belong to the file of the entry.
  void feed(const char* data, size_t n) {
    TESSEL_CHECK(pos_ + n <= total_, CorruptDataError,
                 "{} holds more than the {} bytes its entry records", what_, total_);
    while (n > 0) {
      if (!header_done()) {
        const uint64_t want = header_end_ ? header_end_ : 8;
        const size_t k = size_t(std::min<uint64_t>(n, want - pos_));
        header_.append(data, k);
        take(data, n, k);
        if (header_end_ == 0 && pos_ == 8) start_header();
        if (header_end_ != 0 && pos_ == header_end_) end_header();
        continue;
      }
      const auto& r = ranges_[cur_];
      const size_t k = size_t(std::min<uint64_t>(n, r.end - pos_));
      hash_->update(data, k);
      take(data, n, k);
      advance();
    }
  }

  // Throws CorruptDataError unless every byte came and checked out.
  void finish() const {
    TESSEL_CHECK(pos_ == total_ && header_done() && cur_ == ranges_.size(), CorruptDataError,
                 "{} ended after {} of the {} bytes its entry records", what_, pos_, total_);
  }

 private:
  struct Piece {
    std::string name;
    uint64_t bytes = 0, xxh3 = 0;
  };
  struct Range {
    uint64_t begin, end;
    const Piece* piece;
  };

  bool header_done() const { return header_end_ != 0 && pos_ >= header_end_; }

  void take(const char*& data, size_t& n, size_t k) {
    data += k;
    n -= k;
    pos_ += k;
  }

  void start_header() {
    uint64_t len = 0;
    for (int i = 7; i >= 0; --i) len = (len << 8) | uint8_t(header_[size_t(i)]);
    TESSEL_CHECK(len <= kMaxHeaderBytes && 8 + len <= total_, CorruptDataError,
                 "{}: its header length {} does not fit the {} bytes its entry records", what_, len,
                 total_);
    header_end_ = 8 + len;
  }

  void end_header() {
    TESSEL_CHECK(xxh3(header_.data(), header_.size()) == header_xxh3_, CorruptDataError,
                 "{}: its header fails the checksum its entry records; the copy is damaged or "
                 "another file",
                 what_);
    json header;
    try {
      header = json::parse(header_.substr(8));
      for (const auto& p : pieces_) {
        const auto& off = header.at(p.name).at("data_offsets");
        const uint64_t b = off.at(0).get<uint64_t>(), e = off.at(1).get<uint64_t>();
        TESSEL_CHECK(e >= b && e - b == p.bytes, CorruptDataError,
                     "{}: tensor '{}' spans {} bytes in its header but {} in its entry", what_,
                     p.name, e >= b ? e - b : 0, p.bytes);
        ranges_.push_back({header_end_ + b, header_end_ + e, &p});
      }
    } catch (const json::exception& e) {
      TESSEL_THROW(CorruptDataError, "{}: its header does not locate its pieces: {}", what_,
                   e.what());
    }
    header_ = std::string();
    std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t expect = header_end_;
    for (const auto& r : ranges_) {
      TESSEL_CHECK(r.begin == expect, CorruptDataError,
                   "{}: its pieces do not tile its data (tensor '{}' starts at byte {}, not {})",
                   what_, r.piece->name, r.begin, expect);
      expect = r.end;
    }
    TESSEL_CHECK(expect == total_, CorruptDataError,
                 "{}: its pieces end at byte {} but the file has {}", what_, expect, total_);
    hash_ = std::make_unique<Xxh3Stream>();
    advance();
  }

  // Checks every piece that ends here (empty ones included) and starts the next.
  void advance() {
    while (cur_ < ranges_.size() && pos_ == ranges_[cur_].end) {
      const auto& p = *ranges_[cur_].piece;
      TESSEL_CHECK(hash_->digest() == p.xxh3, CorruptDataError,
                   "{}: tensor '{}' fails the checksum its entry records; the copy is damaged",
                   what_, p.name);
      hash_ = std::make_unique<Xxh3Stream>();
      ++cur_;
    }
  }

  std::string what_;
  uint64_t total_ = 0, header_xxh3_ = 0;
  std::vector<Piece> pieces_;
  std::string header_;
  uint64_t header_end_ = 0;  // 8 + header length, once known
  uint64_t pos_ = 0;
  std::vector<Range> ranges_;
  size_t cur_ = 0;
  std::unique_ptr<Xxh3Stream> hash_;
};

}  // namespace

PieceFetcher http_piece_fetcher(std::string rel, FileHosts hosts, RemoteOptions options) {
  auto f =
      std::make_shared<const HttpFetcher>(std::move(rel), std::move(hosts), std::move(options));
  return [f](const CheckpointTensor& t, const CheckpointPiece& p, const Box& region, void* out) {
    (*f)(t, p, region, out);
  };
}

std::string download_rank_file(const std::string& base_url, const std::string& rel,
                               const json& entry, const std::string& dest_dir,
                               const RemoteOptions& options) {
  check_base_url(base_url);
  check_rel(rel);
  TESSEL_CHECK(entry.is_object() && entry.contains("file") && entry["file"].is_string() &&
                   rank_of_file_name(entry["file"].get<std::string>()),
               InvalidArgumentError, "rank file entry names no rank file: {}",
               entry.dump().substr(0, 200));
  const std::string file = entry["file"].get<std::string>();
  const std::string what = fmt::format("the copy of {} from {} ('{}')", file, base_url, rel);
  RankFileCheck check(entry, what);
  const std::string dest = (fs::path(dest_dir) / file).string();
  AtomicFileWriter out(dest);  // removes its temporary file unless committed

  ClientPtr client = make_client(base_url, options);
  int status = 0;
  std::string error_body, buffer;
  std::exception_ptr failure;
  auto res = [&] {
    net::SigpipeHold hold;
    return client->Get(
        "/v1/checkpoints/" + rel + "/files/" + file,
        [&](const httplib::Response& r) {
          status = r.status;
          return true;
        },
        [&](const char* data, size_t n) {
          if (status != 200) {
            error_body.append(
                data, std::min(n, kMaxErrorBody - std::min(kMaxErrorBody, error_body.size())));
            return true;
          }
          try {
            check.feed(data, n);
            buffer.append(data, n);
            if (buffer.size() >= kWriteBytes) {
              out.write(buffer.data(), buffer.size());
              buffer.clear();
            }
            return true;
          } catch (...) {
            failure = std::current_exception();
            return false;
          }
        });
  }();
  if (failure) std::rethrow_exception(failure);
  if (!res)
    TESSEL_THROW(PeerLostError, "cannot copy {} of '{}' from {}: {} (after {} bytes)", file, rel,
                 base_url, httplib::to_string(res.error()), out.size() + buffer.size());
  TESSEL_CHECK(status == 200, IoError, "{} refused to send {} of '{}': {}", base_url, file, rel,
               error_text(status, error_body));
  check.finish();
  out.write(buffer.data(), buffer.size());
  out.commit();
  return dest;
}

}  // namespace tessel::store
