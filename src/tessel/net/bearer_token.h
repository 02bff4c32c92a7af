// Shared-secret tokens for the HTTP endpoints (the tensor store, the embedded control store): read
// from a file only its owner can read, sent as "Authorization: Bearer <token>", compared in time
// that does not depend on where a guess first differs.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace tessel::net {

// The token in `path` (surrounding whitespace dropped). Throws ConfigError naming the file and
// the fix when it cannot be read, is not a regular file, can be read by group or others (a
// secret others can read is no secret: chmod 600), is empty or shorter than 16 characters, or
// holds characters that cannot go into an HTTP header (controls, spaces). `what` names who reads
// it ("the tensor store"), for the message.
std::string read_token_file(const std::string& path, std::string_view what);

// a == b, looking at every byte of both whatever they hold (the length may show, the content
// not), so a client cannot find the token byte by byte from response times.
bool constant_time_equal(std::string_view a, std::string_view b);

// The token of an Authorization header's value "Bearer <token>" (the scheme in any case), or
// nothing for another scheme or a malformed value.
std::optional<std::string_view> bearer_token(std::string_view authorization);

}  // namespace tessel::net
