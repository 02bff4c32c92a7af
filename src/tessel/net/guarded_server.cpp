#include "tessel/net/guarded_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/net/address.h"
#include "tessel/net/bearer_token.h"
#include "tessel/net/request_head.h"
#include "tessel/net/worker_pool.h"

namespace tessel::net {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What the gate reads from a socket at once.
constexpr size_t kReadBytes = size_t(16) << 10;

const char* reason(int status) {
  switch (status) {
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 408:
      return "Request Timeout";
    case 411:
      return "Length Required";
    case 413:
      return "Payload Too Large";
    case 431:
      return "Request Header Fields Too Large";
    case 503:
      return "Service Unavailable";
    default:
      return "Error";
  }
}

// The address and port at either end of a connected socket.
std::pair<std::string, int> socket_address(int fd, bool peer) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  auto* sa = reinterpret_cast<sockaddr*>(&addr);
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) return {"", 0};
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
    return {text, ntohs(in->sin_port)};
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in->sin6_addr, text, sizeof text);
    return {text, ntohs(in->sin6_port)};
  }
  return {"", 0};
}

// Waits until `fd` is ready for `events`, at most `timeout`.
bool wait_for(int fd, short events, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, int(std::max<int64_t>(0, left.count())));
    if (n > 0) return (p.revents & (events | POLLHUP | POLLERR)) != 0;
    if (n == 0 || errno != EINTR) return false;
  }
}

// The listen loop's task queue: accepting only admits a connection (no waiting), so it runs on
// the loop's own thread; the gate and the workers do the rest.
class OnAcceptThread final : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> job) override { job(); }
  void shutdown() override {}
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Connections

struct GuardedServer::Impl {
  struct Connection;
  class Stream;
  class Gate;

  Impl(GuardedServer& owner, ServerOptions o);

  bool admit(int fd);
  void serve(const std::shared_ptr<Connection>& c);
  void leave(const std::string& peer);
  // One of the answers the server gives itself; the connection is closed after it.
  void answer(int fd, int status, const std::string& message) const;

  GuardedServer& owner;
  ServerOptions options;
  std::optional<std::string> token;
  std::unique_ptr<Gate> gate;
  std::unique_ptr<WorkerPool> workers;
  std::thread listener;
  std::atomic<bool> listening_done{false};
  std::atomic<bool> stopping{false};
  bool started = false;

  mutable std::mutex mu;  // the counts below
  size_t open = 0;
  std::map<std::string, size_t> open_by_peer;
};

// An admitted connection: counted from admission until it is destroyed, which closes it.
struct GuardedServer::Impl::Connection {
  Connection(Impl& server, int socket, std::string address)
      : impl(server), fd(socket), peer(std::move(address)) {}
  ~Connection() {
    // Uncounted before the close, so a client that saw its connection end finds the slot free.
    impl.leave(peer);
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Ready for the next request, whose bytes may have come with the last one.
  void next_request(Clock::time_point when) {
    deadline = when;
    scanned = 0;
    request = 0;
    unauthorized = false;
  }

  Impl& impl;
  const int fd;
  const std::string peer;
  std::string buffer;  // received, not yet taken by httplib
  size_t scanned = 0;  // buffer[0, scanned) holds no end of the head
  size_t request = 0;  // head and body, once the head is known
  bool unauthorized = false;
  size_t served = 0;
  Clock::time_point deadline;
};

// httplib's view of a connection whose request the gate has read: the request comes from
// memory; writes wait at most write_timeout each, and never raise SIGPIPE.
class GuardedServer::Impl::Stream final : public httplib::Stream {
 public:
  Stream(Connection& c, milliseconds write_timeout) : c_(c), write_timeout_(write_timeout) {}
  // The bytes httplib did not take (the start of a pipelined next request) stay with the
  // connection.
  ~Stream() override { c_.buffer.erase(0, taken_); }

  bool is_readable() const override {
    return taken_ < c_.buffer.size() || wait_for(c_.fd, POLLIN, left());
  }
  bool is_writable() const override {
    if (!wait_for(c_.fd, POLLOUT, write_timeout_)) return false;
    // A client that closed its end (or reset the connection) is gone: a long stream must notice
    // it and stop.
    char byte;
    const ssize_t n = ::recv(c_.fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
  }
  ssize_t read(char* ptr, size_t size) override {
    if (taken_ < c_.buffer.size()) {
      const size_t n = std::min(size, c_.buffer.size() - taken_);
      std::memcpy(ptr, c_.buffer.data() + taken_, n);
      taken_ += n;
      return ssize_t(n);
    }
    // The gate read the whole request, so httplib does not get here for a well-formed one;
    // should it, the request's deadline still holds.
    if (!wait_for(c_.fd, POLLIN, left())) return -1;
    return ::recv(c_.fd, ptr, size, MSG_DONTWAIT);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!wait_for(c_.fd, POLLOUT, write_timeout_)) return -1;
    const ssize_t n = ::send(c_.fd, ptr, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    std::tie(ip, port) = socket_address(c_.fd, true);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    std::tie(ip, port) = socket_address(c_.fd, false);
  }
  socket_t socket() const override { return c_.fd; }

 private:
  milliseconds left() const {
    return std::max(milliseconds(0),
                    std::chrono::duration_cast<milliseconds>(c_.deadline - Clock::now()));
  }

  Connection& c_;
  const milliseconds write_timeout_;
  size_t taken_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The gate: one thread reading every waiting connection's request without blocking.

class GuardedServer::Impl::Gate {
 public:
  explicit Gate(Impl& impl) : impl_(impl), wake_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    TESSEL_CHECK(wake_ >= 0, IoError, "{}: cannot create an eventfd: {}", impl_.options.name,
                 std::strerror(errno));
    thread_ = std::thread([this] { run(); });
  }
  ~Gate() {
    stop();
    ::close(wake_);
  }

  void add(std::shared_ptr<Connection> c) {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;  // dropping it closes it
      incoming_.push_back(std::move(c));
    }
    wake();
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    wake();
    if (thread_.joinable()) thread_.join();
  }

 private:
  enum class Step { wait, dispatch, drop };

  void wake() {
    const uint64_t one = 1;
    (void)!::write(wake_, &one, sizeof one);
  }

  void run() {
    std::vector<std::shared_ptr<Connection>> waiting;
    std::vector<pollfd> fds;
    for (;;) {
      {
        std::lock_guard lock(mu_);
        if (stopping_) break;
        for (auto& c : incoming_) {
          // A kept-alive connection may hold its next request already.
          if (settle(c, examine(*c))) waiting.push_back(std::move(c));
        }
        incoming_.clear();
      }
      auto timeout = milliseconds(1000);
      const auto now = Clock::now();
      fds.assign(1, pollfd{wake_, POLLIN, 0});
      for (const auto& c : waiting) {
        fds.push_back(pollfd{c->fd, POLLIN, 0});
        timeout = std::min(timeout, std::chrono::ceil<milliseconds>(c->deadline - now));
      }
      const int n = ::poll(fds.data(), fds.size(), int(std::max<int64_t>(0, timeout.count())));
      if (n < 0 && errno != EINTR) {
        spdlog::error("{}: poll failed: {}", impl_.options.name, std::strerror(errno));
        std::this_thread::sleep_for(milliseconds(10));
        continue;
      }
      if (fds[0].revents & POLLIN) {
        uint64_t count;
        (void)!::read(wake_, &count, sizeof count);
      }
      std::vector<std::shared_ptr<Connection>> still;
      const auto then = Clock::now();
      for (size_t i = 0; i < waiting.size(); ++i) {
        auto& c = waiting[i];
        Step step = Step::wait;
        if (n > 0 && fds[i + 1].revents != 0) step = receive(*c);
        if (step == Step::wait && then >= c->deadline) {
          // A kept-alive connection that sent nothing more is closed quietly: a 408 there would
          // be read as the answer to the next request its client sends.
          if (!c->buffer.empty()) {
            impl_.answer(c->fd, 408,
                         "the request did not arrive within " +
                             std::to_string(impl_.options.limits.request_timeout.count()) +
                             " ms; send it at once");
          }
          step = Step::drop;
        }
        if (settle(c, step)) still.push_back(std::move(c));
      }
      waiting.swap(still);
    }
    std::lock_guard lock(mu_);
    incoming_.clear();  // closes them, as dropping `waiting` does
  }

  // Carries out a step; true when the connection keeps waiting here.
  bool settle(const std::shared_ptr<Connection>& c, Step step) {
    if (step == Step::dispatch) {
      impl_.workers->enqueue([&impl = impl_, c] { impl.serve(c); });
      return false;
    }
    return step == Step::wait;
  }

  // Reads what the client sent, as much as the request may still hold.
  Step receive(Connection& c) {
    const auto& limits = impl_.options.limits;
    const size_t want = c.request > 0 ? c.request : limits.max_head_bytes + 1;
    char buf[kReadBytes];
    while (c.buffer.size() < want) {
      const ssize_t n =
          ::recv(c.fd, buf, std::min(sizeof buf, want - c.buffer.size()), MSG_DONTWAIT);
      if (n == 0) return Step::drop;  // the client closed before its request was complete
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return Step::drop;
      }
      c.buffer.append(buf, size_t(n));
    }
    return examine(c);
  }

  // What the bytes received so far call for.
  Step examine(Connection& c) {
    const auto& limits = impl_.options.limits;
    if (c.request == 0) {
      const size_t end = find_head_end(c.buffer, c.scanned);
      c.scanned = c.buffer.size();
      if (end == 0 && c.buffer.size() <= limits.max_head_bytes) return Step::wait;
      if (end == 0 || end > limits.max_head_bytes) {
        return refuse(c, 431,
                      "the request's line and headers exceed " +
                          std::to_string(limits.max_head_bytes) + " bytes");
      }
      const RequestHead head = parse_head(std::string_view(c.buffer).substr(0, end));
      if (!head.problem.empty()) return refuse(c, 400, head.problem);
      if (impl_.token) {
        const auto given = head.authorization ? bearer_token(*head.authorization) : std::nullopt;
        c.unauthorized = !given || !constant_time_equal(*given, *impl_.token);
      }
      uint64_t body = 0;
      if (!method_takes_body(head.method)) {
        if (head.transfer_encoding || head.content_length.value_or(0) > 0)
          return refuse(c, 413, "a " + head.method + " request takes no body");
      } else {
        if (head.transfer_encoding || !head.content_length)
          return refuse(c, 411, "send the body with a Content-Length (no chunked encoding)");
        body = *head.content_length;
        if (body > limits.max_body_bytes && c.unauthorized) return refuse_unauthorized(c);
        if (body > limits.max_body_bytes)
          return refuse(c, 413,
                        "the body of " + std::to_string(body) + " bytes exceeds " +
                            std::to_string(limits.max_body_bytes));
      }
      c.request = end + size_t(body);
    }
    if (c.buffer.size() < c.request) return Step::wait;
    // Answered only now, with the whole request read, so the client hears the 401 instead of a
    // reset from a close with its body unread.
    if (c.unauthorized) return refuse_unauthorized(c);
    return Step::dispatch;
  }

  Step refuse_unauthorized(Connection& c) {
    return refuse(c, 401,
                  "this endpoint requires \"Authorization: Bearer <token>\" with its token");
  }

  Step refuse(Connection& c, int status, const std::string& message) {
    impl_.answer(c.fd, status, message);
    return Step::drop;
  }

  Impl& impl_;
  const int wake_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Connection>> incoming_;
  bool stopping_ = false;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
// The server

GuardedServer::Impl::Impl(GuardedServer& server, ServerOptions o)
    : owner(server), options(std::move(o)) {
  auto& limits = options.limits;
  TESSEL_CHECK(options.port >= 0 && options.port <= 65535, ConfigError,
               "{}: port {} is outside 0..65535 (0: any free port)", options.name, options.port);
  TESSEL_CHECK(limits.request_timeout.count() > 0 && limits.write_timeout.count() > 0 &&
                   limits.max_head_bytes > 0 && limits.max_connections > 0 &&
                   limits.max_connections_per_client > 0 && limits.threads > 0 &&
                   limits.max_requests_per_connection > 0 && limits.listen_backlog > 0,
               ConfigError, "{}: its timeouts and limits must be positive", options.name);
  if (!options.token_file.empty()) token = read_token_file(options.token_file, options.name);
  TESSEL_CHECK(token || is_loopback_host(options.host), ConfigError,
               "{}: refusing to listen on {} without a token: anyone who can reach that address "
               "could use it. Give {} (a file only you can read holding a random secret, e.g. "
               "`head -c 32 /dev/urandom | base64 > F; chmod 600 F`) or listen on 127.0.0.1",
               options.name, options.host, options.token_hint);
  if (!options.error_body) {
    options.error_body = [](int, const std::string& message) {
      return nlohmann::json{{"error", message}}.dump() + "\n";
    };
  }
}

bool GuardedServer::Impl::admit(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  std::string peer = socket_address(fd, true).first;
  bool admitted = false;
  {
    std::lock_guard lock(mu);
    size_t& mine = open_by_peer[peer];
    if (!stopping && open < options.limits.max_connections &&
        mine < options.limits.max_connections_per_client) {
      ++open;
      ++mine;
      admitted = true;
    } else if (mine == 0) {
      open_by_peer.erase(peer);
    }
  }
  if (!admitted) {
    answer(fd, 503,
           "too many connections (at most " +
               std::to_string(options.limits.max_connections_per_client) + " from one address, " +
               std::to_string(options.limits.max_connections) +
               " in all); close some or retry later");
    ::close(fd);
    return false;
  }
  auto c = std::make_shared<Connection>(*this, fd, std::move(peer));
  c->next_request(Clock::now() + options.limits.request_timeout);
  gate->add(std::move(c));
  return true;
}

void GuardedServer::Impl::leave(const std::string& peer) {
  std::lock_guard lock(mu);
  --open;
  auto it = open_by_peer.find(peer);
  if (it != open_by_peer.end() && --it->second == 0) open_by_peer.erase(it);
}

void GuardedServer::Impl::serve(const std::shared_ptr<Connection>& c) {
  const auto& limits = options.limits;
  bool keep = false;
  try {
    const bool last = c->served + 1 >= limits.max_requests_per_connection || stopping;
    bool closed = false;
    bool ok = false;
    {
      Stream stream(*c, limits.write_timeout);
      ok = owner.serve_request(stream, last, closed);
    }
    ++c->served;
    keep = ok && !last && !closed && !stopping;
  } catch (const std::exception& e) {
    // A response's content provider failed after its status went out: the client sees the
    // connection close before the promised length, which every HTTP client reports.
    spdlog::warn("{}: a response to {} ended early: {}", options.name, c->peer, e.what());
  }
  if (keep) {
    c->next_request(Clock::now() + limits.request_timeout);
    gate->add(c);
  }
}

void GuardedServer::Impl::answer(int fd, int status, const std::string& message) const {
  const std::string body = options.error_body(status, message);
  std::string reply =
      "HTTP/1.1 " + std::to_string(status) + " " + reason(status) +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n";
  if (status == 401) reply += "WWW-Authenticate: Bearer\r\n";
  reply += "\r\n" + body;
  // One try without waiting: a fresh connection's send buffer takes a short answer whole, and a
  // client that does not read gets nothing more from us.
  (void)::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::shutdown(fd, SHUT_WR);
  // What the client sent and nobody read would turn the close into a reset, which can discard
  // the answer before the client reads it.
  char buf[4096];
  while (::recv(fd, buf, sizeof buf, MSG_DONTWAIT) > 0) {
  }
}

GuardedServer::GuardedServer(ServerOptions options)
    : impl_(std::make_unique<Impl>(*this, std::move(options))) {
  const auto& limits = impl_->options.limits;
  new_task_queue = [] { return new OnAcceptThread; };
  set_payload_max_length(limits.max_body_bytes);
  // Only for the Keep-Alive header httplib writes: the gate enforces both.
  set_keep_alive_max_count(limits.max_requests_per_connection);
  set_keep_alive_timeout(std::max<time_t>(1, time_t(limits.request_timeout.count() / 1000)));
  // A reply's headers and body go out in separate writes: with Nagle's algorithm the body would
  // wait for the client's delayed ACK (40 ms on Linux).
  set_tcp_nodelay(true);
  // httplib's default sets SO_REUSEPORT, with which a second server on this port would share the
  // connections of the first instead of failing to listen. SO_REUSEADDR only lets a restarted
  // server take its port back from connections still in TIME_WAIT. Close-on-exec: a program
  // this process starts must not hold the port after it stopped.
  set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    ::fcntl(sock, F_SETFD, FD_CLOEXEC);
  });
}

GuardedServer::~GuardedServer() {
  stop();
}

bool GuardedServer::process_and_close_socket(socket_t sock) {
  return impl_->admit(sock);
}

bool GuardedServer::serve_request(httplib::Stream& stream, bool close_connection,
                                  bool& connection_closed) {
  return process_request(stream, close_connection, connection_closed, nullptr);
}

int GuardedServer::start() {
  auto& impl = *impl_;
  const auto& o = impl.options;
  TESSEL_CHECK(!impl.started, InvalidArgumentError, "{} was started twice", o.name);
  int port = o.port;
  if (port == 0) {
    port = bind_to_any_port(o.host);
    TESSEL_CHECK(port > 0, IoError, "{}: cannot listen on {} (not an address of this machine?)",
                 o.name, o.host);
  } else {
    TESSEL_CHECK(bind_to_port(o.host, port), IoError,
                 "{}: cannot listen on {}:{} (in use, or not an address of this machine?): choose "
                 "another host or port",
                 o.name, o.host, port);
  }
  impl.options.port = port;
  // Linux lets listen() again update the backlog of a listening socket; at httplib's 5 a burst
  // of clients would overflow it and wait a second for TCP to retry. Best effort: at the old
  // backlog the server still serves.
  (void)::listen(svr_sock_, o.limits.listen_backlog);
  impl.workers = std::make_unique<WorkerPool>(o.limits.threads);
  impl.gate = std::make_unique<Impl::Gate>(impl);
  impl.started = true;
  impl.stopping = false;
  impl.listening_done = false;
  impl.listener = std::thread([this] {
    listen_after_bind();
    impl_->listening_done = true;
  });
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (!is_running()) {
    if (impl.listening_done) {
      stop();
      TESSEL_THROW(IoError, "{} on {}:{} stopped as it started", o.name, o.host, port);
    }
    if (Clock::now() > deadline) {
      stop();
      TESSEL_THROW(TimeoutError, "{} on {}:{} did not start within 5 s", o.name, o.host, port);
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  return port;
}

void GuardedServer::stop() {
  auto& impl = *impl_;
  if (!impl.started) return;
  impl.stopping = true;
  // httplib's stop() does nothing before the listen loop has started (and must be called once):
  // call it as soon as the loop runs, then wait for the loop to end, within a bound.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  bool stop_sent = false;
  while (!impl.listening_done && Clock::now() < deadline) {
    if (!stop_sent && is_running()) {
      httplib::Server::stop();
      stop_sent = true;
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  if (impl.listening_done) {
    impl.listener.join();
  } else {
    spdlog::error("{} on {}:{} did not stop within 10 s; leaving its thread", impl.options.name,
                  impl.options.host, impl.options.port);
    impl.listener.detach();
  }
  impl.gate->stop();
  impl.workers->shutdown();
  impl.started = false;
}

int GuardedServer::port() const {
  return impl_->options.port;
}
const std::string& GuardedServer::host() const {
  return impl_->options.host;
}
bool GuardedServer::requires_token() const {
  return impl_->token.has_value();
}
const ServerLimits& GuardedServer::limits() const {
  return impl_->options.limits;
}
bool GuardedServer::stopping() const {
  return impl_->stopping;
}
size_t GuardedServer::open_connections() const {
  std::lock_guard lock(impl_->mu);
  return impl_->open;
}

}  // namespace tessel::net
