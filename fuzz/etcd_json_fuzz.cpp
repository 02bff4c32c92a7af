// The etcd gateway's JSON integers (comm/etcd_json.h), as the etcd client and the embedded store
// server read them from a response or request body: strings, numbers, null or anything else.
#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "tessel/comm/etcd_json.h"

namespace {

void read_fields(const nlohmann::json& j) {
  for (const char* field : {"revision", "create_revision", "mod_revision", "version", "lease",
                            "ttl", "TTL", "ID", "count", "compact_revision", "start_revision"})
    tessel::comm::gateway_integer(j, field);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  // The body's JSON is parsed by each side before these helpers see it; only what parses matters.
  const auto j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  fuzz::expect_only_tessel_errors([&] {
    read_fields(j);
    if (!j.is_object()) return;
    if (const auto h = j.find("header"); h != j.end()) read_fields(*h);
    for (const char* list : {"kvs", "events", "responses"})
      if (const auto l = j.find(list); l != j.end() && l->is_array())
        for (const auto& item : *l) {
          read_fields(item);
          if (item.is_object())
            for (const char* inner : {"kv", "prev_kv"})
              if (const auto kv = item.find(inner); kv != item.end()) read_fields(*kv);
        }
  });
  return 0;
}
