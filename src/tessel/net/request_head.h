// The little a GuardedServer reads from a request's head before a worker thread takes the
// request: where the head ends, how long the body is, and the Authorization header. It agrees
// with httplib where httplib will parse the same bytes again (the head ends at the first empty
// line, header names are exact up to case, a body is read only for the methods httplib reads one
// for) and is stricter elsewhere (a bare LF, a header line without a colon, a repeated
// Content-Length or Authorization, a Content-Length that is not plain digits are malformed), so
// the two can never disagree on where a request ends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tessel::net {

struct RequestHead {
  std::string method;
  std::optional<uint64_t> content_length;
  bool transfer_encoding = false;  // any Transfer-Encoding header
  std::optional<std::string> authorization;
  std::string problem;  // non-empty: the head is malformed, and why
};

// The length of the head at the start of `bytes`, through the "\r\n\r\n" that ends it, or 0
// while it is incomplete. `from`: how far an earlier search of the same bytes got (bytes.size()
// then), so a head that arrives a byte at a time is not scanned again and again.
size_t find_head_end(std::string_view bytes, size_t from = 0);

// Parses a complete head (what find_head_end measured).
RequestHead parse_head(std::string_view head);

// Whether httplib 0.11 reads a body for requests of this method (POST, PUT, PATCH, DELETE, PRI);
// for any other method it would take body bytes for the next request.
bool method_takes_body(std::string_view method);

}  // namespace tessel::net
