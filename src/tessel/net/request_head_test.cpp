#include "tessel/net/request_head.h"

#include <gtest/gtest.h>

#include <string>

namespace tessel::net {
namespace {

TEST(FindHeadEnd, FindsTheBlankLineAsBytesArrive) {
  const std::string head = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string request = head + "body";
  EXPECT_EQ(find_head_end(request), head.size());
  // Fed a byte at a time, resuming where the last search got to.
  size_t from = 0, found = 0;
  for (size_t n = 1; n <= request.size() && found == 0; ++n) {
    found = find_head_end(std::string_view(request).substr(0, n), from);
    from = n;
    if (n < head.size()) {
      EXPECT_EQ(found, 0u) << n;
    }
  }
  EXPECT_EQ(found, head.size());
  EXPECT_EQ(find_head_end("GET / HTTP/1.1\r\nHost: x\r\n"), 0u);
}

TEST(ParseHead, ReadsMethodLengthAndAuthorization) {
  auto h = parse_head(
      "POST /v3/kv/put HTTP/1.1\r\ncontent-length:  12 \r\nAUTHORIZATION: Bearer abc\r\n\r\n");
  EXPECT_EQ(h.problem, "");
  EXPECT_EQ(h.method, "POST");
  EXPECT_EQ(h.content_length, 12u);
  EXPECT_EQ(h.authorization, "Bearer abc");
  EXPECT_FALSE(h.transfer_encoding);
  h = parse_head("GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
  EXPECT_EQ(h.problem, "");
  EXPECT_TRUE(h.transfer_encoding);
  EXPECT_FALSE(h.content_length);
  // httplib would not take "Content-Length " (a space in the name) as the length; neither do we.
  EXPECT_FALSE(parse_head("GET / HTTP/1.1\r\nContent-Length : 5\r\n\r\n").content_length);
}

TEST(ParseHead, MalformedHeadsAreProblems) {
  for (const char* head :
       {"GET / HTTP/1.1\nHost: x\r\n\r\n", "GET\r\n\r\n", " GET / HTTP/1.1\r\n\r\n",
        "GET / HTTP/1.1\r\nno colon\r\n\r\n", "GET / HTTP/1.1\r\n: v\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        "GET / HTTP/1.1\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n"}) {
    EXPECT_NE(parse_head(head).problem, "") << head;
  }
}

TEST(MethodTakesBody, AsHttplibReadsBodies) {
  for (const char* m : {"POST", "PUT", "PATCH", "DELETE", "PRI"}) EXPECT_TRUE(method_takes_body(m));
  for (const char* m : {"GET", "HEAD", "OPTIONS", "post"}) EXPECT_FALSE(method_takes_body(m));
}

}  // namespace
}  // namespace tessel::net
