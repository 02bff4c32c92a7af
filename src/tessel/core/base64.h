// Standard base64 (RFC 4648, with '=' padding): how etcd's JSON gateway carries keys and values,
// which are bytes, not text.
#pragma once

#include <string>
#include <string_view>

namespace tessel {

std::string base64_encode(std::string_view bytes);
// Throws CorruptDataError on a character outside the alphabet, a length that is not a multiple of
// 4, or misplaced padding.
std::string base64_decode(std::string_view text);

}  // namespace tessel
