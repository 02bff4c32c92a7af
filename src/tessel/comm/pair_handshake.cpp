#include "tessel/comm/pair_handshake.h"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <memory>

#include "tessel/comm/comm_state.h"
#include "tessel/comm/signed_store.h"
#include "tessel/core/check.h"

namespace tessel::comm::detail {
namespace {

constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;  // HMAC-SHA256
constexpr uint32_t kNonceTag = 0;
constexpr uint32_t kProofTag = 1;

std::string fresh_nonce() {
  std::string nonce(kNonceBytes, '\0');
  TESSEL_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), int(nonce.size())) == 1,
               IoError,
               "the pair handshake cannot draw a random nonce: OpenSSL's RAND_bytes failed");
  return nonce;
}

// "rank 2 (listening at <address>)", or just "rank 2" when its address is not known.
std::string peer_name(int peer, const std::vector<std::string>& addresses) {
  if (size_t(peer) < addresses.size() && !addresses[size_t(peer)].empty()) {
    return fmt::format("rank {} (listening at {})", peer, addresses[size_t(peer)]);
  }
  return fmt::format("rank {}", peer);
}

// Steps 1 and 2 of the protocol (see the header): fills nonces[p] and proofs[p] from every peer p.
void exchange(CommState& s, std::string_view secret, std::string_view group_prefix,
              std::string& my_nonce, std::vector<std::string>& nonces,
              std::vector<std::string>& proofs, Clock::time_point deadline) {
  const auto peers = size_t(s.size);
  const uint64_t nonce_slot = make_slot(kHandshakeSlotPrefix, kNonceTag);
  const uint64_t proof_slot = make_slot(kHandshakeSlotPrefix, kProofTag);
  std::vector<std::string> my_proofs(peers);
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> nonce_in(peers), proof_in(peers),
      nonce_out(peers), proof_out(peers);
  // Every receive is posted before anything is waited for, so no order of waits can deadlock.
  for (int p = 0; p < s.size; ++p) {
    if (p == s.rank) continue;
    nonce_in[p] = s.context->createUnboundBuffer(nonces[p].data(), kNonceBytes);
    nonce_in[p]->recv(p, nonce_slot);
    proof_in[p] = s.context->createUnboundBuffer(proofs[p].data(), kProofBytes);
    proof_in[p]->recv(p, proof_slot);
    nonce_out[p] = s.context->createUnboundBuffer(my_nonce.data(), kNonceBytes);
    nonce_out[p]->send(p, nonce_slot);
  }
  for (int p = 0; p < s.size; ++p) {
    if (p == s.rank) continue;
    s.wait_recv(*nonce_in[p], {p}, deadline);
    my_proofs[p] = pair_proof(secret, group_prefix, s.rank, p, nonces[p]);
    proof_out[p] = s.context->createUnboundBuffer(my_proofs[p].data(), kProofBytes);
    proof_out[p]->send(p, proof_slot);
  }
  for (int p = 0; p < s.size; ++p) {
    if (p == s.rank) continue;
    s.wait_recv(*proof_in[p], {p}, deadline);
    s.wait_send(*nonce_out[p], {p}, deadline);
    s.wait_send(*proof_out[p], {p}, deadline);
  }
}

}  // namespace

std::string pair_proof(std::string_view secret, std::string_view group_prefix, int sender,
                       int receiver, std::string_view receiver_nonce) {
  // NUL-separated fields: the prefix holds no NUL, the ranks are decimal, the nonce is last.
  std::string message = "tessel-pair-v1";
  message += '\0';
  message += group_prefix;
  message += '\0';
  message += std::to_string(sender);
  message += '\0';
  message += std::to_string(receiver);
  message += '\0';
  message += receiver_nonce;
  return hmac_sha256(secret, message);
}

void prove_membership(CommState& s, std::string_view secret, std::string_view group_prefix,
                      const std::vector<std::string>& peer_addresses,
                      std::chrono::milliseconds timeout) {
  const char* op = "connect";
  const auto deadline = Clock::now() + timeout;
  std::string my_nonce = fresh_nonce();
  std::vector<std::string> nonces(size_t(s.size), std::string(kNonceBytes, '\0'));
  std::vector<std::string> proofs(size_t(s.size), std::string(kProofBytes, '\0'));
  try {
    s.guarded(op, -1, timeout,
              [&] { exchange(s, secret, group_prefix, my_nonce, nonces, proofs, deadline); });
  } catch (const TimeoutError& e) {
    throw TimeoutError(std::string(e.what()) +
                       " (in the membership handshake, which every process of a job with a "
                       "secret runs right after connecting: a peer started without the job's "
                       "secret, no --token-file, never answers it)");
  }

  // Step 3, after the whole exchange: every peer has what it needs to reach its own verdict.
  std::string refused;
  int count = 0;
  for (int p = 0; p < s.size; ++p) {
    if (p == s.rank) continue;
    const std::string expected = pair_proof(secret, group_prefix, p, s.rank, my_nonce);
    if (CRYPTO_memcmp(expected.data(), proofs[size_t(p)].data(), kProofBytes) != 0) {
      refused += (count++ == 0 ? "" : ", ") + peer_name(p, peer_addresses);
    }
  }
  if (count > 0) {
    TESSEL_THROW(MembershipError,
                 "{} failed: {} {} did not prove {} this job's secret in the pair handshake: "
                 "another secret was used (another job's process, or one given another token "
                 "file); every process of the job needs the same secret: the same token file "
                 "(--token-file) on every host",
                 s.where(op, -1), count == 1 ? "peer" : "peers", refused,
                 count == 1 ? "it holds" : "they hold");
  }
}

}  // namespace tessel::comm::detail
