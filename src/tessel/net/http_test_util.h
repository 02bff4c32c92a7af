// Test helper: HTTP by hand over a TCP socket, for what httplib's client cannot do (drip bytes,
// send malformed or oversized requests, connect from another loopback address, which a server
// counts as another client).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tessel::net::test {

class RawClient {
 public:
  // Connects to 127.0.0.1:port from the loopback address `from` (127.0.0.0/8).
  explicit RawClient(int port, const std::string& from = "127.0.0.1") {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw std::runtime_error("socket() failed");
    sockaddr_in local{};
    local.sin_family = AF_INET;
    ::inet_pton(AF_INET, from.c_str(), &local.sin_addr);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0)
      throw std::runtime_error("cannot bind " + from);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(port));
    ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawClient() { ::close(fd_); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }
  // False when the server closed or reset the connection.
  bool send(std::string_view bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size());
  }
  // What the server sends until it closes the connection, or until `timeout` passed.
  std::string read_until_closed(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        closed_ = false;
        return out;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, int(left.count())) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        closed_ = true;
        return out;
      }
      out.append(buf, size_t(n));
    }
  }
  // Whether the last read_until_closed() ended because the server closed.
  bool closed() const { return closed_; }
  // True when the server has closed (or reset) the connection by now, without waiting.
  bool closed_now() {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) return false;
    char byte;
    return ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) <= 0 || (p.revents & POLLHUP);
  }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
};

// "HTTP/1.1 200 OK..." -> 200; 0 when the text is no HTTP response.
inline int status_of(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0 || response.size() < 12) return 0;
  return std::stoi(response.substr(9, 3));
}

inline std::string body_of(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

// One request with "Connection: close"; the whole response ("" when the server sent none).
inline std::string request(int port, const std::string& method, const std::string& path,
                           const std::string& headers = "", const std::string& body = "",
                           const std::string& from = "127.0.0.1") {
  RawClient c(port, from);
  std::string text =
      method + " " + path + " HTTP/1.1\r\nHost: test\r\nConnection: close\r\n" + headers;
  if (!body.empty()) text += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  c.send(text + "\r\n" + body);
  return c.read_until_closed();
}

}  // namespace tessel::net::test
