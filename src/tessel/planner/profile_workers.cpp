// What the profiler's children measure (profile_workers.h), with the real kernels and communicator.
#include "tessel/planner/profile_workers.h"

#include <fmt/format.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <random>

#include <nlohmann/json.hpp>

#include "tessel/comm/communicator.h"
#include "tessel/core/check.h"
#include "tessel/kernels/backend.h"
#include "tessel/kernels/gemm.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/transformer.h"

namespace tessel::planner::detail {

namespace fs = std::filesystem;

namespace {

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

}  // namespace

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

}  // namespace tessel::planner::detail
