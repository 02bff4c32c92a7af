#include "tessel/planner/profiler.h"

#include <fmt/format.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include "tessel/comm/communicator.h"
#include "tessel/core/check.h"
#include "tessel/kernels/backend.h"
#include "tessel/kernels/gemm.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/transformer.h"

namespace tessel::planner {

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  TESSEL_CHECK(!v.empty(), InvalidArgumentError, "median of no values");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A fresh directory under the system's temporary directory, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "tessel-profile-XXXXXX").string();
    TESSEL_CHECK(mkdtemp(pattern.data()) != nullptr, IoError,
                 "profile: cannot create a temporary directory under {} (set TMPDIR to a "
                 "writable directory)",
                 fs::temp_directory_path().string());
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A barrier for forked children: a process-shared pthread barrier in anonymous shared memory,
// created by the parent before it forks.
class SharedBarrier {
 public:
  explicit SharedBarrier(int n) {
    void* mem = mmap(nullptr, sizeof(pthread_barrier_t), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    TESSEL_CHECK(mem != MAP_FAILED, IoError, "profile: cannot map shared memory for a barrier");
    barrier_ = static_cast<pthread_barrier_t*>(mem);
    pthread_barrierattr_t attr;
    pthread_barrierattr_init(&attr);
    pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    const int rc = pthread_barrier_init(barrier_, &attr, unsigned(n));
    pthread_barrierattr_destroy(&attr);
    if (rc != 0) {
      munmap(barrier_, sizeof(pthread_barrier_t));
      TESSEL_THROW(IoError, "profile: cannot create a process-shared barrier (error {})", rc);
    }
  }
  ~SharedBarrier() {
    pthread_barrier_destroy(barrier_);
    munmap(barrier_, sizeof(pthread_barrier_t));
  }
  SharedBarrier(const SharedBarrier&) = delete;
  SharedBarrier& operator=(const SharedBarrier&) = delete;
  void wait() { pthread_barrier_wait(barrier_); }

 private:
  pthread_barrier_t* barrier_ = nullptr;
};

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs body(i) for i in [0, n) in forked children and returns what each returned. A child writes
// its result (or its error) to a file in `dir` and leaves with _exit, never returning into the
// caller. The parent waits at most `timeout`; a child that fails or hangs gets every child killed
// and an exception thrown here (the parent never exits).
std::vector<std::string> run_children(int n, std::chrono::milliseconds timeout,
                                      const std::string& what, const fs::path& dir,
                                      const std::function<std::string(int)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  auto kill_all = [&pids] {
    for (pid_t p : pids) {
      if (p > 0) kill(p, SIGKILL);
    }
    for (pid_t p : pids) {
      if (p > 0) waitpid(p, nullptr, 0);
    }
  };
  for (int i = 0; i < n; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        write_text(dir / fmt::format("child-{}.out", i), body(i));
      } catch (const std::exception& e) {
        write_text(dir / fmt::format("child-{}.err", i), e.what());
        code = 1;
      } catch (...) {
        write_text(dir / fmt::format("child-{}.err", i), "unknown exception");
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    if (pid < 0) {
      kill_all();
      TESSEL_THROW(IoError, "profile: fork failed for {} (process {} of {})", what, i, n);
    }
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + timeout;
  int left = n;
  while (left > 0) {
    for (int i = 0; i < n; ++i) {
      if (pids[size_t(i)] <= 0) continue;
      int status = 0;
      if (waitpid(pids[size_t(i)], &status, WNOHANG) != pids[size_t(i)]) continue;
      pids[size_t(i)] = 0;
      --left;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      kill_all();
      const fs::path err = dir / fmt::format("child-{}.err", i);
      const std::string why = fs::exists(err) ? read_text(err)
                              : WIFSIGNALED(status)
                                  ? fmt::format("killed by signal {}", WTERMSIG(status))
                                  : fmt::format("exit status {}", WEXITSTATUS(status));
      TESSEL_THROW(Error, "profile: {} failed in process {} of {}: {}", what, i, n, why);
    }
    if (left == 0) break;
    if (Clock::now() > deadline) {
      kill_all();
      TESSEL_THROW(TimeoutError,
                   "profile: {} did not finish within {:.0f} s (the machine may be overloaded, "
                   "or the sizes too large); the processes were killed",
                   what, std::chrono::duration<double>(timeout).count());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(read_text(dir / fmt::format("child-{}.out", i)));
  return out;
}

void fill_normal(float* x, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) x[i] = d(rng);
}

// warmup + repeats runs of `run`, each after `prep` (untimed) and a barrier; the median time.
template <typename Prep, typename Run>
double time_median(SharedBarrier& barrier, const ProfileOptions& o, Prep&& prep, Run&& run) {
  std::vector<double> t;
  for (int r = 0; r < o.warmup + o.repeats; ++r) {
    prep();
    barrier.wait();
    const auto t0 = Clock::now();
    run();
    const double s = seconds_since(t0);
    if (r >= o.warmup) t.push_back(s);
  }
  return median(t);
}

struct StageTimes {
  double forward = 0, backward = 0;
  double activation_bytes = 0;
};

// Forward and backward of one stage of the model, timed in lockstep with the other workers.
// `sync` lines the workers up before each timed pass; `tp`, when not null, shards the stage (every
// rank of the group passes the same seed).
StageTimes time_stage(const ProfileOptions& o, int seq, kernels::Backend& backend,
                      const std::function<void()>& sync, int64_t b, model::StageRange range,
                      uint64_t seed, model::TpGroup* tp = nullptr) {
  const model::ModelConfig& m = o.model;
  model::Transformer t(m, backend, int(b), seq, range, tp);
  t.init(seed);
  const int64_t n = b * seq;
  std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (auto& x : tokens) x = int32_t(rng() % uint32_t(m.vocab_size));
  for (auto& x : targets) x = int32_t(rng() % uint32_t(m.vocab_size));
  const int64_t boundary = n * m.n_embd;
  if (!range.has_embedding) fill_normal(t.input_hidden().data<float>(), boundary, seed + 1);
  std::vector<float> out_grad(static_cast<size_t>(boundary));
  fill_normal(out_grad.data(), boundary, seed + 2);
  for (auto& g : out_grad) g *= 1e-3f;
  const float grad_scale = 1.0f / float(n);

  std::vector<double> fwd, bwd;
  for (int r = 0; r < o.warmup + o.repeats; ++r) {
    sync();
    auto t0 = Clock::now();
    if (range.has_head) {
      t.forward_stage(range.has_embedding ? tokens.data() : nullptr, targets.data(), grad_scale);
    } else {
      t.forward_stage(range.has_embedding ? tokens.data() : nullptr, nullptr);
    }
    const double f = seconds_since(t0);
    if (!range.has_head) std::copy(out_grad.begin(), out_grad.end(), t.output_grad().data<float>());
    sync();
    t0 = Clock::now();
    t.backward_stage();
    const double bw = seconds_since(t0);
    if (r >= o.warmup) {
      fwd.push_back(f);
      bwd.push_back(bw);
    }
  }
  return StageTimes{median(fwd), median(bwd), double(t.activation_bytes())};
}

long peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss * 1024L;  // Linux reports kilobytes
}

// One compute worker: everything timed in this process, as JSON.
std::string compute_worker(const ProfileOptions& o, int seq, int threads,
                           const std::vector<int64_t>& sizes, SharedBarrier& barrier, int index,
                           int count, const fs::path& store_dir) {
  omp_set_num_threads(threads);
  // A training worker computes beside the idle transport and watchdog threads of its
  // communicators: connect as many here, among the compute workers.
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  if (count > 1) {
    comm::StoreOptions store;
    store.path = store_dir.string();
    store.job_id = "compute";
    store.timeout = o.timeout;
    for (int c = 0; c < o.compute_communicators; ++c)
      comms.push_back(
          comm::Communicator::connect(store, fmt::format("c{}", c), index, count, o.timeout));
  }
  auto backend = kernels::make_backend("cpu");
  const model::ModelConfig& m = o.model;
  const uint64_t seed = 0x7e55e1 + uint64_t(index);
  nlohmann::json out;

  // Achieved SGEMM rate on a large square product, and the overhead of a small one.
  {
    const int N = 1024;
    std::vector<float> a(size_t(N) * N), bm(a.size()), c(a.size(), 0.0f);
    fill_normal(a.data(), int64_t(a.size()), seed);
    fill_normal(bm.data(), int64_t(bm.size()), seed + 1);
    const double big = time_median(
        barrier, o, [] {},
        [&] {
          kernels::sgemm(false, true, N, N, N, 1.0f, a.data(), N, bm.data(), N, 0.0f, c.data(), N);
        });
    const double flops = 2.0 * N * N * N / big;
    const int S = 64, calls = 32;
    const double small = time_median(
                             barrier, o, [] {},
                             [&] {
                               for (int i = 0; i < calls; ++i)
                                 kernels::sgemm(false, true, S, S, S, 1.0f, a.data(), S, bm.data(),
                                                S, 0.0f, c.data(), S);
                             }) /
                         calls;
    out["gemm_flops"] = flops;
    out["gemm_half_time_s"] = std::max(0.0, small - 2.0 * S * S * S / flops);
  }

  // Per-unit times by micro-batch size.
  const int k = std::max(1, std::min(o.block_group, m.n_layer));
  out["points"] = nlohmann::json::array();
  const std::function<void()> sync = [&barrier] { barrier.wait(); };
  for (int64_t b : sizes) {
    const StageTimes blocks =
        time_stage(o, seq, *backend, sync, b, model::StageRange{0, k, false, false}, seed);
    const StageTimes emb =
        time_stage(o, seq, *backend, sync, b, model::StageRange{0, 0, true, false}, seed);
    const StageTimes head = time_stage(o, seq, *backend, sync, b,
                                       model::StageRange{m.n_layer, m.n_layer, false, true}, seed);
    out["points"].push_back({{"micro_batch", b},
                             {"forward_s", blocks.forward / k},
                             {"backward_s", blocks.backward / k},
                             {"embedding_forward_s", emb.forward},
                             {"embedding_backward_s", emb.backward},
                             {"head_forward_s", head.forward},
                             {"head_backward_s", head.backward},
                             {"block_activation_bytes", blocks.activation_bytes / k},
                             {"embedding_activation_bytes", emb.activation_bytes},
                             {"head_activation_bytes", head.activation_bytes}});
  }

  // The optimizer phase: the gradient norm's read of the gradients, then one AdamW pass that
  // zeroes them, over as many elements as the model has parameters (capped).
  {
    const int64_t n = std::clamp<int64_t>(m.num_params(), 1 << 16, int64_t(1) << 25);
    const auto len = static_cast<size_t>(n);
    std::vector<float> p(len), g(len), mm(len, 0.0f), v(len, 0.0f);
    fill_normal(p.data(), n, seed + 3);
    kernels::AdamWConfig cfg;
    cfg.weight_decay = 0.1f;
    cfg.zero_grad = true;
    double sink = 0;
    const double norm_s = time_median(
        barrier, o, [] {}, [&] { sink += backend->sum_of_squares(g.data(), n); });
    const double adamw_s = time_median(
        barrier, o, [] {},
        [&] {
          backend->adamw_update(p.data(), g.data(), mm.data(), v.data(), n, cfg);
          ++cfg.step;
        });
    out["optimizer"] = {{"elements", n},
                        {"grad_norm_s", norm_s},
                        {"adamw_s", adamw_s},
                        {"finite", std::isfinite(sink)}};
  }
  out["peak_rss_bytes"] = peak_rss_bytes();
  for (auto& c : comms) c->barrier();
  return out.dump();
}

// The model's tensor-parallel collectives on a communicator (what runtime/tp_comm_group.h does:
// the max as an all-gather and a local max, which every rank computes alike).
class CommTp final : public model::TpGroup {
 public:
  explicit CommTp(comm::Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  void all_reduce_sum(float* data, size_t n) override { c_.all_reduce_sum(data, n); }
  void all_reduce_max(float* data, size_t n) override {
    gathered_.resize(n * size_t(size()));
    c_.all_gather(data, n, gathered_.data());
    for (size_t i = 0; i < n; ++i) {
      float v = gathered_[i];
      for (int r = 1; r < size(); ++r) v = std::max(v, gathered_[size_t(r) * n + i]);
      data[i] = v;
    }
  }

 private:
  comm::Communicator& c_;
  std::vector<float> gathered_;
};

bool tp_fits(const model::ModelConfig& m, int t) {
  return m.n_head % t == 0 && (m.n_kv_head % t == 0 || t % m.n_kv_head == 0) &&
         m.ffn_hidden % t == 0 && m.padded_vocab() % t == 0;
}

// A burst of GEMMs of about `seconds` on this process's threads: what a worker does right before
// a collective in a training step.
class ComputeBurst {
 public:
  ComputeBurst(double seconds, uint64_t seed) : a_(size_t(kN) * kN), b_(a_.size()), c_(a_.size()) {
    fill_normal(a_.data(), int64_t(a_.size()), seed);
    fill_normal(b_.data(), int64_t(b_.size()), seed + 1);
    if (seconds <= 0) return;
    run_once();
    const auto t0 = Clock::now();
    run_once();
    calls_ = std::max(1, int(seconds / std::max(seconds_since(t0), 1e-6)));
  }
  void run() {
    for (int i = 0; i < calls_; ++i) run_once();
  }
  int32_t& calls() { return calls_; }

 private:
  static constexpr int kN = 256;
  void run_once() {
    kernels::sgemm(false, true, kN, kN, kN, 1.0f, a_.data(), kN, b_.data(), kN, 0.0f, c_.data(),
                   kN);
  }
  std::vector<float> a_, b_, c_;
  int32_t calls_ = 0;
};

// One process of communication group `group` of g processes: its rank 0 returns its times as JSON.
std::string comm_worker(const ProfileOptions& o, const fs::path& store_dir,
                        const std::vector<int64_t>& sizes, int g, int group, int rank, int threads,
                        int seq, const std::vector<int64_t>& micro_batches) {
  omp_set_num_threads(threads);
  comm::StoreOptions store;
  store.path = store_dir.string();
  store.job_id = "profile";
  store.generation = g;
  store.timeout = o.timeout;
  auto c = comm::Communicator::connect(store, fmt::format("g{}-{}", g, group), rank, g, o.timeout);
  const int64_t max_bytes = *std::max_element(sizes.begin(), sizes.end());
  std::vector<float> buf(size_t((max_bytes + 3) / 4), 1.0f / 1024);
  // Every rank times its burst; rank 0's call count is used by all, so that all run the same work
  // before each collective.
  ComputeBurst burst(o.collective_burst_s, 0xb0057 + uint64_t(rank));
  c->broadcast(&burst.calls(), 1, 0);
  nlohmann::json out;
  if (g == 2) {
    // Ping-pong between ranks 0 and 1: half a round trip is one message's time.
    out["p2p"] = nlohmann::json::array();
    for (int64_t bytes : sizes) {
      std::vector<double> t;
      for (int r = 0; r < o.warmup + o.repeats; ++r) {
        c->barrier();
        const auto t0 = Clock::now();
        if (rank == 0) {
          c->send(buf.data(), size_t(bytes), 1, 1).wait();
          c->recv(buf.data(), size_t(bytes), 1, 2).wait();
        } else {
          c->recv(buf.data(), size_t(bytes), 0, 1).wait();
          c->send(buf.data(), size_t(bytes), 0, 2).wait();
        }
        if (r >= o.warmup) t.push_back(seconds_since(t0) / 2);
      }
      out["p2p"].push_back({{"bytes", bytes}, {"seconds", median(t)}});
    }
  }
  // All-reduce as a training step meets it: right after a burst of compute on every rank, so the
  // time includes waking the idle transport threads and the ranks arriving apart.
  out["all_reduce"] = nlohmann::json::array();
  for (int64_t bytes : sizes) {
    const size_t count = size_t(std::max<int64_t>(1, bytes / 4));
    std::vector<double> t;
    for (int r = 0; r < o.warmup + o.repeats; ++r) {
      std::fill(buf.begin(), buf.begin() + std::ptrdiff_t(count), 1.0f / 1024);
      c->barrier();
      burst.run();
      const auto t0 = Clock::now();
      c->all_reduce_sum(buf.data(), count);
      if (r >= o.warmup) t.push_back(seconds_since(t0));
    }
    // The mean over ranks of their medians: the first to arrive waits for the last.
    double mine = median(t);
    c->all_reduce_sum(&mine, 1);
    out["all_reduce"].push_back({{"bytes", int64_t(count) * 4}, {"seconds", mine / g}});
  }
  // Tensor-parallel stages over this group, as the runtime runs them: the times include the
  // Megatron all-reduces and the ranks waiting for each other at every one of them.
  if (o.measure_tp && tp_fits(o.model, g)) {
    const model::ModelConfig& m = o.model;
    CommTp tp(*c);
    auto backend = kernels::make_backend("cpu");
    const std::function<void()> sync = [&c] { c->barrier(); };
    const int k = std::max(1, std::min(o.block_group, m.n_layer));
    // The mean over ranks of their medians.
    auto mean = [&](double x) {
      c->all_reduce_sum(&x, 1);
      return x / g;
    };
    out["tp_points"] = nlohmann::json::array();
    const uint64_t seed = 0x7e55e1;  // the same on every rank: shards of one model
    for (int64_t b : micro_batches) {
      const StageTimes blocks =
          time_stage(o, seq, *backend, sync, b, model::StageRange{0, k, false, false}, seed, &tp);
      const StageTimes emb =
          time_stage(o, seq, *backend, sync, b, model::StageRange{0, 0, true, false}, seed, &tp);
      const StageTimes head =
          time_stage(o, seq, *backend, sync, b,
                     model::StageRange{m.n_layer, m.n_layer, false, true}, seed, &tp);
      out["tp_points"].push_back({{"micro_batch", b},
                                  {"forward_s", mean(blocks.forward / k)},
                                  {"backward_s", mean(blocks.backward / k)},
                                  {"embedding_forward_s", mean(emb.forward)},
                                  {"embedding_backward_s", mean(emb.backward)},
                                  {"head_forward_s", mean(head.forward)},
                                  {"head_backward_s", mean(head.backward)}});
    }
  }
  c->barrier();
  return rank == 0 ? out.dump() : std::string("{}");
}

std::vector<int64_t> default_sizes(int64_t max_b) {
  std::vector<int64_t> s;
  for (int64_t b = 1; b <= max_b; b *= 2) s.push_back(b);
  if (s.back() != max_b) s.push_back(max_b);
  return s;
}

nlohmann::json points_json(const std::vector<double>& bytes, const std::vector<double>& secs) {
  auto a = nlohmann::json::array();
  for (size_t i = 0; i < bytes.size(); ++i)
    a.push_back({{"bytes", int64_t(bytes[i])}, {"seconds", secs[i]}});
  return a;
}

}  // namespace

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, int(CPU_COUNT(&set)));
  return std::max(1u, std::thread::hardware_concurrency());
}

LinearFit fit_latency_bandwidth(const std::vector<double>& x, const std::vector<double>& t) {
  TESSEL_CHECK(!x.empty() && x.size() == t.size(), InvalidArgumentError,
               "fit_latency_bandwidth: {} sizes and {} times; need the same number, at least one",
               x.size(), t.size());
  double sw = 0, sx = 0, sxx = 0, st = 0, sxt = 0, max_x = 0, min_t = INFINITY;
  for (size_t i = 0; i < x.size(); ++i) {
    TESSEL_CHECK(x[i] > 0 && t[i] > 0 && std::isfinite(x[i]) && std::isfinite(t[i]),
                 InvalidArgumentError,
                 "fit_latency_bandwidth: point {} is ({}, {}); sizes and times must be positive", i,
                 x[i], t[i]);
    const double w = 1.0 / (t[i] * t[i]);
    sw += w;
    sx += w * x[i];
    sxx += w * x[i] * x[i];
    st += w * t[i];
    sxt += w * x[i] * t[i];
    max_x = std::max(max_x, x[i]);
    min_t = std::min(min_t, t[i]);
  }
  LinearFit f;
  const double det = sw * sxx - sx * sx;
  double slope = det > 1e-12 * sw * sxx ? (sw * sxt - sx * st) / det : 0;
  double latency = slope > 0 ? (st - slope * sx) / sw : 0;
  if (slope > 0 && latency < 0) {  // through the origin instead
    latency = 0;
    slope = sxt / sxx;
  }
  if (x.size() == 1) {
    latency = 0;
    slope = t[0] / x[0];
  }
  if (!(slope > 0)) {
    f.latency = st / sw;
    f.bandwidth = max_x / min_t;
    return f;
  }
  f.latency = latency;
  f.bandwidth = 1.0 / slope;
  return f;
}

namespace {

// The options with every default resolved.
struct ProfileSetup {
  ProfileOptions o;
  int seq = 0;
  int cores = 0;
  int threads = 0;      // per worker
  int concurrency = 0;  // compute workers measuring at once
  double oversubscription = 1;
  std::vector<int64_t> sizes;     // micro-batch sizes, ascending
  std::vector<int64_t> messages;  // message bytes
  void progress(const std::string& line) const {
    if (o.progress) o.progress(line);
  }
};

ProfileSetup resolve(const ProfileOptions& opt) {
  ProfileSetup s;
  s.o = opt;
  const ProfileOptions& o = s.o;
  o.model.validate();
  s.seq = o.seq > 0 ? o.seq : o.model.max_seq_len;
  TESSEL_CHECK(s.seq >= 1 && s.seq <= o.model.max_seq_len, ConfigError,
               "profile: sequence length {} is outside model '{}' (1 to max_seq_len {})", s.seq,
               o.model.name, o.model.max_seq_len);
  TESSEL_CHECK(o.workers >= 1 && o.threads >= 0 && o.repeats >= 1 && o.warmup >= 0 &&
                   o.block_group >= 1 && o.max_micro_batch >= 1,
               ConfigError,
               "profile: workers ({}), repeats ({}), block_group ({}) and max micro-batch ({}) "
               "must be >= 1, threads ({}) and warmup ({}) >= 0",
               o.workers, o.repeats, o.block_group, o.max_micro_batch, o.threads, o.warmup);
  s.cores = usable_cores();
  s.threads = o.threads > 0 ? o.threads : std::max(1, s.cores / o.workers);
  // More worker threads than cores: the compute is measured in as many workers as the cores hold
  // and scaled by the oversubscription, the share of a core each worker gets while all compute.
  s.concurrency = std::clamp(s.cores / s.threads, 1, o.workers);
  s.oversubscription = std::max(1.0, double(o.workers) * s.threads / s.cores);
  s.sizes = o.micro_batches.empty() ? default_sizes(o.max_micro_batch) : o.micro_batches;
  std::sort(s.sizes.begin(), s.sizes.end());
  s.sizes.erase(std::unique(s.sizes.begin(), s.sizes.end()), s.sizes.end());
  TESSEL_CHECK(s.sizes.front() >= 1, ConfigError, "profile: micro-batch sizes must be >= 1");
  s.messages = o.message_bytes.empty()
                   ? std::vector<int64_t>{4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20}
                   : o.message_bytes;
  for (int64_t b : s.messages)
    TESSEL_CHECK(b >= 4, ConfigError, "profile: message sizes must be >= 4 bytes, got {}", b);
  return s;
}

// The fields that describe the machine and the run, before anything is measured.
nlohmann::json profile_header(const ProfileSetup& s) {
  nlohmann::json doc;
  doc["format"] = "tessel-profile";
  doc["version"] = 1;
  doc["name"] = "this-machine";
  doc["workers"] = s.o.workers;
  doc["threads_per_worker"] = s.threads;
  doc["cores"] = s.cores;
  doc["cpu_oversubscription"] = s.oversubscription;
  doc["seq"] = s.seq;
  const auto& m = s.o.model;
  doc["model"] = {{"name", m.name},
                  {"family", model::family_name(m.family)},
                  {"n_layer", m.n_layer},
                  {"n_embd", m.n_embd},
                  {"n_head", m.n_head},
                  {"n_kv_head", m.n_kv_head},
                  {"ffn_hidden", m.ffn_hidden},
                  {"vocab_size", m.vocab_size},
                  {"max_seq_len", m.max_seq_len}};
  const double phys = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  doc["memory_bytes"] = int64_t(phys / s.o.workers);
  doc["reserved_bytes"] = 0;
  doc["repeats"] = s.o.repeats;
  return doc;
}

// The median over the compute workers' reports of get(report).
template <typename Get>
double median_over(const std::vector<nlohmann::json>& reports, Get&& get) {
  std::vector<double> v;
  for (const auto& j : reports) v.push_back(get(j));
  return median(v);
}

// The layer_times section from the compute workers' reports: medians over the workers, times
// scaled to all workers computing at once.
nlohmann::json layer_times(const ProfileSetup& s, const std::vector<nlohmann::json>& w) {
  nlohmann::json lt;
  lt["seq"] = s.seq;
  lt["tp"] = 1;
  lt["threads"] = s.threads;
  lt["concurrent_workers"] = s.concurrency;
  lt["cpu_oversubscription"] = s.oversubscription;
  lt["block_group"] = std::max(1, std::min(s.o.block_group, s.o.model.n_layer));
  lt["points"] = nlohmann::json::array();
  for (size_t p = 0; p < s.sizes.size(); ++p) {
    nlohmann::json pt;
    for (const auto& [key, value] : w[0]["points"][p].items()) {
      if (key == "micro_batch") {
        pt[key] = value;
        continue;
      }
      const double v =
          median_over(w, [&](const auto& j) { return j["points"][p][key].template get<double>(); });
      pt[key] = key.ends_with("_s") ? v * s.oversubscription : v;
    }
    lt["points"].push_back(pt);
  }
  return lt;
}

// Compute, in all workers at once: the GEMM rate, the optimizer phase, the layer times and the
// peak resident set.
void measure_compute(const ProfileSetup& s, const ScratchDir& scratch, nlohmann::json& doc) {
  const auto t0 = Clock::now();
  const fs::path dir = scratch.path() / "compute";
  fs::create_directories(dir);
  SharedBarrier barrier(s.concurrency);
  const auto outs = run_children(
      s.concurrency, s.o.timeout,
      fmt::format("the compute measurement ({} workers)", s.concurrency), dir, [&](int i) {
        return compute_worker(s.o, s.seq, s.threads, s.sizes, barrier, i, s.concurrency,
                              scratch.path() / "compute-store");
      });
  std::vector<nlohmann::json> w;
  for (const auto& out : outs) w.push_back(nlohmann::json::parse(out));
  const double flops =
      median_over(w, [](const auto& j) { return j["gemm_flops"].template get<double>(); });
  doc["flops"] = {{"fp32", flops / s.oversubscription}};
  doc["gemm_half_time_s"] =
      median_over(w, [](const auto& j) { return j["gemm_half_time_s"].template get<double>(); });
  const double norm_s = median_over(
      w, [](const auto& j) { return j["optimizer"]["grad_norm_s"].template get<double>(); });
  const double adamw_s = median_over(
      w, [](const auto& j) { return j["optimizer"]["adamw_s"].template get<double>(); });
  const int64_t n = w[0]["optimizer"]["elements"].get<int64_t>();
  const double per_param = s.oversubscription * (norm_s + adamw_s) / double(n);
  doc["optimizer"] = {{"elements", n},
                      {"grad_norm_s", norm_s},
                      {"adamw_s", adamw_s},
                      {"seconds_per_param", per_param}};
  doc["memory_bandwidth_bytes_per_s"] = 32.0 / per_param;
  doc["layer_times"] = layer_times(s, w);
  double rss = 0;
  for (const auto& j : w) rss = std::max(rss, j["peak_rss_bytes"].get<double>());
  doc["peak_rss_bytes"] = int64_t(rss);
  s.progress(fmt::format(
      "compute: {} micro-batch sizes on {} worker(s) x {} thread(s) at once{} "
      "in {:.1f} s",
      s.sizes.size(), s.concurrency, s.threads,
      s.oversubscription > 1 ? fmt::format(", times x {:.2f} for {} workers on {} cores",
                                           s.oversubscription, s.o.workers, s.cores)
                             : "",
      seconds_since(t0)));
}

// The p2p section from group 0's ping-pong times (groups of 2).
nlohmann::json p2p_section(const nlohmann::json& r0) {
  std::vector<double> x, t;
  for (const auto& p : r0["p2p"]) {
    x.push_back(p["bytes"].get<double>());
    t.push_back(p["seconds"].get<double>());
  }
  const LinearFit f = fit_latency_bandwidth(x, t);
  return {{"bandwidth_bytes_per_s", f.bandwidth},
          {"latency_s", f.latency},
          {"points", points_json(x, t)}};
}

// The tp_layer_times entry of groups of g measured with procs workers at once: scaled like
// layer_times to all workers busy.
nlohmann::json tp_layer_times(const ProfileSetup& s, int g, int procs, const nlohmann::json& r0) {
  const double over = s.oversubscription / std::max(1.0, double(procs) * s.threads / s.cores);
  nlohmann::json points = nlohmann::json::array();
  for (auto pt : r0["tp_points"]) {
    for (auto& [key, value] : pt.items())
      if (key.ends_with("_s")) value = value.get<double>() * over;
    points.push_back(pt);
  }
  return {{"seq", s.seq},
          {"tp", g},
          {"concurrent_groups", procs / g},
          {"cpu_oversubscription", s.oversubscription},
          {"points", points}};
}

// One communication group size g: as many groups of g at once as the workers form (the dp or tp
// groups of a layout communicate at the same time), group 0's times. Adds the all-reduce points
// (x: the bytes a ring moves, t: seconds) to all_x and all_t for the fit over every group size.
void measure_comm_group(const ProfileSetup& s, const ScratchDir& scratch, int g,
                        nlohmann::json& doc, std::vector<double>& all_x,
                        std::vector<double>& all_t) {
  const auto t0 = Clock::now();
  const fs::path store = scratch.path() / "store";
  const fs::path dir = scratch.path() / fmt::format("comm-{}", g);
  fs::create_directories(dir);
  const int procs = s.o.workers % g == 0 ? s.o.workers : g;
  const auto outs = run_children(
      procs, s.o.timeout,
      fmt::format("the communication measurement ({} group(s) of {})", procs / g, g), dir,
      [&](int i) {
        return comm_worker(s.o, store, s.messages, g, i / g, i % g, s.threads, s.seq, s.sizes);
      });
  const auto r0 = nlohmann::json::parse(outs[0]);
  if (g == 2) doc["p2p"] = p2p_section(r0);
  std::vector<double> bytes, x, t;
  const double factor = 2.0 * (g - 1) / g;
  for (const auto& p : r0["all_reduce"]) {
    bytes.push_back(p["bytes"].get<double>());
    x.push_back(factor * p["bytes"].get<double>());
    t.push_back(p["seconds"].get<double>());
  }
  all_x.insert(all_x.end(), x.begin(), x.end());
  all_t.insert(all_t.end(), t.begin(), t.end());
  const LinearFit f = fit_latency_bandwidth(x, t);
  doc["all_reduce"]["by_group"].push_back({{"ranks", g},
                                           {"bus_bandwidth_bytes_per_s", f.bandwidth},
                                           {"latency_s", f.latency},
                                           {"concurrent_groups", procs / g},
                                           {"points", points_json(bytes, t)}});
  if (r0.contains("tp_points")) doc["tp_layer_times"].push_back(tp_layer_times(s, g, procs, r0));
  s.progress(fmt::format("communication: {} group(s) of {} processes in {:.1f} s", procs / g, g,
                         seconds_since(t0)));
}

// Communication, per group size g in 2..max(2, workers), and the all-reduce fit over all of them.
void measure_comm(const ProfileSetup& s, const ScratchDir& scratch, nlohmann::json& doc) {
  std::vector<double> all_x, all_t;
  doc["all_reduce"]["by_group"] = nlohmann::json::array();
  doc["tp_layer_times"] = nlohmann::json::array();
  for (int g = 2; g <= std::max(2, s.o.workers); ++g)
    measure_comm_group(s, scratch, g, doc, all_x, all_t);
  const LinearFit f = fit_latency_bandwidth(all_x, all_t);
  doc["all_reduce"]["bus_bandwidth_bytes_per_s"] = f.bandwidth;
  doc["all_reduce"]["latency_s"] = f.latency;
}

}  // namespace

nlohmann::json profile(const ProfileOptions& opt) {
  const auto start = Clock::now();
  const ProfileSetup s = resolve(opt);
  ScratchDir scratch;
  nlohmann::json doc = profile_header(s);
  measure_compute(s, scratch, doc);
  if (s.o.measure_comm) measure_comm(s, scratch, doc);
  doc["seconds"] = seconds_since(start);
  return doc;
}

}  // namespace tessel::planner
