#include "tessel/planner/onnx_graph.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "tessel/core/check.h"
#include "tessel/core/error.h"

extern char** environ;

namespace tessel::planner {

namespace {

OpKind parse_kind(const std::string& name) {
  for (int k = 0; k <= int(OpKind::other); ++k)
    if (op_kind_name(OpKind(k)) == name) return OpKind(k);
  TESSEL_THROW(CorruptDataError, "imported graph: unknown operator kind '{}'", name);
}

template <typename T>
T field(const nlohmann::json& j, const char* key) {
  TESSEL_CHECK(j.is_object() && j.contains(key), CorruptDataError,
               "imported graph: '{}' is missing", key);
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "imported graph: '{}' is malformed: {}", key, e.what());
  }
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::filesystem::path importer_program() {
  if (const char* env = std::getenv("TESSEL_ONNX_IMPORT"); env != nullptr && *env != '\0')
    return env;
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  TESSEL_CHECK(!ec, IoError, "cannot find the running executable to locate tessel-onnx-import: {}",
               ec.message());
  return self.parent_path() / "tessel-onnx-import";
}

// A temporary file that goes away with this object, holding `bytes`.
struct TempFile {
  std::string path;
  explicit TempFile(std::string_view bytes = {}) {
    char p[] = "/tmp/tessel-onnx-XXXXXX";
    const int fd = ::mkstemp(p);
    TESSEL_CHECK(fd >= 0, IoError, "cannot create a file in /tmp: {}", std::strerror(errno));
    path = p;
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = errno;
        ::close(fd);
        ::unlink(p);
        TESSEL_THROW(IoError, "cannot write {}: {}", path, std::strerror(e));
      }
      done += size_t(n);
    }
    ::close(fd);
  }
  ~TempFile() { ::unlink(path.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
};

}  // namespace

std::optional<std::pair<std::string, int64_t>> parse_dim(const std::string& text, char separator) {
  const auto sep = text.find(separator);
  if (sep == std::string::npos || sep == 0) return std::nullopt;
  try {
    size_t used = 0;
    const int64_t value = std::stoll(text.substr(sep + 1), &used);
    if (used != text.size() - sep - 1 || value < 1) return std::nullopt;
    return std::make_pair(text.substr(0, sep), value);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

nlohmann::json onnx_graph_json(const OnnxGraph& g) {
  nlohmann::json nodes = nlohmann::json::array();
  for (const OpNode& n : g.graph.nodes())
    nodes.push_back({{"name", n.name},
                     {"kind", std::string(op_kind_name(n.kind))},
                     {"inputs", n.inputs},
                     {"shape", n.shape},
                     {"weights", n.weights},
                     {"weights_of", n.weights_of},
                     {"dim_of", n.dim_of},
                     {"flops", n.flops},
                     {"layer", n.layer},
                     {"op_type", n.op_type}});
  return {{"nodes", nodes}, {"warnings", g.warnings}, {"producer", g.producer}, {"opset", g.opset}};
}

OnnxGraph onnx_graph_from_json(const nlohmann::json& j) {
  OnnxGraph g;
  for (const auto& n : field<nlohmann::json>(j, "nodes")) {
    OpNode node;
    node.name = field<std::string>(n, "name");
    node.kind = parse_kind(field<std::string>(n, "kind"));
    node.inputs = field<std::vector<int>>(n, "inputs");
    node.shape = field<std::vector<int64_t>>(n, "shape");
    node.weights = field<std::vector<std::vector<int64_t>>>(n, "weights");
    node.weights_of = field<int>(n, "weights_of");
    node.dim_of = field<std::vector<int>>(n, "dim_of");
    node.flops = field<double>(n, "flops");
    node.layer = field<int>(n, "layer");
    node.op_type = field<std::string>(n, "op_type");
    g.graph.add(std::move(node));
  }
  for (int id = 0; id < g.graph.size(); ++id) {
    const int of = g.graph.node(id).weights_of;
    TESSEL_CHECK(of >= -1 && of < g.graph.size(), CorruptDataError,
                 "imported graph: node {} reads the weights of node {}, which does not exist", id,
                 of);
  }
  g.graph.validate();
  g.warnings = field<std::vector<std::string>>(j, "warnings");
  g.producer = field<std::string>(j, "producer");
  g.opset = field<int64_t>(j, "opset");
  return g;
}

OnnxGraph read_onnx(const std::filesystem::path& path, const OnnxOptions& options) {
  const auto program = importer_program();
  TESSEL_CHECK(std::filesystem::exists(program), IoError,
               "the ONNX importer {} is missing: build it (ninja tessel-onnx-import, part of "
               "scripts/build) or point TESSEL_ONNX_IMPORT at it",
               program.string());
  TempFile out, err;
  std::vector<std::string> args = {program.string(), path.string(),  "--out",
                                   out.path,         "--dim-syntax", options.dim_syntax};
  if (!options.source.empty()) args.insert(args.end(), {"--source", options.source});
  for (const auto& [name, value] : options.dims)
    args.insert(args.end(), {"--dim", name + "=" + std::to_string(value)});
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, err.path.c_str(), O_WRONLY | O_TRUNC, 0);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  TESSEL_CHECK(rc == 0, IoError, "cannot start the ONNX importer {}: {}", program.string(),
               std::strerror(rc));
  // Wait within the deadline; a hung importer is killed.
  const auto deadline = std::chrono::steady_clock::now() + options.deadline;
  int status = 0;
  bool hung = false;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    TESSEL_CHECK(r == 0 || errno == EINTR, IoError, "waiting for the ONNX importer failed: {}",
                 std::strerror(errno));
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      hung = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const std::string what = options.source.empty() ? path.string() : options.source;
  TESSEL_CHECK(!hung, CorruptDataError,
               "{}: the ONNX importer did not finish within {} s (a malformed or hostile file?)",
               what, options.deadline.count() / 1000.0);
  TESSEL_CHECK(!WIFSIGNALED(status), CorruptDataError,
               "{}: the ONNX library crashed on it (signal {}: a malformed or hostile file); check "
               "it with onnx.checker",
               what, WTERMSIG(status));
  const auto doc = nlohmann::json::parse(read_all(out.path), nullptr, false);
  if (WEXITSTATUS(status) != 0 || doc.is_discarded() || doc.contains("error")) {
    TESSEL_CHECK(!doc.is_discarded() && doc.contains("error"), IoError,
                 "the ONNX importer failed on {} (exit {}): {}", what, WEXITSTATUS(status),
                 read_all(err.path));
    const std::string kind = doc["error"].value("kind", ""),
                      message = doc["error"].value("message", "");
    if (kind == "config error") throw ConfigError(message);
    if (kind == "I/O error") throw IoError(message);
    if (kind == "invalid argument") throw InvalidArgumentError(message);
    throw CorruptDataError(message);
  }
  return onnx_graph_from_json(doc);
}

OnnxGraph read_onnx_bytes(std::string_view bytes, const OnnxOptions& options) {
  const TempFile file(bytes);
  return read_onnx(file.path, options);
}

}  // namespace tessel::planner
