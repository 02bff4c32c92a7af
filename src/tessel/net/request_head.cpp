#include "tessel/net/request_head.h"

#include <algorithm>

namespace tessel::net {

namespace {

bool same_name(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

size_t find_head_end(std::string_view bytes, size_t from) {
  // The end marker may straddle what the previous search saw.
  const size_t start = from >= 3 ? from - 3 : 0;
  const size_t at = bytes.find("\r\n\r\n", start);
  return at == std::string_view::npos ? 0 : at + 4;
}

RequestHead parse_head(std::string_view head) {
  RequestHead out;
  for (size_t i = 0; i < head.size(); ++i) {
    if (head[i] == '\n' && (i == 0 || head[i - 1] != '\r')) {
      out.problem = "a line of the request ends with a bare LF (HTTP lines end with CRLF)";
      return out;
    }
  }
  size_t line_end = head.find("\r\n");
  const std::string_view request_line = head.substr(0, line_end);
  const size_t space = request_line.find(' ');
  if (space == 0 || space == std::string_view::npos) {
    out.problem = "the request line is not 'METHOD PATH VERSION'";
    return out;
  }
  out.method = std::string(request_line.substr(0, space));
  for (size_t pos = line_end + 2; pos < head.size();) {
    line_end = head.find("\r\n", pos);
    const std::string_view line = head.substr(pos, line_end - pos);
    pos = line_end + 2;
    if (line.empty()) break;  // the blank line ending the head
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      out.problem = "a header line has no name and colon";
      return out;
    }
    const std::string_view name = line.substr(0, colon);
    const std::string_view value = trim(line.substr(colon + 1));
    if (same_name(name, "Content-Length")) {
      if (out.content_length) {
        out.problem = "Content-Length is given twice";
        return out;
      }
      if (value.empty() || value.size() > 18 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        out.problem = "Content-Length is not a number";
        return out;
      }
      uint64_t n = 0;
      for (char c : value) n = n * 10 + uint64_t(c - '0');
      out.content_length = n;
    } else if (same_name(name, "Transfer-Encoding")) {
      out.transfer_encoding = true;
    } else if (same_name(name, "Authorization")) {
      if (out.authorization) {
        out.problem = "Authorization is given twice";
        return out;
      }
      out.authorization = std::string(value);
    }
  }
  return out;
}

bool method_takes_body(std::string_view method) {
  return method == "POST" || method == "PUT" || method == "PATCH" || method == "DELETE" ||
         method == "PRI";
}

}  // namespace tessel::net
