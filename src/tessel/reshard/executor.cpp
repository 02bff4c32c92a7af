#include "tessel/reshard/executor.h"

#include <sys/uio.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>

#include "tessel/core/check.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/tensor/region_runs.h"

namespace tessel::reshard {

std::unique_ptr<comm::Communicator> connect_transition_world(
    const comm::StoreOptions& store, const TransferPlan& plan, int process,
    std::chrono::milliseconds timeout, const comm::TransportOptions& transport) {
  return comm::Communicator::connect(store, kTransitionGroup, plan.union_rank(process),
                                     int(plan.processes().size()), timeout, transport);
}

std::vector<std::unique_ptr<comm::Communicator>> connect_transition_lanes(
    const comm::StoreOptions& store, const TransferPlan& plan, int process, int lanes,
    std::chrono::milliseconds timeout, const comm::TransportOptions& transport) {
  std::vector<std::unique_ptr<comm::Communicator>> out;
  for (int k = 1; k <= lanes; ++k)
    out.push_back(comm::Communicator::connect(store, fmt::format("{}.lane{}", kTransitionGroup, k),
                                              plan.union_rank(process),
                                              int(plan.processes().size()), timeout, transport));
  return out;
}

namespace {

// Transfers at least this large (16 KiB) and contiguous on both sides are sent without staging
// (the tiny test models have tensors on both sides of it, so tests run both paths).
constexpr int64_t kDirectMinFloats = 4096;

// The region must lie inside a buffer of `size` floats.
void check_region(const StridedRegion& r, size_t size, const char* side, int rank, int buffer) {
  TESSEL_CHECK(r.end() <= int64_t(size), InvalidArgumentError,
               "{} rank {} buffer {} has {} floats but the plan reaches element {}", side, rank,
               buffer, size, r.end() - 1);
}

template <typename Span>
void check_buffers(const std::vector<Span>& given, const std::vector<int64_t>& want,
                   const char* side, int rank) {
  TESSEL_CHECK(given.size() == want.size(), InvalidArgumentError,
               "{} rank {} has {} state buffers in the plan but {} were given", side, rank,
               want.size(), given.size());
  for (size_t b = 0; b < want.size(); ++b) {
    TESSEL_CHECK(int64_t(given[b].size()) >= want[b], InvalidArgumentError,
                 "{} rank {} buffer {} needs {} floats but has {}", side, rank, b, want[b],
                 given[b].size());
  }
}

void copy_kept(const TransferPlan& plan, int new_rank,
               const std::vector<std::span<const float>>& old_buffers,
               const std::vector<std::span<float>>& new_buffers) {
  for (size_t b = 0; b < new_buffers.size(); ++b) {
    const int ob = plan.kept_from(new_rank, int(b));
    if (ob < 0) continue;
    const float* src = old_buffers[size_t(ob)].data();
    float* dst = new_buffers[b].data();
    const size_t n = size_t(plan.new_buffer_sizes(new_rank)[b]);
    if (src == dst || n == 0) continue;  // the caller keeps the old buffer itself
    TESSEL_CHECK(src + n <= dst || dst + n <= src, InvalidArgumentError,
                 "new buffer {} of rank {} overlaps old buffer {} without being it", b, new_rank,
                 ob);
    std::memcpy(dst, src, n * sizeof(float));
  }
}

void run_local(const TransferPlan& plan, int process,
               const std::vector<std::span<const float>>& old_buffers,
               const std::vector<std::span<float>>& new_buffers) {
  for (int t : plan.local_transfers(process)) {
    const Transfer& tr = plan.transfers()[size_t(t)];
    const auto& src = old_buffers[size_t(tr.src_buffer)];
    const auto& dst = new_buffers[size_t(tr.dst_buffer)];
    check_region(tr.src, src.size(), "old", tr.src_rank, tr.src_buffer);
    check_region(tr.dst, dst.size(), "new", tr.dst_rank, tr.dst_buffer);
    copy_region(src, tr.src, dst, tr.dst);
  }
}

// Cross-memory attach: a receiver reads a same-host sender's old buffers directly.
struct DirectPeers {
  bool enabled = false;
  std::vector<int64_t> pid;                  // by union rank
  std::vector<std::vector<uint64_t>> bases;  // by union rank: its old buffers' addresses
};

// Consumes `bytes` from the front of v[i..]: the first segments shrink, emptied ones are skipped.
void advance(std::vector<iovec>& v, size_t& i, size_t bytes) {
  while (bytes > 0) {
    const size_t n = std::min(bytes, v[i].iov_len);
    v[i].iov_base = static_cast<char*>(v[i].iov_base) + n;
    v[i].iov_len -= n;
    bytes -= n;
    if (v[i].iov_len == 0) ++i;
  }
}

// Reads `local` from `remote` of process `pid` (equal total lengths), resuming after short reads.
void read_remote(pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote,
                 int src_process) {
  size_t li = 0, ri = 0;
  while (li < local.size()) {
    const size_t ln = std::min<size_t>(local.size() - li, IOV_MAX);
    const size_t rn = std::min<size_t>(remote.size() - ri, IOV_MAX);
    const ssize_t got = ::process_vm_readv(pid, &local[li], ln, &remote[ri], rn, 0);
    TESSEL_CHECK(got >= 0, PeerLostError,
                 "reading the state of process {} (pid {}) directly failed: {} (did it die?)",
                 src_process, pid, std::strerror(errno));
    TESSEL_CHECK(got > 0, PeerLostError, "process {} (pid {}) returned no state", src_process, pid);
    advance(local, li, size_t(got));
    advance(remote, ri, size_t(got));
  }
}

// Whether message m goes by cross-memory attach.
bool read_directly(const TransferPlan& plan, const DirectPeers& peers, const Message& m) {
  return peers.enabled && plan.host_of(m.src_process) == plan.host_of(m.dst_process);
}

// Exchanges pids and old buffer addresses and probes whether this process can read every
// same-host sender it receives from; the world agrees (all must succeed) or nobody reads
// directly. Collective over `world`.
DirectPeers agree_on_direct_reads(const TransferPlan& plan, int process, comm::Communicator& world,
                                  const ProcessBuffers& buffers, bool wanted) {
  DirectPeers peers;
  int64_t failures = wanted ? 0 : 1;
  world.all_reduce_sum(&failures, 1);
  if (failures > 0) return peers;  // somebody does not want it: skip the exchange
  const int U = world.size();
  const int64_t mine = int64_t(::getpid());
  peers.pid.resize(size_t(U));
  world.all_gather(&mine, 1, peers.pid.data());
  std::vector<size_t> counts(size_t(U), 0);
  for (int u = 0; u < U; ++u) {
    const int old_rank = plan.old_rank_of(plan.processes()[size_t(u)]);
    if (old_rank >= 0) counts[size_t(u)] = plan.old_buffer_sizes(old_rank).size();
  }
  std::vector<int64_t> my_bases;
  for (const auto& b : buffers.old_buffers) my_bases.push_back(int64_t(uintptr_t(b.data())));
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::vector<int64_t> all(total);
  world.all_gather_v(my_bases.data(), counts, all.data());
  peers.bases.resize(size_t(U));
  for (size_t u = 0, at = 0; u < size_t(U); at += counts[u], ++u)
    for (size_t k = 0; k < counts[u]; ++k) peers.bases[u].push_back(uint64_t(all[at + k]));
  // Probe one float of each same-host sender this process receives from.
  for (const Message& m : plan.messages()) {
    if (m.dst_process != process || plan.host_of(m.src_process) != plan.host_of(process)) continue;
    const int u = plan.union_rank(m.src_process);
    const Transfer& tr = plan.transfers()[size_t(m.transfers.front())];
    float probe = 0;
    iovec l{&probe, sizeof probe};
    iovec r{reinterpret_cast<void*>(peers.bases[size_t(u)][size_t(tr.src_buffer)] +
                                    uint64_t(tr.src.offset) * sizeof(float)),
            sizeof probe};
    if (::process_vm_readv(pid_t(peers.pid[size_t(u)]), &l, 1, &r, 1, 0) != ssize_t(sizeof probe))
      ++failures;
  }
  world.all_reduce_sum(&failures, 1);
  peers.enabled = failures == 0;
  return peers;
}

// Copies message m's transfers from the sender's old buffers into this process's new buffers.
void read_message(const TransferPlan& plan, const DirectPeers& peers, const Message& m,
                  const std::vector<std::span<float>>& new_buffers) {
  const size_t u = size_t(plan.union_rank(m.src_process));
  std::vector<iovec> local, remote;
  for (int t : m.transfers) {
    const Transfer& tr = plan.transfers()[size_t(t)];
    const auto& buf = new_buffers.at(size_t(tr.dst_buffer));
    check_region(tr.dst, buf.size(), "new", tr.dst_rank, tr.dst_buffer);
    const uint64_t base = peers.bases[u].at(size_t(tr.src_buffer));
    for_each_run(tr.src, tr.dst, [&](int64_t so, int64_t dof, int64_t n) {
      local.push_back({buf.data() + dof, size_t(n) * sizeof(float)});
      remote.push_back({reinterpret_cast<void*>(base + uint64_t(so) * sizeof(float)),
                        size_t(n) * sizeof(float)});
    });
  }
  read_remote(pid_t(peers.pid[u]), local, remote, m.src_process);
}

}  // namespace

void pack_message(const TransferPlan& plan, const Message& m,
                  const std::vector<std::span<const float>>& old_buffers, float* out) {
  for (int t : m.transfers) {
    const Transfer& tr = plan.transfers()[size_t(t)];
    const auto& buf = old_buffers.at(size_t(tr.src_buffer));
    check_region(tr.src, buf.size(), "old", tr.src_rank, tr.src_buffer);
    gather(buf, tr.src, std::span(out, size_t(tr.numel())));
    out += tr.numel();
  }
}

void unpack_message(const TransferPlan& plan, const Message& m, const float* in,
                    const std::vector<std::span<float>>& new_buffers) {
  for (int t : m.transfers) {
    const Transfer& tr = plan.transfers()[size_t(t)];
    const auto& buf = new_buffers.at(size_t(tr.dst_buffer));
    check_region(tr.dst, buf.size(), "new", tr.dst_rank, tr.dst_buffer);
    scatter(std::span(in, size_t(tr.numel())), tr.dst, buf);
    in += tr.numel();
  }
}

ExecuteStats execute(const TransferPlan& plan, int process, comm::Communicator& world,
                     const ProcessBuffers& buffers, const ExecuteOptions& options) {
  ExecuteStats stats;
  const int me = plan.union_rank(process);
  TESSEL_CHECK(world.size() == int(plan.processes().size()) && world.rank() == me,
               InvalidArgumentError,
               "process {} is rank {} of the plan's union world of {} processes, but the "
               "communicator '{}' makes it rank {} of {}; connect it with "
               "connect_transition_world",
               process, me, plan.processes().size(), world.name(), world.rank(), world.size());
  const int old_rank = plan.old_rank_of(process), new_rank = plan.new_rank_of(process);
  if (old_rank >= 0) {
    check_buffers(buffers.old_buffers, plan.old_buffer_sizes(old_rank), "old", old_rank);
  } else {
    TESSEL_CHECK(buffers.old_buffers.empty(), InvalidArgumentError,
                 "process {} joins (it has no old rank) but {} old buffers were given", process,
                 buffers.old_buffers.size());
  }
  if (new_rank >= 0) {
    check_buffers(buffers.new_buffers, plan.new_buffer_sizes(new_rank), "new", new_rank);
  } else {
    TESSEL_CHECK(buffers.new_buffers.empty(), InvalidArgumentError,
                 "process {} leaves (it has no new rank) but {} new buffers were given", process,
                 buffers.new_buffers.size());
  }

  // Transfers that are one contiguous run on both sides (whole tensors of flat buffers, row
  // blocks) go straight from the old buffer to the new one, without staging copies: large ones
  // dominate a move (a joining rank receiving whole replicas). The rest of each message is packed
  // into one staging buffer per peer. Both sides walk the same message in the same order: first
  // the packed part (when it is not empty), then each direct transfer; messages of one peer pair
  // match in posting order.
  auto direct = [&](const Transfer& tr) {
    return tr.numel() >= kDirectMinFloats && tr.src.contiguous() && tr.dst.contiguous();
  };
  auto packed_numel = [&](const Message& m) {
    int64_t n = 0;
    for (int t : m.transfers)
      if (!direct(plan.transfers()[size_t(t)])) n += plan.transfers()[size_t(t)].numel();
    return n;
  };

  for (const comm::Communicator* lane : options.lanes) {
    TESSEL_CHECK(lane != nullptr && lane->size() == world.size() && lane->rank() == me,
                 InvalidArgumentError,
                 "a lane of the union world must have its size {} and this process's rank {}",
                 world.size(), me);
  }
  // Which communicator carries each direct transfer of a message: the least loaded so far (the
  // packed part rides on the world), the same choice on both sides.
  auto lanes_of = [&](const Message& m) {
    std::vector<comm::Communicator*> on;
    std::vector<int64_t> load(options.lanes.size() + 1, 0);
    load[0] = packed_numel(m);
    for (int t : m.transfers) {
      const Transfer& tr = plan.transfers()[size_t(t)];
      if (!direct(tr)) continue;
      const size_t k = size_t(std::min_element(load.begin(), load.end()) - load.begin());
      load[k] += tr.numel();
      on.push_back(k == 0 ? &world : options.lanes[k - 1]);
    }
    return on;
  };

  // 0. Same-host messages are read straight out of the sender's memory when everyone can.
  const DirectPeers peers =
      agree_on_direct_reads(plan, process, world, buffers, options.same_host_direct);

  // 1. Receives first, so every send finds its receive posted.
  std::vector<const Message*> incoming;
  std::vector<const Message*> direct_reads;
  // Message buffers are left uninitialised: every float is written by pack or the network.
  std::vector<std::unique_ptr<float[]>> inbox;
  std::vector<comm::Request> recvs, direct_recvs, sends;
  for (const Message& m : plan.messages()) {
    if (m.dst_process != process) continue;
    if (read_directly(plan, peers, m)) {
      direct_reads.push_back(&m);
      continue;
    }
    const int peer = plan.union_rank(m.src_process);
    incoming.push_back(&m);
    const int64_t n = packed_numel(m);
    inbox.emplace_back(n > 0 ? new float[size_t(n)] : nullptr);
    if (n > 0)
      recvs.push_back(world.recv(inbox.back().get(), size_t(n) * sizeof(float), peer, kReshardTag));
    const auto on = lanes_of(m);
    size_t d = 0;
    for (int t : m.transfers) {
      const Transfer& tr = plan.transfers()[size_t(t)];
      if (!direct(tr)) continue;
      const auto& buf = buffers.new_buffers.at(size_t(tr.dst_buffer));
      check_region(tr.dst, buf.size(), "new", tr.dst_rank, tr.dst_buffer);
      direct_recvs.push_back(on[d++]->recv(buf.data() + tr.dst.offset,
                                           size_t(tr.numel()) * sizeof(float), peer, kReshardTag));
    }
  }
  // 2. Pack and send.
  std::vector<std::unique_ptr<float[]>> outbox;
  for (const Message& m : plan.messages()) {
    if (m.src_process != process || read_directly(plan, peers, m)) continue;
    const int peer = plan.union_rank(m.dst_process);
    const int64_t n = packed_numel(m);
    if (n > 0) {
      outbox.emplace_back(new float[size_t(n)]);
      float* out = outbox.back().get();
      for (int t : m.transfers) {
        const Transfer& tr = plan.transfers()[size_t(t)];
        if (direct(tr)) continue;
        const auto& buf = buffers.old_buffers.at(size_t(tr.src_buffer));
        check_region(tr.src, buf.size(), "old", tr.src_rank, tr.src_buffer);
        gather(buf, tr.src, std::span(out, size_t(tr.numel())));
        out += tr.numel();
      }
      sends.push_back(
          world.send(outbox.back().get(), size_t(n) * sizeof(float), peer, kReshardTag));
    }
    const auto on = lanes_of(m);
    size_t d = 0;
    for (int t : m.transfers) {
      const Transfer& tr = plan.transfers()[size_t(t)];
      if (!direct(tr)) continue;
      const auto& buf = buffers.old_buffers.at(size_t(tr.src_buffer));
      check_region(tr.src, buf.size(), "old", tr.src_rank, tr.src_buffer);
      sends.push_back(on[d++]->send(buf.data() + tr.src.offset, size_t(tr.numel()) * sizeof(float),
                                    peer, kReshardTag));
    }
  }
  // 3. Local work while the network runs.
  if (new_rank >= 0) {
    run_local(plan, process, buffers.old_buffers, buffers.new_buffers);
    copy_kept(plan, new_rank, buffers.old_buffers, buffers.new_buffers);
  }
  // 4. Read directly, receive, then make sure our sends are out.
  for (const Message* m : direct_reads) {
    read_message(plan, peers, *m, buffers.new_buffers);
    stats.bytes_read_directly += m->bytes();
  }
  for (const Message* m : incoming) stats.bytes_received += m->bytes();
  for (size_t i = 0, r = 0; i < incoming.size(); ++i) {
    if (!inbox[i]) continue;
    recvs[r++].wait();
    const float* in = inbox[i].get();
    for (int t : incoming[i]->transfers) {
      const Transfer& tr = plan.transfers()[size_t(t)];
      if (direct(tr)) continue;
      const auto& buf = buffers.new_buffers.at(size_t(tr.dst_buffer));
      check_region(tr.dst, buf.size(), "new", tr.dst_rank, tr.dst_buffer);
      scatter(std::span(in, size_t(tr.numel())), tr.dst, buf);
      in += tr.numel();
    }
  }
  for (auto& r : direct_recvs) r.wait();
  for (auto& s : sends) s.wait();
  // 5. Nobody leaves (or frees its old buffers) while a peer may still read from its connection
  // or its memory.
  world.barrier();
  return stats;
}

layout::ScalarState share_scalar_state(const TransferPlan& plan, int process,
                                       comm::Communicator& world, const layout::ScalarState* mine) {
  // The lowest old rank whose state survived holds it (every old rank holds the same).
  int old_root = 0;
  while (old_root < plan.old_world() && plan.process_of_old_rank(old_root) == TransferPlan::kLost)
    ++old_root;
  TESSEL_CHECK(old_root < plan.old_world(), InvalidArgumentError,
               "every old rank's state was lost, so no process holds the scalar state (step, "
               "data cursor) to share; take it from a checkpoint instead");
  const int root = plan.union_rank(plan.process_of_old_rank(old_root));
  const bool is_root = world.rank() == root;
  TESSEL_CHECK(!is_root || mine != nullptr, InvalidArgumentError,
               "process {} holds old rank {} (the lowest one not lost) and must provide the "
               "scalar state",
               process, old_root);
  std::vector<uint8_t> blob;
  if (is_root) blob = layout::encode(*mine);
  int64_t size = int64_t(blob.size());
  world.broadcast(&size, 1, root);
  blob.resize(size_t(size));
  world.broadcast_bytes(blob.data(), blob.size(), root);
  return layout::decode_scalar_state(blob.data(), blob.size());
}

void execute_in_memory(const TransferPlan& plan,
                       const std::vector<std::vector<std::span<const float>>>& old_by_rank,
                       const std::vector<std::vector<std::span<float>>>& new_by_rank) {
  TESSEL_CHECK(
      int(old_by_rank.size()) == plan.old_world() && int(new_by_rank.size()) == plan.new_world(),
      InvalidArgumentError,
      "the plan moves {} old ranks to {} new ranks but buffers for {} and {} were given",
      plan.old_world(), plan.new_world(), old_by_rank.size(), new_by_rank.size());
  for (int i = 0; i < plan.old_world(); ++i) {
    if (plan.process_of_old_rank(i) != TransferPlan::kLost)
      check_buffers(old_by_rank[size_t(i)], plan.old_buffer_sizes(i), "old", i);
  }
  for (int j = 0; j < plan.new_world(); ++j)
    check_buffers(new_by_rank[size_t(j)], plan.new_buffer_sizes(j), "new", j);
  for (const Message& m : plan.messages()) {
    std::unique_ptr<float[]> staging(new float[size_t(m.numel)]);
    pack_message(plan, m, old_by_rank[size_t(plan.old_rank_of(m.src_process))], staging.get());
    unpack_message(plan, m, staging.get(), new_by_rank[size_t(plan.new_rank_of(m.dst_process))]);
  }
  for (int j = 0; j < plan.new_world(); ++j) {
    const int process = plan.process_of_new_rank(j);
    const int i = plan.old_rank_of(process);
    if (i < 0) continue;
    run_local(plan, process, old_by_rank[size_t(i)], new_by_rank[size_t(j)]);
    copy_kept(plan, j, old_by_rank[size_t(i)], new_by_rank[size_t(j)]);
  }
}

}  // namespace tessel::reshard
