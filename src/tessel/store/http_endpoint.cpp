// The parts of the store's HTTP endpoints both servers share (http_endpoint.h): the streamed box
// response of http_server.h and the guarded server that carries it.
#include "tessel/store/http_endpoint.h"

#include <algorithm>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/store/npy.h"

namespace tessel::store::detail {

namespace {

using nlohmann::json;

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

// The body of a tensor response: the .npy header (if any), then the box's elements in C order,
// produced a slab at a time. A slab is a run of the box's elements that is consecutive in its C
// order and is itself a box: a range along one dimension `k` (the outermost whose inner block
// fits the chunk) with the dimensions before it fixed and those after it whole.
class BoxBody {
 public:
  BoxBody(std::shared_ptr<const CheckpointReader> reader, const CheckpointTensor& t, Box box,
          DType out, std::string header, uint64_t chunk_bytes)
      : reader_(std::move(reader)),
        name_(t.name),
        in_(t.dtype),
        out_(out),
        box_(std::move(box)),
        header_(std::move(header)) {
    const size_t rank = box_.rank();
    const uint64_t element = std::max(dtype_size(in_), dtype_size(out_));
    inner_.assign(rank + 1, 1);
    for (size_t d = rank; d-- > 0;) inner_[d] = inner_[d + 1] * uint64_t(box_.extent(d));
    k_ = rank;  // rank 0: one slab of the one element
    for (size_t d = 0; d < rank; ++d) {
      if (inner_[d + 1] * element <= chunk_bytes) {
        k_ = d;
        break;
      }
    }
    if (k_ < rank) {
      rows_ = std::clamp<uint64_t>(chunk_bytes / (inner_[k_ + 1] * element), 1,
                                   std::max<int64_t>(1, box_.extent(k_)));
    }
  }

  uint64_t size() const { return header_.size() + inner_[0] * dtype_size(out_); }
  bool single_slab() const { return slab_elements(0) == inner_[0]; }

  // Sends the bytes from `offset` on, up to `length` of them and at most to the end of its slab;
  // false when they cannot be read (stored bytes fail their checksum: logged), lie beyond the
  // body, or the client went away.
  bool send(uint64_t offset, uint64_t length, httplib::DataSink& sink) {
    if (offset >= size()) return false;
    if (offset < header_.size()) {
      return sink.write(header_.data() + offset, std::min(length, header_.size() - offset));
    }
    const uint64_t esize = dtype_size(out_);
    const uint64_t element = (offset - header_.size()) / esize;
    const uint64_t first = slab_start(element);
    try {
      fill(first);
    } catch (const Error& e) {
      spdlog::error("store server: {}: {}", name_, e.what());
      return false;
    }
    const uint64_t skip = offset - header_.size() - first * esize;
    return sink.write(out_bytes_->data() + skip, std::min(length, out_bytes_->size() - skip));
  }

  // Reads the slab starting at element `first` (checksums verified); its bytes in out_bytes_.
  void fill(uint64_t first) {
    if (filled_ == first && out_bytes_) return;
    const Box slab = slab_box(first);
    const uint64_t n = uint64_t(slab.volume());
    raw_.resize(n * dtype_size(in_));
    reader_->read_box(name_, slab, raw_.data());
    if (in_ == out_) {
      out_bytes_ = &raw_;
    } else {
      converted_.resize(n * dtype_size(out_));
      convert(raw_.data(), in_, converted_.data(), out_, n);
      out_bytes_ = &converted_;
    }
    filled_ = first;
  }

 private:
  uint64_t block() const { return k_ < box_.rank() ? inner_[k_] : 1; }
  // The first element of the slab holding `element`.
  uint64_t slab_start(uint64_t element) const {
    if (k_ >= box_.rank()) return 0;
    const uint64_t outer = element / block();
    const uint64_t row = (element % block()) / inner_[k_ + 1];
    return outer * block() + (row / rows_) * rows_ * inner_[k_ + 1];
  }
  uint64_t slab_elements(uint64_t first) const { return uint64_t(slab_box(first).volume()); }
  Box slab_box(uint64_t first) const {
    if (k_ >= box_.rank()) return box_;
    std::vector<int64_t> lo = box_.lo(), hi = box_.hi();
    uint64_t outer = first / block();
    for (size_t d = k_; d-- > 0;) {
      const uint64_t extent = uint64_t(box_.extent(d));
      lo[d] = box_.lo(d) + int64_t(outer % extent);
      hi[d] = lo[d] + 1;
      outer /= extent;
    }
    const uint64_t row = (first % block()) / inner_[k_ + 1];
    lo[k_] = box_.lo(k_) + int64_t(row);
    hi[k_] = std::min(box_.hi(k_), lo[k_] + int64_t(rows_));
    return Box(std::move(lo), std::move(hi));
  }

  const std::shared_ptr<const CheckpointReader> reader_;
  const std::string name_;
  const DType in_, out_;
  const Box box_;
  const std::string header_;
  std::vector<uint64_t> inner_;  // inner_[d]: elements in one step of dimension d-1's index
  size_t k_ = 0;
  uint64_t rows_ = 1;  // of dimension k_ per slab
  std::vector<char> raw_, converted_;
  const std::vector<char>* out_bytes_ = nullptr;
  uint64_t filled_ = 0;
};

// The rank files holding bytes of `box` that the reader does not hold.
std::vector<std::string> missing_files_of(const CheckpointReader& reader, const CheckpointTensor& t,
                                          const Box& box) {
  std::vector<std::string> missing;
  if (reader.missing_files().empty()) return missing;
  for (const auto& p : t.pieces)
    if (!reader.holds(p.file) && !box.intersect(p.box).empty() &&
        std::find(missing.begin(), missing.end(), p.file) == missing.end())
      missing.push_back(p.file);
  return missing;
}

}  // namespace

bool valid_path_component(const std::string& c) {
  if (c.empty() || c == "." || c == ".." || c.size() > 255) return false;
  for (char ch : c)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-'))
      return false;
  return true;
}

void send_error(httplib::Response& res, int status, const std::string& message, const json& extra) {
  json body = extra.is_object() ? extra : json::object();
  body["error"] = message;
  res.status = status;
  res.set_content(body.dump() + "\n", "application/json");
}

std::vector<std::string> missing_files_for(const CheckpointReader& reader, const std::string& name,
                                           const httplib::Request& req) {
  const CheckpointTensor* t = path_like(name) ? nullptr : reader.find(name);
  if (!t || reader.missing_files().empty()) return {};
  try {
    const Box box =
        req.has_param("box") ? Box::parse(req.get_param_value("box"), t->shape) : Box::of(t->shape);
    return missing_files_of(reader, *t, box);
  } catch (const Error&) {
    return {};
  }
}

void send_tensor_list(const CheckpointReader& reader, httplib::Response& res) {
  json out = json::array();
  for (const auto& t : reader.tensors())
    out.push_back({{"name", t.name},
                   {"dtype", std::string(dtype_name(t.dtype))},
                   {"shape", t.shape.dims()},
                   {"bytes", t.nbytes()}});
  res.set_content(out.dump() + "\n", "application/json");
}

void send_tensor(std::shared_ptr<const CheckpointReader> reader, const std::string& name,
                 const httplib::Request& req, httplib::Response& res,
                 const StoreServerOptions& options) {
  const CheckpointTensor* t = path_like(name) ? nullptr : reader->find(name);
  if (!t) return send_error(res, 404, "no tensor named '" + name + "' in this checkpoint");
  const std::string format = req.has_param("format") ? req.get_param_value("format") : "raw";
  if (format != "raw" && format != "npy")
    return send_error(res, 400, "unknown format '" + format + "' (use raw or npy)");
  Box box;
  DType out_type = t->dtype;
  try {
    box =
        req.has_param("box") ? Box::parse(req.get_param_value("box"), t->shape) : Box::of(t->shape);
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
  const uint64_t max_bytes = options.max_response_bytes;
  if (bytes > max_bytes || n * dtype_size(t->dtype) > max_bytes)
    return send_error(res, 413,
                      "the box holds " + std::to_string(bytes) +
                          " bytes, more than this server sends at once (" +
                          std::to_string(max_bytes) + "); request smaller boxes");
  // Known before the status goes out, unlike damage found while streaming: the client learns
  // which files to ask another host for.
  if (const auto missing = missing_files_of(*reader, *t, box); !missing.empty()) {
    std::string list;
    for (const auto& f : missing) list += (list.empty() ? "" : ", ") + f;
    return send_error(res, 404,
                      "tensor '" + name + "' box " + box.str() + " lies partly in " + list +
                          ", which this host does not hold",
                      json{{"missing_files", missing}});
  }
  auto body = std::make_shared<BoxBody>(std::move(reader), *t, box, out_type, std::move(header),
                                        options.chunk_bytes);
  // A response of one slab is read before its status goes out, so damage is still a 500.
  if (body->single_slab() && n > 0) body->fill(0);
  res.set_header("X-Tessel-Dtype", std::string(dtype_name(out_type)));
  res.set_header("X-Tessel-Shape", shape_header(box.shape()));
  res.set_content_provider(body->size(),
                           format == "npy" ? "application/x-npy" : "application/octet-stream",
                           [body](size_t offset, size_t length, httplib::DataSink& sink) {
                             return body->send(offset, length, sink);
                           });
}

std::unique_ptr<net::GuardedServer> make_store_server(const StoreServerOptions& options) {
  TESSEL_CHECK(options.port >= 0 && options.port <= 65535, InvalidArgumentError,
               "port {} is outside 0..65535", options.port);
  TESSEL_CHECK(options.chunk_bytes > 0, ConfigError, "the tensor store's chunk_bytes must be > 0");
  net::ServerOptions so;
  so.name = "the tensor store";
  so.host = options.host;
  so.port = options.port;
  so.token_file = options.token_file;
  so.token_hint = "a token file (tessel store serve --token-file FILE)";
  so.limits = options.limits;
  so.limits.max_body_bytes = 0;  // GET only
  auto server = std::make_unique<net::GuardedServer>(std::move(so));
  server->set_exception_handler(
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
  return server;
}

}  // namespace tessel::store::detail
