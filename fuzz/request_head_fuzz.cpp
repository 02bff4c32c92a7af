// find_head_end and parse_head (net/request_head.h): the bytes a client sends to the tensor store
// or the embedded control store before any thread is given to its request. The head is measured
// a byte at a time as a slow client would send it, and must measure the same as all at once.
#include "fuzz_util.h"
#include "tessel/net/request_head.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel::net;
  const auto bytes = tessel::fuzz::as_text(data, size);
  const size_t whole = find_head_end(bytes);
  size_t trickled = 0;
  for (size_t n = 1; n <= bytes.size() && trickled == 0; ++n)
    trickled = find_head_end(bytes.substr(0, n), n - 1);
  if (trickled != whole) __builtin_trap();
  if (whole > bytes.size()) __builtin_trap();
  if (whole == 0) return 0;  // incomplete: the server waits for more (or its deadline)
  tessel::fuzz::expect_only_tessel_errors([&] {
    const auto head = parse_head(bytes.substr(0, whole));
    if (head.problem.empty() && head.method.empty()) __builtin_trap();
    (void)method_takes_body(head.method);
  });
  return 0;
}
