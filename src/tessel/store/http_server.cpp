#include "tessel/store/http_server.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/store/npy.h"

namespace tessel::store {

namespace {

using nlohmann::json;

void send_error(httplib::Response& res, int status, const std::string& message) {
  res.status = status;
  res.set_content(json{{"error", message}}.dump() + "\n", "application/json");
}

// Names are only ever index keys, but refuse anything path-like before the lookup so no future
// change can turn a request into a file access.
bool path_like(const std::string& name) {
  return name.empty() || name.front() == '/' || name.find("..") != std::string::npos ||
         name.find('\\') != std::string::npos || name.find('\0') != std::string::npos;
}

std::string shape_header(const Shape& s) {
  std::string out;
  for (size_t d = 0; d < s.rank(); ++d) out += (d ? "," : "") + std::to_string(s[d]);
  return out;
}

}  // namespace

struct StoreServer::Impl {
  CheckpointReader reader;
  std::string host;
  int port;
  uint64_t max_bytes = uint64_t(1) << 30;
  httplib::Server server;
  std::thread thread;
  std::atomic<bool> listening_done{false};
  bool started = false;

  Impl(const std::string& dir, std::string h, int p) : reader(dir), host(std::move(h)), port(p) {}

  void list(httplib::Response& res) const {
    json out = json::array();
    for (const auto& t : reader.tensors())
      out.push_back({{"name", t.name},
                     {"dtype", std::string(dtype_name(t.dtype))},
                     {"shape", t.shape.dims()},
                     {"bytes", t.nbytes()}});
    res.set_content(out.dump() + "\n", "application/json");
  }

  void get(const httplib::Request& req, httplib::Response& res) const {
    const std::string name = req.matches[1];
    const CheckpointTensor* t = path_like(name) ? nullptr : reader.find(name);
    if (!t) return send_error(res, 404, "no tensor named '" + name + "' in this checkpoint");
    const std::string format = req.has_param("format") ? req.get_param_value("format") : "raw";
    if (format != "raw" && format != "npy")
      return send_error(res, 400, "unknown format '" + format + "' (use raw or npy)");
    Box box;
    DType out_type = t->dtype;
    try {
      box = req.has_param("box") ? Box::parse(req.get_param_value("box"), t->shape)
                                 : Box::of(t->shape);
      if (req.has_param("dtype")) out_type = parse_dtype(req.get_param_value("dtype"));
    } catch (const Error& e) {
      return send_error(res, 400, e.what());
    }
    std::string header;
    if (format == "npy") {
      try {
        header = npy_header(out_type, box.shape());
      } catch (const UnsupportedError& e) {
        return send_error(res, 400, std::string(e.what()) + " (add &dtype=f32)");
      }
    }
    const uint64_t n = uint64_t(box.volume());
    const uint64_t bytes = n * dtype_size(out_type);
    if (bytes > max_bytes || n * dtype_size(t->dtype) > max_bytes)
      return send_error(res, 413,
                        "the box holds " + std::to_string(bytes) +
                            " bytes, more than this server sends at once (" +
                            std::to_string(max_bytes) + "); request smaller boxes");
    std::string body(header.size() + bytes, '\0');
    char* data = body.data() + header.size();
    std::copy(header.begin(), header.end(), body.begin());
    if (out_type == t->dtype) {
      reader.read_box(name, box, data);
    } else {
      std::unique_ptr<char[]> raw(new char[std::max<uint64_t>(n * dtype_size(t->dtype), 1)]);
      reader.read_box(name, box, raw.get());
      convert(raw.get(), t->dtype, data, out_type, n);
    }
    res.set_header("X-Tessel-Dtype", std::string(dtype_name(out_type)));
    res.set_header("X-Tessel-Shape", shape_header(box.shape()));
    // A content provider hands the buffer to httplib without copying it (set_content copies).
    auto buf = std::make_shared<std::string>(std::move(body));
    res.set_content_provider(
        buf->size(), format == "npy" ? "application/x-npy" : "application/octet-stream",
        [buf](size_t offset, size_t length, httplib::DataSink& sink) {
          return sink.write(buf->data() + offset, std::min<size_t>(length, size_t(1) << 20));
        });
  }
};

StoreServer::StoreServer(const std::string& dir, std::string host, int port)
    : impl_(std::make_unique<Impl>(dir, std::move(host), port)) {
  TESSEL_CHECK(port >= 0 && port <= 65535, InvalidArgumentError, "port {} is outside 0..65535",
               port);
  auto& s = impl_->server;
  // Every blocking wait of the server is bounded: a slow or silent client costs at most these.
  s.set_read_timeout(5, 0);
  s.set_write_timeout(5, 0);
  s.set_keep_alive_timeout(1);
  s.set_payload_max_length(1 << 16);  // requests carry no body
  // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port and
  // take a share of the connections; a port in use must be an error instead.
  s.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  Impl* impl = impl_.get();
  s.Get("/v1/tensors",
        [impl](const httplib::Request&, httplib::Response& res) { impl->list(res); });
  s.Get("/v1/tensors/(.+)",
        [impl](const httplib::Request& req, httplib::Response& res) { impl->get(req, res); });
  s.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string message = "internal error";
        int status = 500;
        try {
          std::rethrow_exception(ep);
        } catch (const InvalidArgumentError& e) {
          status = 400;
          message = e.what();
        } catch (const std::exception& e) {
          message = e.what();
        } catch (...) {
        }
        if (status == 500) spdlog::error("store server: {} {}: {}", req.method, req.path, message);
        send_error(res, status, message);
      });
}

StoreServer::~StoreServer() {
  stop();
}

int StoreServer::start() {
  TESSEL_CHECK(!impl_->started, InvalidArgumentError, "StoreServer started twice");
  auto& s = impl_->server;
  if (impl_->port == 0) {
    int p = s.bind_to_any_port(impl_->host);
    TESSEL_CHECK(p > 0, IoError, "cannot bind {} on any port", impl_->host);
    impl_->port = p;
  } else {
    TESSEL_CHECK(s.bind_to_port(impl_->host, impl_->port), IoError,
                 "cannot bind {}:{} (in use, or not an address of this machine?)", impl_->host,
                 impl_->port);
  }
  impl_->started = true;
  impl_->listening_done = false;
  impl_->thread = std::thread([impl = impl_.get()] {
    impl->server.listen_after_bind();
    impl->listening_done = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!s.is_running()) {
    if (impl_->listening_done) {
      stop();
      TESSEL_THROW(IoError, "the store server on {}:{} stopped as it started", impl_->host,
                   impl_->port);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      stop();
      TESSEL_THROW(TimeoutError, "the store server on {}:{} did not start within 5 s", impl_->host,
                   impl_->port);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return impl_->port;
}

void StoreServer::stop() {
  if (!impl_ || !impl_->started) return;
  // httplib's stop() does nothing before the listen loop has started (and must be called once):
  // call it as soon as the loop runs, then wait for the loop to end, within a bound.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool stop_sent = false;
  while (!impl_->listening_done && std::chrono::steady_clock::now() < deadline) {
    if (!stop_sent && impl_->server.is_running()) {
      impl_->server.stop();
      stop_sent = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (impl_->listening_done) {
    impl_->thread.join();
  } else {
    spdlog::error("store server on {}:{} did not stop within 10 s; leaving its thread", impl_->host,
                  impl_->port);
    impl_->thread.detach();
  }
  impl_->started = false;
}

int StoreServer::port() const {
  return impl_->port;
}
const std::string& StoreServer::host() const {
  return impl_->host;
}
const CheckpointReader& StoreServer::reader() const {
  return impl_->reader;
}
void StoreServer::set_max_response_bytes(uint64_t n) {
  impl_->max_bytes = n;
}

}  // namespace tessel::store
