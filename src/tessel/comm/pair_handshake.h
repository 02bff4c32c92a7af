// Internal: the pair handshake, by which the members of a group prove to each other that they
// hold the job's shared secret (StoreOptions::secret) before the group is used.
//
// Why. The TCP pairs carry no identity: whoever dials a published address first (with the
// sequence number the entry carries) becomes that peer, and whoever writes a rank's entry first
// is that rank -- another job's process given the same job id, or any process that can read the
// store. The control store's signed values (signed_store.h) keep foreign entries out of the
// rendezvous through etcd, but not a dialler that only read an entry, and a FileStore has no such
// check at all. So every pair proves membership on the wire, right after the full mesh connects.
// This is membership, not confidentiality: the traffic stays in clear (etcd's TLS client
// certificates protect the control channel).
//
// The protocol, with every peer p at once:
//   1. send a fresh random 16-byte nonce (RAND_bytes) and receive p's;
//   2. send HMAC-SHA256(secret, "tessel-pair-v1" | group prefix | sender rank | receiver rank |
//      p's nonce) -- the receiver's nonce, so a recorded proof is worthless in the next connect;
//      both ranks, so a proof cannot be reflected back to its sender; the group prefix (job,
//      generation, group), so it is worthless in another group -- and receive p's;
//   3. only then verify p's proof (constant time).
// Every side finishes the exchange before it verifies, so a peer with another secret cannot make
// the honest side wait: both complete the exchange and then both fail, clearly. A peer that runs
// without any secret never answers step 1: the honest side's wait ends at the timeout, with a
// hint. Every wait goes through the CommState (bounded, reachable by the watchdog and abort()).
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::comm::detail {

struct CommState;

// What `sender` sends `receiver` in step 2 (32 raw bytes).
std::string pair_proof(std::string_view secret, std::string_view group_prefix, int sender,
                       int receiver, std::string_view receiver_nonce);

// Runs the handshake with every peer of the connected group in `state`, all waits ending by
// `timeout` from now. `peer_addresses` (by rank; may be empty) names each peer in messages.
// Throws MembershipError naming the group, each peer whose proof did not verify and its address,
// and the fix; TimeoutError / PeerLostError as any operation (a timeout saying a peer may run
// without the secret).
void prove_membership(CommState& state, std::string_view secret, std::string_view group_prefix,
                      const std::vector<std::string>& peer_addresses,
                      std::chrono::milliseconds timeout);

}  // namespace tessel::comm::detail
