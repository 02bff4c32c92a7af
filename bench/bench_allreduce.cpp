// All-reduce bandwidth: tessel::comm::Communicator::all_reduce_sum against raw Gloo on the same
// buffer, in the same two processes, over loopback TCP (see bench/README.md, `scripts/bench
// parallel`).
//
// The process forks its workers before anything creates a Gloo context (a forked copy of Gloo's
// I/O threads would not survive). Each worker joins a tessel communicator and a raw Gloo context
// through one file store in a fresh temporary directory, then times, round-robin so a change in
// machine load hits every candidate alike:
//   tessel          Communicator::all_reduce_sum (ring reduce-scatter + ring all-gather)
//   gloo:ring       gloo::allreduce, AllreduceOptions with Algorithm::RING
//   gloo:bcube      gloo::allreduce, AllreduceOptions with Algorithm::BCUBE
//   gloo:AllreduceRing, gloo:AllreduceRingChunked, gloo:AllreduceHalvingDoubling
//                   the older algorithm classes (built once, run() per repeat)
// Every repeat starts after a barrier; rank 0's wall time counts. Bus bandwidth =
// 2(n-1)/n * bytes / time (the bytes each rank sends and receives in a bandwidth-optimal
// all-reduce). The best raw Gloo candidate (by median) is the reference.
//
// Usage: bench_allreduce [--mib 64] [--reps 7] [--nproc 2]
// Last line: one JSON object.
#include <unistd.h>

#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/comm/store.h"
#include "tessel/process/fork_children.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  double mib = 64;
  int reps = 7;
  int nproc = 2;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_allreduce: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--mib") {
      a.mib = std::atof(next());
    } else if (k == "--reps") {
      a.reps = std::atoi(next());
    } else if (k == "--nproc") {
      a.nproc = std::atoi(next());
    } else {
      std::fprintf(stderr, "usage: bench_allreduce [--mib 64] [--reps 7] [--nproc 2]\n");
      std::exit(2);
    }
  }
  if (a.mib <= 0 || a.reps < 1 || a.nproc < 2) {
    std::fprintf(stderr, "bench_allreduce: need --mib > 0, --reps >= 1, --nproc >= 2\n");
    std::exit(2);
  }
  return a;
}

struct Candidate {
  std::string name;
  std::function<void()> run;
  std::vector<double> seconds;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int worker(const Args& a, const std::string& dir, int rank) {
  const int n = a.nproc;
  const size_t count = size_t(a.mib * 1024 * 1024) / sizeof(float);
  const double bytes = double(count) * sizeof(float);
  tessel::comm::StoreOptions store{dir, "bench", 0, std::chrono::milliseconds(60000)};

  // TCP on both sides: this benchmark compares the ring algorithm against Gloo's, not transports
  // (bench_shm_transport measures shared memory against TCP).
  tessel::comm::TransportOptions tcp_only;
  tcp_only.shared_memory = false;
  auto comm = tessel::comm::Communicator::connect(store, "tessel", rank, n,
                                                  std::chrono::milliseconds(60000), tcp_only);

  tessel::comm::GroupStore raw_store(store, "gloo");
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, n);
  context->setTimeout(std::chrono::milliseconds(60000));
  context->connectFullMesh(raw_store.store(), device);

  // Small values: a few dozen doublings stay far from overflow and denormals.
  std::vector<float> buf(count, 1.0f / 1024);
  float* p = buf.data();
  uint32_t tag = 0;
  auto options_allreduce = [&](gloo::AllreduceOptions::Algorithm algo) {
    gloo::AllreduceOptions o(context);
    o.setOutput(p, count);
    o.setAlgorithm(algo);
    o.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    o.setTag(tag++);
    gloo::allreduce(o);
  };
  // The old algorithm classes take an int count and allocate their staging buffers up front.
  gloo::AllreduceRing<float> ring(context, {p}, int(count));
  gloo::AllreduceRingChunked<float> ring_chunked(context, {p}, int(count));
  gloo::AllreduceHalvingDoubling<float> halving(context, {p}, int(count));

  std::vector<Candidate> cands;
  cands.push_back({"tessel", [&] { comm->all_reduce_sum(p, count); }, {}});
  cands.push_back(
      {"gloo:ring", [&] { options_allreduce(gloo::AllreduceOptions::Algorithm::RING); }, {}});
  cands.push_back(
      {"gloo:bcube", [&] { options_allreduce(gloo::AllreduceOptions::Algorithm::BCUBE); }, {}});
  cands.push_back({"gloo:AllreduceRing", [&] { ring.run(); }, {}});
  cands.push_back({"gloo:AllreduceRingChunked", [&] { ring_chunked.run(); }, {}});
  cands.push_back({"gloo:AllreduceHalvingDoubling", [&] { halving.run(); }, {}});

  for (auto& c : cands) c.run();  // warm-up: first touch of the pages, socket buffers
  for (int r = 0; r < a.reps; ++r) {
    for (auto& c : cands) {
      comm->barrier();
      auto t0 = Clock::now();
      c.run();
      c.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  comm->barrier();
  if (rank != 0) return 0;

  const double factor = 2.0 * (n - 1) / n;
  auto busbw = [&](double s) { return factor * bytes / s / 1e9; };
  std::printf("all-reduce of %zu floats (%.1f MiB) over %d processes, loopback TCP, %d repeats\n",
              count, bytes / (1 << 20), n, a.reps);
  std::printf("%-32s %10s %10s %12s %12s\n", "candidate", "best ms", "median ms", "best GB/s",
              "median GB/s");
  const Candidate* best_gloo = nullptr;
  for (const auto& c : cands) {
    double best = *std::min_element(c.seconds.begin(), c.seconds.end());
    double med = median(c.seconds);
    std::printf("%-32s %10.2f %10.2f %12.3f %12.3f\n", c.name.c_str(), best * 1e3, med * 1e3,
                busbw(best), busbw(med));
    if (c.name != "tessel" && (best_gloo == nullptr || med < median(best_gloo->seconds)))
      best_gloo = &c;
  }
  const double ours_med = median(cands[0].seconds);
  const double ours_best = *std::min_element(cands[0].seconds.begin(), cands[0].seconds.end());
  const double gloo_med = median(best_gloo->seconds);
  const double gloo_best = *std::min_element(best_gloo->seconds.begin(), best_gloo->seconds.end());
  const double ratio = busbw(ours_med) / busbw(gloo_med);
  std::printf("best raw Gloo: %s; tessel / Gloo bus bandwidth (medians) = %.3f, (bests) = %.3f\n",
              best_gloo->name.c_str(), ratio, busbw(ours_best) / busbw(gloo_best));
  std::printf(
      "{\"bytes\": %.0f, \"nproc\": %d, \"reps\": %d, \"tessel_busbw_gbps\": %.4f, "
      "\"tessel_best_busbw_gbps\": %.4f, \"gloo_algorithm\": \"%s\", \"gloo_busbw_gbps\": %.4f, "
      "\"gloo_best_busbw_gbps\": %.4f, \"allreduce_vs_gloo\": %.4f}\n",
      bytes, n, a.reps, busbw(ours_med), busbw(ours_best), best_gloo->name.c_str(), busbw(gloo_med),
      busbw(gloo_best), ratio);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  char tmpl[] = "/tmp/tessel-bench-allreduce-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::perror("bench_allreduce: mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  // A dead peer leaves the others blocked until their timeout; do not wait that long.
  tessel::process::ForkOptions how;
  how.deadline = std::chrono::hours(2);
  how.stop_on_failure = true;
  int failed = 0;
  try {
    const auto outcomes = tessel::process::run_forked(
        a.nproc, [&](int rank) { return worker(a, dir, rank); }, how);
    for (size_t r = 0; r < outcomes.size(); ++r) {
      if (outcomes[r].ok()) continue;
      std::fprintf(stderr, "bench_allreduce rank %zu: %s\n", r, outcomes[r].describe().c_str());
      failed = 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce: %s\n", e.what());
    failed = 1;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return failed;
}
