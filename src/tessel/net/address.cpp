#include "tessel/net/address.h"

#include <arpa/inet.h>

#include <string>

namespace tessel::net {

bool is_loopback_host(std::string_view host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr addr{};
  const std::string text(host);
  // inet_pton accepts the dotted-quad form only (no "127.1", no octal), which is what is meant.
  if (::inet_pton(AF_INET, text.c_str(), &addr) != 1) return false;
  return (ntohl(addr.s_addr) >> 24) == 127;
}

}  // namespace tessel::net
