// Which addresses a server may listen on without a token.
#pragma once

#include <string_view>

namespace tessel::net {

// True for literal loopback addresses only: 127.0.0.0/8 in dotted form, "::1" and "localhost".
// Anything else, host names included (they may resolve to any interface) and the wildcard
// addresses 0.0.0.0 and "::", is reachable from other machines as far as the servers know.
bool is_loopback_host(std::string_view host);

}  // namespace tessel::net
