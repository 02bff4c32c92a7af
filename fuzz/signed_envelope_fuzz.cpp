// A value read from a cluster's etcd through comm::SignedStore (comm/signed_store.h): anyone who
// can write to etcd chooses these bytes. get() must verify or refuse them with MembershipError,
// and list() must return them unwrapped or skip them, never anything else.
#include <memory>
#include <string>

#include "fuzz_util.h"
#include "tessel/comm/memory_store.h"
#include "tessel/comm/signed_store.h"
#include "tessel/core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const std::string key = "/tessel/fuzz/decisions/records/1";
  auto raw = std::make_shared<comm::MemoryStore>();
  // The secret the seeds' valid envelopes were made with (make_seeds.py).
  comm::SignedStore member(raw, "fuzz-secret-0123456789", "cluster 'fuzz'",
                           [](const std::string&, const std::string&) {});
  raw->set(key, std::string(reinterpret_cast<const char*>(data), size));
  fuzz::expect_only_tessel_errors([&] {
    try {
      const auto kv = member.get(key);
      // What verified is what a member wrote: sealing it again gives the stored bytes.
      if (kv) {
        member.set(key + "/again", kv->value);
        if (member.get(key + "/again")->value != kv->value) __builtin_trap();
      }
    } catch (const MembershipError&) {
    }
    for (const auto& kv : member.list("/tessel/fuzz/"))
      if (kv.key == key && !member.get(key)) __builtin_trap();
  });
  return 0;
}
