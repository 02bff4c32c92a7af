#include "tessel/cli/store_command.h"

#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <thread>

#include "tessel/cli/output_guard.h"
#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/core/stop_signal.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/http_server.h"
#include "tessel/store/npy.h"

namespace tessel::cli {

namespace {

struct StoreArgs {
  std::string dir;
  std::string name;
  std::string box;
  std::string out;
  std::string format = "raw";
  std::string dtype;
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token_file;
  double request_timeout = 10;
  int max_connections = 64;
  int max_connections_per_client = 8;
  bool force = false;
};

std::string human_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.1f} {}", v, units[u]);
}

int store_ls(const StoreArgs& a) {
  store::CheckpointReader r(a.dir);
  size_t width = 4;
  for (const auto& t : r.tensors()) width = std::max(width, t.name.size());
  fmt::print("{:<{}}  {:<5} {:<20} {:>6} {:>12}\n", "NAME", width, "DTYPE", "SHAPE", "PIECES",
             "BYTES");
  uint64_t total = 0;
  for (const auto& t : r.tensors()) {
    fmt::print("{:<{}}  {:<5} {:<20} {:>6} {:>12}\n", t.name, width, dtype_name(t.dtype),
               t.shape.str(), t.pieces.size(), t.nbytes());
    total += t.nbytes();
  }
  std::string keys;
  for (const auto& [k, v] : r.meta().items()) keys += (keys.empty() ? "" : ", ") + k;
  fmt::print("{} tensors, {} ({} bytes) in {} files; manifest meta: {}\n", r.tensors().size(),
             human_bytes(total), total, r.files().size(), keys.empty() ? "(none)" : keys);
  std::fflush(stdout);
  return 0;
}

int store_get(const StoreArgs& a) {
  if (!a.out.empty()) check_output_file(a.out, {a.dir}, a.force, "--out");
  store::CheckpointReader r(a.dir);
  const auto& t = r.at(a.name);
  const Box box = a.box.empty() ? Box::of(t.shape) : Box::parse(a.box, t.shape);
  const DType out_type = a.dtype.empty() ? t.dtype : parse_dtype(a.dtype);
  const std::string header = a.format == "npy" ? store::npy_header(out_type, box.shape()) : "";
  TESSEL_CHECK(!a.out.empty() || !::isatty(STDOUT_FILENO), ConfigError,
               "refusing to write binary data to a terminal: use --out FILE or redirect stdout");
  const uint64_t n = uint64_t(box.volume());
  std::vector<char> raw(n * dtype_size(t.dtype));
  r.read_box(a.name, box, raw.data());
  std::vector<char> data;
  if (out_type != t.dtype) {
    data.resize(n * dtype_size(out_type));
    convert(raw.data(), t.dtype, data.data(), out_type, n);
  } else {
    data = std::move(raw);
  }
  if (a.out.empty()) {
    std::fwrite(header.data(), 1, header.size(), stdout);
    const bool ok = std::fwrite(data.data(), 1, data.size(), stdout) == data.size();
    TESSEL_CHECK(ok && std::fflush(stdout) == 0, IoError, "cannot write to stdout");
    return 0;
  }
  AtomicFileWriter out(a.out);  // checked in store_get before anything is read
  out.write(header.data(), header.size());
  out.write(data.data(), data.size());
  out.commit();
  fmt::print("wrote {}{} {} {} ({} bytes, {}) to {}\n", a.name, box.str(), dtype_name(out_type),
             box.shape().str(), header.size() + data.size(), a.format, a.out);
  std::fflush(stdout);
  return 0;
}

int store_verify(const StoreArgs& a) {
  try {
    store::CheckpointReader r(a.dir);
    const auto rep = r.verify();
    fmt::print("OK: {}: {} tensors, {} pieces in {} files, {} verified\n", a.dir, rep.tensors,
               rep.pieces, rep.files, human_bytes(rep.bytes));
    std::fflush(stdout);
    return 0;
  } catch (const Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "FAILED: {}: {}\n", e.kind(), e.what());
    std::fflush(stderr);
    return 1;
  }
}

int store_serve(const StoreArgs& a) {
  store::StoreServerOptions options;
  options.host = a.host;
  options.port = a.port;
  options.token_file = a.token_file;
  options.limits.request_timeout =
      std::chrono::milliseconds(int64_t(std::lround(a.request_timeout * 1000)));
  options.limits.max_connections = size_t(a.max_connections);
  options.limits.max_connections_per_client = size_t(a.max_connections_per_client);
  // Checks the host and token before anything else happens (ConfigError names the fix).
  store::StoreServer server(a.dir, options);
  // Ctrl-C or SIGTERM: stop serving, let the requests in flight finish, exit 0.
  StopSignals stop;
  const int port = server.start();
  fmt::print("serving {} ({} tensors) on http://{}:{}/v1/tensors{}; Ctrl-C stops\n", a.dir,
             server.reader().tensors().size(), a.host, port,
             server.requires_token() ? " (requests need \"Authorization: Bearer <token>\")" : "");
  std::fflush(stdout);
  while (stop_requested() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  server.stop();
  fmt::print("stopped (signal {})\n", stop_requested());
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_store_command(CLI::App& app, std::function<int()>& action) {
  auto args = std::make_shared<StoreArgs>();
  auto* store = app.add_subcommand("store", "inspect, extract, verify and serve checkpoints");
  store->require_subcommand(1);

  auto* ls = store->add_subcommand("ls", "list the tensors of a checkpoint");
  ls->add_option("dir", args->dir, "checkpoint directory")->required();
  ls->callback([&action, args] { action = [args] { return store_ls(*args); }; });

  auto* get = store->add_subcommand("get", "extract a tensor, or a box of it");
  get->add_option("dir", args->dir, "checkpoint directory")->required();
  get->add_option("name", args->name, "tensor name (see `tessel store ls`)")->required();
  get->add_option("--box", args->box, "box such as 0:512,: (default: the whole tensor)");
  get->add_option("--out", args->out, "file to write (default: stdout)");
  get->add_option("--format", args->format, "raw (little-endian, C order) or npy")
      ->check(CLI::IsMember({"raw", "npy"}));
  get->add_option("--dtype", args->dtype, "convert to f32, bf16, f16, i32, i64, u8 or u16");
  get->add_flag("--force", args->force, "replace the --out file if it exists");
  get->callback([&action, args] { action = [args] { return store_get(*args); }; });

  auto* verify = store->add_subcommand("verify", "read every byte and check every checksum");
  verify->add_option("dir", args->dir, "checkpoint directory")->required();
  verify->callback([&action, args] { action = [args] { return store_verify(*args); }; });

  auto* serve = store->add_subcommand("serve", "serve the tensors over HTTP until Ctrl-C");
  serve->add_option("dir", args->dir, "checkpoint directory")->required();
  serve->add_option("--host", args->host,
                    "address to bind (default 127.0.0.1: this machine only; any other address "
                    "needs --token-file)");
  serve->add_option("--port", args->port, "port (0: any free port)")->check(CLI::Range(0, 65535));
  serve->add_option("--token-file", args->token_file,
                    "file holding a shared secret (mode 600); every request must then send "
                    "\"Authorization: Bearer <secret>\" (docs/security.md)");
  serve
      ->add_option("--request-timeout", args->request_timeout,
                   "seconds a client has to send its whole request (default 10)")
      ->check(CLI::Range(0.001, 3600.0));
  serve
      ->add_option("--max-connections", args->max_connections,
                   "connections open at once, from all clients (default 64)")
      ->check(CLI::Range(1, 100000));
  serve
      ->add_option("--max-connections-per-client", args->max_connections_per_client,
                   "connections open at once from one address (default 8)")
      ->check(CLI::Range(1, 100000));
  serve->callback([&action, args] { action = [args] { return store_serve(*args); }; });
}

}  // namespace tessel::cli
