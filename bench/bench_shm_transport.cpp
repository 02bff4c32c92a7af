// Shared memory against TCP loopback between processes of one host: the Communicator with
// TransportOptions::shared_memory on (ShmChannel rings, comm/shm_transport.h) and off (Gloo's TCP
// pairs), in the same processes, side by side (see bench/README.md; issue 19, point 4).
//
//   p2p        2 processes, ping-pong of one message each way, 4 KiB .. 64 MiB. One-way time =
//              round trip / 2; bandwidth = bytes / one-way time; latency = one-way time of the
//              smallest size.
//   all-reduce `--nproc` processes (default 4), all_reduce_sum of `--mib` MiB of floats (default
//              64); rank 0's wall time after a barrier. Bus bandwidth = 2(n-1)/n * bytes / time.
//
// Each measurement alternates the two transports round by round (`--rounds`, default 7), so a
// change in machine load hits both alike; the tables give medians over rounds and the ratio
// shm/tcp of the medians. Every p2p round repeats its ping-pong until it took >= 20 ms (at least
// twice). The processes are forked before any communicator exists (a forked copy of Gloo's I/O
// thread would not survive).
//
// Usage: bench_shm_transport [--rounds 7] [--nproc 4] [--mib 64] [--ring-kib 1024]
// Last line: one JSON object
//   {"shm_vs_tcp_bw_1mib": ..., "shm_vs_tcp_allreduce_64mib": ..., ...}
// where shm_vs_tcp_bw_1mib = p2p bandwidth ratio at 1 MiB and shm_vs_tcp_allreduce_64mib =
// all-reduce time ratio tcp/shm (both > 1 when shared memory is faster).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/comm/store.h"
#include "tessel/process/fork_children.h"

namespace {

using Clock = std::chrono::steady_clock;
using tessel::comm::Communicator;
using tessel::comm::TransportOptions;

struct Args {
  int rounds = 7;
  int nproc = 4;
  double mib = 64;
  size_t ring_kib = 1024;
};

[[noreturn]] void usage() {
  std::fprintf(
      stderr, "usage: bench_shm_transport [--rounds 7] [--nproc 4] [--mib 64] [--ring-kib 1024]\n");
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage();
    const char* v = argv[++i];
    if (k == "--rounds") {
      a.rounds = std::atoi(v);
    } else if (k == "--nproc") {
      a.nproc = std::atoi(v);
    } else if (k == "--mib") {
      a.mib = std::atof(v);
    } else if (k == "--ring-kib") {
      a.ring_kib = size_t(std::atol(v));
    } else {
      usage();
    }
  }
  if (a.rounds < 1 || a.nproc < 2 || a.mib <= 0 || a.ring_kib < 4) usage();
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

tessel::comm::StoreOptions store_of(const std::string& dir, int64_t generation) {
  return tessel::comm::StoreOptions{dir, "bench-shm", generation, std::chrono::milliseconds(60000)};
}

TransportOptions transport(bool shm, const Args& a) {
  TransportOptions t;
  t.shared_memory = shm;
  t.shm_ring_bytes = a.ring_kib << 10;
  return t;
}

// Both transports, in the same processes: [0] shared memory, [1] TCP.
std::vector<std::unique_ptr<Communicator>> connect_both(const std::string& dir, int64_t gen,
                                                        int rank, int n, const Args& a) {
  std::vector<std::unique_ptr<Communicator>> c;
  c.push_back(Communicator::connect(store_of(dir, gen), "shm", rank, n,
                                    std::chrono::milliseconds(60000), transport(true, a)));
  c.push_back(Communicator::connect(store_of(dir, gen), "tcp", rank, n,
                                    std::chrono::milliseconds(60000), transport(false, a)));
  if (n > 1 &&
      (!c[0]->shares_memory_with((rank + 1) % n) || c[1]->shares_memory_with((rank + 1) % n))) {
    throw std::runtime_error("the shm communicator does not share memory (or the tcp one does)");
  }
  return c;
}

const std::vector<size_t> kSizes = {size_t(4) << 10,   size_t(16) << 10, size_t(64) << 10,
                                    size_t(256) << 10, size_t(1) << 20,  size_t(4) << 20,
                                    size_t(16) << 20,  size_t(64) << 20};

int p2p_worker(const Args& a, const std::string& dir, int rank, const std::string& result) {
  auto comms = connect_both(dir, 0, rank, 2, a);
  std::vector<unsigned char> buf(kSizes.back(), uint8_t(rank + 1));
  const int peer = 1 - rank;
  // Seconds one way, per [size][transport][round].
  std::vector<std::vector<std::vector<double>>> t(
      kSizes.size(), std::vector<std::vector<double>>(2, std::vector<double>()));
  auto ping_pong = [&](Communicator& c, size_t bytes) {
    if (rank == 0) {
      c.send(buf.data(), bytes, peer, 1).wait();
      c.recv(buf.data(), bytes, peer, 2).wait();
    } else {
      c.recv(buf.data(), bytes, peer, 1).wait();
      c.send(buf.data(), bytes, peer, 2).wait();
    }
  };
  for (size_t s = 0; s < kSizes.size(); ++s) {
    for (int w = 0; w < 2; ++w) ping_pong(*comms[size_t(w)], kSizes[s]);  // warm-up
    for (int round = 0; round < a.rounds; ++round) {
      for (int w = 0; w < 2; ++w) {
        Communicator& c = *comms[size_t(w)];
        c.barrier();
        // Rank 0 decides how many ping-pongs (>= 2, >= 20 ms) and tells rank 1 by a zero-byte
        // message after each: 1 = another one, 0 = done.
        const auto t0 = Clock::now();
        int iterations = 0;
        for (;;) {
          ping_pong(c, kSizes[s]);
          ++iterations;
          uint8_t more = 0;
          if (rank == 0) {
            more = iterations < 2 || Clock::now() - t0 < std::chrono::milliseconds(20);
            c.send(&more, 1, peer, 3).wait();
          } else {
            c.recv(&more, 1, peer, 3).wait();
          }
          if (!more) break;
        }
        const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        t[s][size_t(w)].push_back(secs / iterations / 2);
      }
    }
  }
  if (rank != 0) return 0;
  std::printf("p2p between 2 processes (ping-pong, one-way), %d rounds, ring %zu KiB, medians\n",
              a.rounds, a.ring_kib);
  std::printf("%10s %12s %12s %12s %12s %10s\n", "bytes", "shm us", "tcp us", "shm GB/s",
              "tcp GB/s", "shm/tcp");
  std::ofstream out(result);
  for (size_t s = 0; s < kSizes.size(); ++s) {
    const double shm = median(t[s][0]), tcp = median(t[s][1]);
    const double gbs_shm = double(kSizes[s]) / shm / 1e9, gbs_tcp = double(kSizes[s]) / tcp / 1e9;
    std::printf("%10zu %12.1f %12.1f %12.3f %12.3f %10.2f\n", kSizes[s], shm * 1e6, tcp * 1e6,
                gbs_shm, gbs_tcp, tcp / shm);
    out << kSizes[s] << " " << shm << " " << tcp << "\n";
  }
  std::fflush(stdout);
  return 0;
}

int allreduce_worker(const Args& a, const std::string& dir, int rank, const std::string& result) {
  const int n = a.nproc;
  auto comms = connect_both(dir, 1, rank, n, a);
  if (!comms[0]->collectives_share_memory()) throw std::runtime_error("collectives not on shm");
  const size_t count = size_t(a.mib * 1024 * 1024) / sizeof(float);
  // Small values: a few dozen doublings stay far from overflow and denormals.
  std::vector<float> buf(count, 1.0f / 1024);
  std::vector<std::vector<double>> secs(2);
  for (int w = 0; w < 2; ++w) comms[size_t(w)]->all_reduce_sum(buf.data(), count);  // warm-up
  for (int round = 0; round < a.rounds; ++round) {
    for (int w = 0; w < 2; ++w) {
      Communicator& c = *comms[size_t(w)];
      c.barrier();
      const auto t0 = Clock::now();
      c.all_reduce_sum(buf.data(), count);
      secs[size_t(w)].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  comms[1]->barrier();
  if (rank != 0) return 0;
  const double bytes = double(count) * sizeof(float);
  const double factor = 2.0 * (n - 1) / n;
  std::printf("\nall_reduce_sum of %.1f MiB over %d processes, %d rounds, medians (best)\n",
              bytes / (1 << 20), n, a.rounds);
  std::printf("%10s %12s %12s %14s\n", "transport", "median ms", "best ms", "busbw GB/s");
  const char* names[2] = {"shm", "tcp"};
  for (int w = 0; w < 2; ++w) {
    const double med = median(secs[size_t(w)]);
    const double best = *std::min_element(secs[size_t(w)].begin(), secs[size_t(w)].end());
    std::printf("%10s %12.2f %12.2f %14.3f\n", names[w], med * 1e3, best * 1e3,
                factor * bytes / med / 1e9);
  }
  std::printf("tcp/shm time (medians): %.2f\n", median(secs[1]) / median(secs[0]));
  std::ofstream(result) << median(secs[0]) << " " << median(secs[1]) << "\n";
  std::fflush(stdout);
  return 0;
}

bool run(int n, const std::function<int(int)>& body, const char* what) {
  tessel::process::ForkOptions how;
  how.deadline = std::chrono::hours(1);
  how.stop_on_failure = true;
  const auto outcomes = tessel::process::run_forked(n, body, how);
  bool ok = true;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].ok()) continue;
    std::fprintf(stderr, "bench_shm_transport %s rank %zu: %s\n", what, r,
                 outcomes[r].describe().c_str());
    ok = false;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  char tmpl[] = "/tmp/tessel-bench-shm-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::perror("bench_shm_transport: mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  const std::string p2p_result = dir + "/p2p.txt", ar_result = dir + "/allreduce.txt";
  int failed = 0;
  try {
    if (!run(
            2, [&](int r) { return p2p_worker(a, dir, r, p2p_result); }, "p2p"))
      failed = 1;
    if (!failed &&
        !run(
            a.nproc, [&](int r) { return allreduce_worker(a, dir, r, ar_result); }, "all-reduce"))
      failed = 1;
    if (!failed) {
      std::ifstream p2p(p2p_result);
      double bw_1mib = 0, lat_shm = 0, lat_tcp = 0, bw_shm_64 = 0, bw_tcp_64 = 0;
      size_t bytes = 0;
      double shm = 0, tcp = 0;
      bool first = true;
      while (p2p >> bytes >> shm >> tcp) {
        if (first) {
          lat_shm = shm;
          lat_tcp = tcp;
          first = false;
        }
        if (bytes == (size_t(1) << 20)) bw_1mib = tcp / shm;
        if (bytes == (size_t(64) << 20)) {
          bw_shm_64 = double(bytes) / shm / 1e9;
          bw_tcp_64 = double(bytes) / tcp / 1e9;
        }
      }
      double ar_shm = 0, ar_tcp = 0;
      std::ifstream(ar_result) >> ar_shm >> ar_tcp;
      std::printf(
          "{\"shm_vs_tcp_bw_1mib\": %.3f, \"shm_vs_tcp_allreduce_64mib\": %.3f, "
          "\"shm_latency_4kib_us\": %.2f, \"tcp_latency_4kib_us\": %.2f, "
          "\"shm_bw_64mib_gbps\": %.3f, \"tcp_bw_64mib_gbps\": %.3f, \"allreduce_shm_ms\": %.2f, "
          "\"allreduce_tcp_ms\": %.2f, \"allreduce_mib\": %.1f, \"nproc\": %d, \"rounds\": %d}\n",
          bw_1mib, ar_shm > 0 ? ar_tcp / ar_shm : 0.0, lat_shm * 1e6, lat_tcp * 1e6, bw_shm_64,
          bw_tcp_64, ar_shm * 1e3, ar_tcp * 1e3, a.mib, a.nproc, a.rounds);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_shm_transport: %s\n", e.what());
    failed = 1;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return failed;
}
