#include "tessel/comm/signed_store.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/core/log.h"

namespace tessel::comm {
namespace {

// "tsig1." + 64 hex digits + ".": the version names the MAC and its input; a new scheme takes a
// new tag, so old and new processes refuse each other's values clearly instead of misreading them.
constexpr std::string_view kTag = "tsig1.";
constexpr size_t kMacHexDigits = 64;
constexpr size_t kHeaderBytes = kTag.size() + kMacHexDigits + 1;

// The fix every refusal names: whoever wrote the value lacks the secret.
constexpr std::string_view kWhy =
    "written by a process without this job's secret: another job's process, or an agent started "
    "without the cluster's token file (--token-file)";

std::string hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

bool is_lower_hex(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

// The MAC's input: the key is part of it, so a value cannot be moved to another key.
std::string mac_input(const std::string& key, const std::string& value) {
  std::string m;
  m.reserve(key.size() + 1 + value.size());
  m += key;
  m += '\0';
  m += value;
  return m;
}

}  // namespace

std::string hmac_sha256(std::string_view key, std::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  // A key of 0 bytes still needs a non-null pointer.
  static const char kNoKey = 0;
  const void* key_bytes = key.empty() ? &kNoKey : key.data();
  const auto* data = reinterpret_cast<const unsigned char*>(message.data());
  TESSEL_CHECK(
      HMAC(EVP_sha256(), key_bytes, int(key.size()), data, message.size(), mac, &length) != nullptr,
      IoError, "HMAC-SHA256 failed inside OpenSSL");
  return std::string(reinterpret_cast<const char*>(mac), length);
}

bool looks_signed(std::string_view value) {
  return value.size() >= kHeaderBytes && value.substr(0, kTag.size()) == kTag &&
         value[kHeaderBytes - 1] == '.' &&
         std::all_of(value.begin() + kTag.size(), value.begin() + kHeaderBytes - 1, is_lower_hex);
}

SignedStore::SignedStore(std::shared_ptr<ControlStore> inner, std::string secret, std::string scope,
                         SkipReport on_skip)
    : inner_(std::move(inner)),
      secret_(std::move(secret)),
      scope_(std::move(scope)),
      on_skip_(std::move(on_skip)) {
  TESSEL_CHECK(inner_ != nullptr, InvalidArgumentError, "SignedStore of {}: no store to wrap",
               scope_);
  TESSEL_CHECK(!secret_.empty(), ConfigError,
               "the shared secret of {} is empty; give it the job's token file (--token-file)",
               scope_);
}

std::string SignedStore::seal(const std::string& key, const std::string& value) const {
  TESSEL_CHECK(key.find('\0') == std::string::npos, InvalidArgumentError,
               "control store key '{}' of {} contains a NUL byte, which a signed key cannot", key,
               scope_);
  std::string sealed(kTag);
  sealed += hex(hmac_sha256(secret_, mac_input(key, value)));
  sealed += '.';
  sealed += value;
  return sealed;
}

std::optional<std::string> SignedStore::open(const std::string& key, const std::string& sealed,
                                             std::string* refusal) const {
  auto refuse = [&](std::string_view what) {
    *refusal = fmt::format("control store key '{}' of {} {}: {}", key, scope_, what, kWhy);
    return std::nullopt;
  };
  if (!looks_signed(sealed)) {
    return refuse(
        "holds a value without a signature, where every value is signed (was it written by "
        "hand?)");
  }
  // seal() never signs such a key: a NUL in it would make key + '\0' + value ambiguous.
  if (key.find('\0') != std::string::npos)
    return refuse("contains a NUL byte, which no signed key may");
  std::string value = sealed.substr(kHeaderBytes);
  const std::string expected = hex(hmac_sha256(secret_, mac_input(key, value)));
  // Constant time: how far a forged MAC matches must not show in how long the check takes.
  if (CRYPTO_memcmp(expected.data(), sealed.data() + kTag.size(), kMacHexDigits) != 0) {
    return refuse(
        "holds a value whose signature does not match this job's secret (or one signed for "
        "another key and copied here)");
  }
  return value;
}

bool SignedStore::open_or_skip(KeyValue& kv) {
  std::string refusal;
  if (auto value = open(kv.key, kv.value, &refusal)) {
    kv.value = std::move(*value);
    return true;
  }
  // A counter (add() writes decimal integers unsigned) is skipped without a word: listing or
  // watching a prefix that holds one is normal, and it carries nothing to believe.
  if (!kv.value.empty() &&
      std::all_of(kv.value.begin(), kv.value.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!reported_.insert(kv.key).second) return false;
  }
  // Outside the lock: the callback may call back into this store.
  if (on_skip_) {
    on_skip_(kv.key, refusal);
  } else {
    spdlog::warn("{}; skipped", refusal);
  }
  return false;
}

int64_t SignedStore::set(const std::string& key, const std::string& value, LeaseId lease) {
  return inner_->set(key, seal(key, value), lease);
}

std::optional<KeyValue> SignedStore::get(const std::string& key) {
  auto kv = inner_->get(key);
  if (!kv) return kv;
  std::string refusal;
  auto value = open(key, kv->value, &refusal);
  if (!value) TESSEL_THROW(MembershipError, "{}", refusal);
  kv->value = std::move(*value);
  return kv;
}

std::optional<int64_t> SignedStore::compare_and_set(const std::string& key,
                                                    int64_t expected_revision,
                                                    const std::string& value, LeaseId lease) {
  return inner_->compare_and_set(key, expected_revision, seal(key, value), lease);
}

int64_t SignedStore::add(const std::string& key, int64_t delta) {
  // Unsigned on purpose: see the header.
  return inner_->add(key, delta);
}

bool SignedStore::erase(const std::string& key) {
  return inner_->erase(key);
}

std::vector<KeyValue> SignedStore::list(const std::string& prefix) {
  std::vector<KeyValue> verified;
  for (auto& kv : inner_->list(prefix)) {
    if (open_or_skip(kv)) verified.push_back(std::move(kv));
  }
  return verified;
}

int64_t SignedStore::revision() {
  return inner_->revision();
}

void SignedStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  inner_->wait(keys, timeout);
}

WatchResult SignedStore::watch(const std::string& prefix, int64_t after,
                               std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    WatchResult got = inner_->watch(prefix, after, timeout);
    WatchResult result{{}, got.revision};
    for (auto& e : got.events) {
      // An erase carries no value to verify.
      if (e.kind == WatchEvent::Kind::erase || open_or_skip(e.kv)) {
        result.events.push_back(std::move(e));
      }
    }
    // Only skipped events: the caller asked to wait for the first one, so keep waiting from past
    // them (an empty result means nothing came in time).
    timeout =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (got.events.empty() || !result.events.empty() || timeout.count() <= 0) return result;
    after = result.revision;
  }
}

LeaseId SignedStore::grant_lease(std::chrono::milliseconds ttl) {
  return inner_->grant_lease(ttl);
}

void SignedStore::keep_alive(LeaseId lease) {
  inner_->keep_alive(lease);
}

void SignedStore::revoke(LeaseId lease) {
  inner_->revoke(lease);
}

}  // namespace tessel::comm
