#include "tessel/planner/search.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <compare>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <unordered_map>

#include "tessel/core/check.h"
#include "tessel/planner/simulator.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/named.h"

namespace tessel::planner {

StageSplit balance_stages(std::span<const double> costs, int stages) {
  const int U = int(costs.size()), S = stages;
  TESSEL_CHECK(1 <= S && S <= U, InvalidArgumentError,
               "balance_stages: {} stages for {} units; need 1 <= stages <= units", S, U);
  std::vector<double> prefix(U + 1, 0);
  for (int u = 0; u < U; ++u) {
    TESSEL_CHECK(costs[u] >= 0 && std::isfinite(costs[u]), InvalidArgumentError,
                 "balance_stages: unit {} costs {}; costs must be finite and >= 0", u, costs[u]);
    prefix[u + 1] = prefix[u] + costs[u];
  }
  // f[j]: the best largest part when the first j units form k parts (previous row: k - 1 parts).
  // Part k covers units [i, j); its best start i never moves left as j grows, because the cost
  // max(f_{k-1}(i), sum[i, j)) is the max of a non-decreasing and a non-increasing function of i.
  std::vector<double> prev(U + 1), cur(U + 1);
  std::vector<int> start(size_t(S) * (U + 1), 0);  // start[k * (U+1) + j]: first unit of part k
  for (int j = 0; j <= U; ++j) prev[j] = prefix[j];
  for (int k = 1; k < S; ++k) {  // parts 0..k, i.e. k + 1 of them
    int i = k;                   // the first k parts need k units
    for (int j = k + 1; j <= U - (S - 1 - k); ++j) {
      auto cost = [&](int split) { return std::max(prev[split], prefix[j] - prefix[split]); };
      if (i < k) i = k;
      while (i + 1 < j && cost(i + 1) <= cost(i)) ++i;
      cur[j] = cost(i);
      start[size_t(k) * (U + 1) + j] = i;
    }
    std::swap(prev, cur);
  }
  StageSplit out;
  out.max_cost = prev[U];
  out.units_per_stage.assign(S, 0);
  int j = U;
  for (int k = S - 1; k >= 1; --k) {
    const int i = start[size_t(k) * (U + 1) + j];
    out.units_per_stage[k] = j - i;
    j = i;
  }
  out.units_per_stage[0] = j;
  return out;
}

const Candidate& SearchResult::best() const {
  TESSEL_CHECK(!ranked.empty(), ConfigError, "{}", infeasible);
  return ranked.front();
}

nlohmann::json to_json(const Candidate& c) {
  constexpr double GiB = 1024.0 * 1024.0 * 1024.0;
  return nlohmann::json{
      {"plan", layout::to_json(c.plan)},
      {"describe", c.plan.describe()},
      {"step_s", c.step_s},
      {"pipeline_s", c.pipeline_s},
      {"dp_exposed_s", c.dp_exposed_s},
      {"optimizer_s", c.optimizer_s},
      {"max_stage_s", c.max_stage_s},
      {"bubble", c.bubble},
      {"tokens_per_s", c.tokens_per_s},
      {"mfu", c.mfu},
      {"memory_gib", c.memory_bytes / GiB},
      {"capacity_gib", c.capacity_bytes / GiB},
  };
}

namespace {

using layout::ScheduleKind;
using Clock = std::chrono::steady_clock;

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> small, large;
  for (int64_t i = 1; i * i <= n; ++i) {
    if (n % i) continue;
    small.push_back(i);
    if (i != n / i) large.push_back(n / i);
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

bool tp_fits_model(const model::ModelConfig& m, int t) {
  return m.n_head % t == 0 && (m.n_kv_head % t == 0 || t % m.n_kv_head == 0) &&
         m.ffn_hidden % t == 0 && m.padded_vocab() % t == 0;
}

// One scored layout, before it becomes a Candidate.
struct Record {
  int tp, pp, dp, v, zero;
  int64_t b, m;
  ScheduleKind schedule;
  bool recompute;
  bool jit = false;      // just-in-time recomputation
  bool v_shape = false;  // adaptive on zb-v's V
  double step, pipeline, dp_exposed, optimizer, max_stage, memory, bubble = 0;
  const StageSplit* split;
};

// What a layout's pipeline is, besides its sizes: the schedule, and its variants.
struct Variant {
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  bool recompute = false;
  bool jit = false;
  bool v_shape = false;
};

struct SplitKey {
  int stages, tp;
  int64_t b;
  bool recompute;
  bool operator==(const SplitKey&) const = default;
};
struct SplitKeyHash {
  size_t operator()(const SplitKey& k) const {
    uint64_t h = uint64_t(k.stages) * 0x9E3779B97F4A7C15ull;
    h ^= uint64_t(k.tp) + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
    h ^= uint64_t(k.b) * 0xC2B2AE3D27D4EB4Full + (h << 6) + (h >> 2);
    return size_t(h ^ uint64_t(k.recompute));
  }
};

class Searcher {
 public:
  explicit Searcher(const SearchRequest& req)
      : req_(req),
        m_(req.model),
        cost_(req.model, req.cluster, with_precision(req.cost, req.precision), req.profile),
        N_(req.cluster.num_devices()),
        U_(req.model.n_layer + 2),
        capacity_(double(req.cluster.device.usable_bytes())),
        flops_per_step_(model_flops_per_sample(req.model, req.seq) * double(req.global_batch)) {}

  SearchResult run();
  Candidate predict(const layout::Plan& plan);

 private:
  static CostOptions with_precision(CostOptions o, Precision p) {
    o.precision = p;
    return o;
  }
  const StageSplit& split(int stages, int tp, int64_t b, bool recompute);
  // Scores one layout; returns whether it fits and appends it to records_ when it does.
  bool evaluate(int tp, int pp, int dp, int v, int64_t b, int64_t m, const Variant& x, int zero);
  // The pipeline's time per unit of busy time (>= 1), given the plan's virtual stages' costs and
  // its one-way stage-to-stage message time; see stretch() below.
  double stretch(const layout::Plan& plan, const std::vector<StageCosts>& stages,
                 double link) const;
  // Time and memory of a plan with layers_per_stage filled, whose slowest stage costs
  // max_stage_cost (forward + backward [+ recompute]); `mem` receives the memory estimate.
  Record score(const layout::Plan& plan, double max_stage_cost, MemoryEstimate& mem) const;
  std::vector<double> unit_costs(int tp, int64_t b, bool recompute) const;
  Candidate candidate(const Record& r, const std::vector<int>& units) const;
  // The most memory-frugal layout of (tp, pp, dp): 1f1b, micro-batch 1, recompute, ZeRO-1.
  // Returns its peak bytes per device.
  double frugal_memory(int tp, int pp, int dp, bool record_smallest);
  std::string infeasible_message();
  std::vector<int> tp_options(int devices, int per_host) const;
  int64_t smallest_fitting_world();

  const SearchRequest& req_;
  const model::ModelConfig& m_;
  CostModel cost_;
  const int N_, U_;
  const double capacity_;
  const double flops_per_step_;

  std::unordered_map<SplitKey, std::unique_ptr<StageSplit>, SplitKeyHash> splits_;
  // Simulated makespans (stretch()).
  struct Simulated {
    int schedule, p;
    int64_t m;
    int v;
    bool v_shape, jit;
    int memory_cap;  // the plan's (0: the default caps)
    double link;
    std::vector<double> costs;  // F, B per virtual stage
    auto operator<=>(const Simulated&) const = default;
  };
  mutable std::map<Simulated, double> makespans_;
  std::vector<Record> records_;
  SearchResult result_;

  // For the answer when nothing fits.
  double smallest_bytes_ = std::numeric_limits<double>::infinity();
  std::string smallest_what_, smallest_reason_;
  std::set<int> dp_fit_but_batch_;  // data-parallel sizes that fit but do not divide the batch
};

const StageSplit& Searcher::split(int stages, int tp, int64_t b, bool recompute) {
  const SplitKey key{stages, tp, b, recompute};
  auto it = splits_.find(key);
  if (it != splits_.end()) return *it->second;
  const std::vector<double> costs = unit_costs(tp, b, recompute);
  ++result_.balance_runs;
  auto res = std::make_unique<StageSplit>(balance_stages(costs, stages));
  return *splits_.emplace(key, std::move(res)).first->second;
}

bool Searcher::evaluate(int tp, int pp, int dp, int v, int64_t b, int64_t m, const Variant& x,
                        int zero) {
  ++result_.evaluated;
  const ScheduleKind s = x.schedule;
  const bool rc = x.recompute;
  const StageSplit& sp = split(pp * v, tp, b, rc);
  layout::Plan plan;
  plan.dp = dp;
  plan.tp = tp;
  plan.pp = pp;
  plan.virtual_stages = v;
  plan.micro_batch = b;
  plan.micro_batches = m;
  plan.schedule = s;
  plan.zero_stage = zero;
  plan.recompute = rc ? model::Recompute::full : model::Recompute::none;
  plan.jit_recompute = x.jit;
  plan.v_shape = x.v_shape;
  plan.layers_per_stage = sp.units_per_stage;
  MemoryEstimate mem;
  Record rec = score(plan, sp.max_cost, mem);
  rec.split = &sp;
  const double peak = rec.memory;
  if (peak < smallest_bytes_) {
    smallest_bytes_ = peak;
    smallest_what_ = fmt::format("tp {}, pp {}, dp {}{}, zero {}{}, micro-batch {}", tp, pp, dp,
                                 v > 1 ? fmt::format(", v {}", v) : "", zero,
                                 rc ? ", recompute" : (x.jit ? ", just-in-time recompute" : ""), b);
    smallest_reason_ = mem.reason();
  }
  if (!mem.fits()) {
    ++result_.rejected_memory;
    return false;
  }
  records_.push_back(rec);
  return true;
}

Record Searcher::score(const layout::Plan& plan, double max_stage_cost, MemoryEstimate& mem) const {
  const int tp = plan.tp, pp = plan.pp, dp = plan.dp, v = plan.virtual_stages,
            zero = plan.zero_stage;
  const int64_t b = plan.micro_batch, m = plan.micro_batches;
  const bool rc = plan.recompute == model::Recompute::full;
  const int S = plan.num_stages(), seq = req_.seq;
  mem = estimate_memory(m_, plan, seq, req_.precision, req_.cluster.device, req_.memory);

  // Pipeline: v m slots of the slowest virtual stage, stretched by the schedule's idle time with
  // equal stages (stretch()).
  const double p2p = pp > 1 ? cost_.p2p(b, seq, N_) : 0;
  const double slot = max_stage_cost + 2 * p2p;
  const PassTimes emb = cost_.embedding(b, seq, tp), blk = cost_.block(b, seq, tp),
                  head = cost_.head(b, seq, tp);
  std::vector<StageCosts> stages;  // for just-in-time recomputation's simulation
  if (plan.jit_recompute) {
    int first = 0;
    for (int st = 0; st < S; ++st) {
      const int last = first + plan.layers_per_stage[st];
      const int blocks = std::min(last, U_ - 1) - std::max(first, 1);
      StageCosts c;
      c.forward =
          blocks * blk.forward + (first == 0 ? emb.forward : 0) + (last == U_ ? head.forward : 0);
      c.backward = blocks * blk.backward() + (first == 0 ? emb.backward() : 0) +
                   (last == U_ ? head.backward() : 0);
      stages.push_back(c);
      first = last;
    }
  }
  const double stretched = stretch(plan, stages, p2p);
  const double pipeline = double(int64_t(v) * m) * slot * stretched;

  // Per pipeline rank: parameters (for the dp sync and optimizer) and one micro-batch's backward.
  const double blk_back = blk.backward() + (rc ? blk.recompute : 0);
  const double p_block = double(unit_params(m_, 1, tp)), p_emb = double(unit_params(m_, 0, tp)),
               p_head = double(unit_params(m_, U_ - 1, tp));
  std::vector<double> params(pp, 0), backward(pp, 0);
  double max_stage_back = 0;
  int begin = 0;
  for (int st = 0; st < S; ++st) {
    const int end = begin + plan.layers_per_stage[st];
    const int r = plan.pp_rank_of_stage(st);
    const bool has_emb = begin == 0, has_head = end == U_;
    const int blocks = std::min(end, U_ - 1) - std::max(begin, 1);
    params[r] += blocks * p_block + (has_emb ? p_emb : 0) + (has_head ? p_head : 0);
    const double back =
        blocks * blk_back + (has_emb ? emb.backward() : 0) + (has_head ? head.backward() : 0);
    backward[r] += back;
    max_stage_back = std::max(max_stage_back, back);
    begin = end;
  }
  // The head's rank also holds (and syncs) its copy of a tied embedding.
  const int head_rank = plan.pp_rank_of_stage(S - 1);
  if (m_.tie_embeddings && head_rank != 0)
    params[head_rank] += double(int64_t(m_.padded_vocab()) * m_.n_embd / tp);
  double tail = 0, dp_part = 0, opt_part = 0;
  for (int r = 0; r < pp; ++r) {
    // Rank r's last backward ends about r backward slots before rank 0's (the drain), so its
    // gradient sync has that much more room.
    const double window = backward[r] + r * max_stage_back;
    const double dpx = cost_.dp_exposed(cost_.dp_sync(params[r], dp, tp, zero), window);
    const double opt = cost_.optimizer_step(params[r] / (zero >= 1 ? dp : 1));
    if (dpx + opt > tail) {
      tail = dpx + opt;
      dp_part = dpx;
      opt_part = opt;
    }
  }
  const double step = pipeline + tail + cost_.tied_embedding_sync(tp, pp, N_);
  return Record{tp,
                pp,
                dp,
                v,
                zero,
                b,
                m,
                plan.schedule,
                rc,
                plan.jit_recompute,
                plan.v_shape,
                step,
                pipeline,
                dp_part,
                opt_part,
                slot,
                mem.peak().total(),
                1.0 - 1.0 / stretched,
                nullptr};
}

// A pipeline of equal stages takes `stretch` times its busy time, v m (F + B) per rank:
//   1 / (1 - bubble) with the named schedules' analytic bubbles (schedule/named.h): (p - 1) of
//     v m + p - 1 slots for gpipe, 1F1B and interleaved 1F1B; a third of 1F1B's fill and drain
//     for ZB-H1 and a sixth for ZB-V, whose split backward fills them with weight gradients;
//   the adaptive dispatcher (its caps, split backward): simulated (simulator.h) on unit stages,
//     F = Bi = Bw = 1, B = 2, with free links as the analytic bubbles assume;
//   just-in-time recomputation: its schedule's stretch times the makespan of its lists with the
//     recomputations over the makespan without them, both simulated on the plan's own virtual
//     stages (`stages`: their F and B; a recompute re-runs the stage's F) with its links (`link`
//     seconds one way). What a recompute costs depends on both: it runs while its gradient is
//     on the way (Varuna), so a slow link hides it and a fast one does not, and the last stage,
//     whose backward follows its forward, recomputes nothing.
// Neither simulation has a closed form. Beyond m = 9p micro-batches the makespan grows by the
// same amount per p micro-batches (the steady state repeats), so it is simulated at 8p (plus
// m mod p, keeping interleaving's multiple of p) and 9p and extended linearly.
double Searcher::stretch(const layout::Plan& plan, const std::vector<StageCosts>& stages,
                         double link) const {
  const int p = plan.pp, v = plan.virtual_stages;
  const int64_t m = plan.micro_batches;
  const bool adaptive = plan.schedule == ScheduleKind::adaptive;
  const auto name = layout::schedule_name(plan.schedule);
  const double busy = 3.0 * double(v) * double(m);  // F + B per micro-batch and chunk
  const double analytic =
      adaptive ? 0 : 1.0 / (1.0 - schedule::analytic_bubble(name, p, int(m), v));
  if (!adaptive && (!plan.jit_recompute || p == 1)) return analytic;
  // The dispatcher on unit stages with free links; the lists with and without just-in-time
  // recomputation on the plan's stages.
  const std::vector<StageCosts> costs =
      adaptive ? uniform_config(p, v, StageCosts{}).costs : stages;  // F 1, B 2, Bi 1, Bw 1
  if (adaptive) link = 0;
  auto makespan = [&](int64_t ms, bool jit) {
    layout::Plan sized = plan;
    sized.micro_batches = ms;
    // The caps follow from (p, m, v, placement) and memory_cap (layout::Plan::dispatch_cap).
    Simulated key{int(plan.schedule), p, ms, v, plan.v_shaped(), jit, plan.memory_cap, link, {}};
    for (const auto& c : costs) key.costs.insert(key.costs.end(), {c.forward, c.backward});
    if (auto it = makespans_.find(key); it != makespans_.end()) return it->second;
    SimConfig cfg;
    cfg.costs = costs;
    cfg.record_timeline = false;
    cfg.link.latency = link;
    SimResult r;
    if (adaptive) {
      GreedyOptions g;
      g.stages = p;
      g.micro_batches = int(ms);
      g.chunks = v;
      g.split_backward = true;
      g.placement =
          sized.v_shaped() ? schedule::Placement::v_shape : schedule::Placement::interleaved;
      for (int rank = 0; rank < p; ++rank) {
        g.stage_memory_caps.push_back(sized.dispatch_cap(rank));
        g.stage_backward_caps.push_back(sized.dispatch_backward_cap(rank));
      }
      r = simulate_greedy(g, cfg);
    } else {
      const auto lists = schedule::make_schedule(name, p, int(ms), v);
      r = simulate(jit ? schedule::with_jit_recompute(lists) : lists, cfg);
    }
    return makespans_.emplace(key, r.makespan).first->second;
  };
  auto extended = [&](bool jit) {
    const int64_t limit = 8 * int64_t(p);
    if (m <= limit + p) return makespan(m, jit);
    const int64_t ms = limit + m % p;
    const double at = makespan(ms, jit), per_round = makespan(ms + p, jit) - at;
    return at + per_round * double(m - ms) / double(p);
  };
  if (adaptive) return std::max(1.0, extended(false) / busy);
  // The recomputations' share is taken from real costs; the schedule's own bubble stays the
  // analytic one every named schedule is scored with.
  return analytic * std::max(1.0, extended(true) / extended(false));
}

std::vector<double> Searcher::unit_costs(int tp, int64_t b, bool recompute) const {
  std::vector<double> costs(U_);
  const int seq = req_.seq;
  costs[0] = cost_.embedding(b, seq, tp).step(false);
  const double block = cost_.block(b, seq, tp).step(recompute);
  for (int u = 1; u <= m_.n_layer; ++u) costs[u] = block;
  costs[U_ - 1] = cost_.head(b, seq, tp).step(false);  // only blocks are recomputed
  return costs;
}

Candidate Searcher::candidate(const Record& r, const std::vector<int>& units) const {
  Candidate c;
  c.plan.dp = r.dp;
  c.plan.tp = r.tp;
  c.plan.pp = r.pp;
  c.plan.virtual_stages = r.v;
  c.plan.micro_batch = r.b;
  c.plan.micro_batches = r.m;
  c.plan.schedule = r.schedule;
  c.plan.zero_stage = r.zero;
  c.plan.recompute = r.recompute ? model::Recompute::full : model::Recompute::none;
  c.plan.jit_recompute = r.jit;
  c.plan.v_shape = r.v_shape;
  c.plan.layers_per_stage = units;
  c.step_s = r.step;
  c.pipeline_s = r.pipeline;
  c.dp_exposed_s = r.dp_exposed;
  c.optimizer_s = r.optimizer;
  c.max_stage_s = r.max_stage;
  c.bubble = r.bubble;
  c.tokens_per_s = double(req_.global_batch) * req_.seq / r.step;
  c.mfu = flops_per_step_ / (r.step * N_ * cost_.peak_flops());
  c.memory_bytes = r.memory;
  c.capacity_bytes = capacity_;
  return c;
}

Candidate Searcher::predict(const layout::Plan& given) {
  given.validate(m_, req_.global_batch, N_);
  layout::Plan plan = given;
  const std::vector<double> costs =
      unit_costs(plan.tp, plan.micro_batch, plan.recompute == model::Recompute::full);
  if (plan.layers_per_stage.empty())
    plan.layers_per_stage = balance_stages(costs, plan.num_stages()).units_per_stage;
  double max_cost = 0;
  int begin = 0;
  for (int units : plan.layers_per_stage) {
    double sum = 0;
    for (int u = begin; u < begin + units; ++u) sum += costs[u];
    max_cost = std::max(max_cost, sum);
    begin += units;
  }
  MemoryEstimate mem;
  const Record r = score(plan, max_cost, mem);
  Candidate c = candidate(r, plan.layers_per_stage);
  c.plan.order = plan.order;
  c.plan.memory_cap = plan.memory_cap;
  return c;
}

double Searcher::frugal_memory(int tp, int pp, int dp, bool record_smallest) {
  const bool rc = std::find(req_.options.recompute.begin(), req_.options.recompute.end(), true) !=
                  req_.options.recompute.end();
  const int zero =
      dp > 1 ? *std::max_element(req_.options.zero_stages.begin(), req_.options.zero_stages.end())
             : 0;
  const StageSplit& sp = split(pp, tp, 1, rc);
  layout::Plan plan;
  plan.dp = dp;
  plan.tp = tp;
  plan.pp = pp;
  plan.micro_batch = 1;
  plan.micro_batches = std::max<int64_t>(pp, 1);  // 1f1b holds at most p micro-batches anyway
  plan.schedule = ScheduleKind::one_f_one_b;
  plan.zero_stage = zero;
  plan.recompute = rc ? model::Recompute::full : model::Recompute::none;
  plan.layers_per_stage = sp.units_per_stage;
  const MemoryEstimate mem =
      estimate_memory(m_, plan, req_.seq, req_.precision, req_.cluster.device, req_.memory);
  const double peak = mem.peak().total();
  if (record_smallest && peak < smallest_bytes_) {
    smallest_bytes_ = peak;
    smallest_what_ = fmt::format("tp {}, pp {}, dp {}, zero {}{}, micro-batch 1", tp, pp, dp, zero,
                                 rc ? ", recompute" : "");
    smallest_reason_ = mem.reason();
  }
  return peak;
}

std::vector<int> Searcher::tp_options(int devices, int per_host) const {
  std::vector<int> out;
  for (int64_t t : divisors(per_host)) {
    if (devices % t == 0 && tp_fits_model(m_, int(t))) out.push_back(int(t));
  }
  return out;
}

SearchResult Searcher::run() {
  const auto t0 = Clock::now();
  const auto& o = req_.options;
  const int64_t G = req_.global_batch;
  // Parameters of all units on one tp rank, for the state lower bound.
  const bool mixed = req_.precision != Precision::fp32;
  const double state_bytes = 2.0 * element_bytes(req_.precision);  // parameters + gradients
  const double opt_bytes = mixed ? 12.0 : 8.0;
  const int max_zero = *std::max_element(o.zero_stages.begin(), o.zero_stages.end());
  const bool has_1f1b = std::find(o.schedules.begin(), o.schedules.end(),
                                  ScheduleKind::one_f_one_b) != o.schedules.end();

  for (int t : tp_options(N_, req_.cluster.devices_per_host)) {
    double total_params = 0;
    for (int u = 0; u < U_; ++u) total_params += double(unit_params(m_, u, t));
    for (int64_t pp64 : divisors(N_ / t)) {
      const int pp = int(pp64);
      if (pp > U_) break;
      const int dp = N_ / (t * pp);
      // Model state alone, with a perfectly even split, already over the device: skip the
      // layout (but remember how close its most frugal setting comes, for the answer).
      const double opt_share = opt_bytes / (max_zero >= 1 ? dp : 1);
      if (total_params / pp * (state_bytes + opt_share) > capacity_) {
        frugal_memory(t, pp, dp, true);
        continue;
      }
      if (G % dp != 0) {
        if (frugal_memory(t, pp, dp, false) <= capacity_) dp_fit_but_batch_.insert(dp);
        continue;
      }
      const int64_t per_replica = G / dp;
      for (int64_t b : divisors(per_replica)) {
        if (o.max_micro_batch > 0 && b > o.max_micro_batch) break;
        const int64_t m = per_replica / b;
        bool any_fit = false;
        // Two chunks as a V; rank 0 would hold a tied embedding twice (layout/plan.h).
        const bool v_fits = !m_.tie_embeddings && U_ >= 2 * pp;
        for (bool rc : o.recompute) {
          for (ScheduleKind s : o.schedules) {
            // Without a pipeline, gpipe is 1f1b holding more activations: not an alternative.
            if (s == ScheduleKind::gpipe && pp == 1 && has_1f1b) continue;
            // Zero-bubble schedules and the dispatcher only help a pipeline.
            if ((s == ScheduleKind::zb_h1 || s == ScheduleKind::zb_v ||
                 s == ScheduleKind::adaptive) &&
                pp == 1)
              continue;
            int v_lo = 1, v_hi = 1;
            if (s == ScheduleKind::interleaved_one_f_one_b) {
              if (pp < 2 || m % pp != 0) continue;
              v_lo = 2;
              v_hi = std::min(o.max_virtual_stages, U_ / pp);
            } else if (s == ScheduleKind::zb_v) {
              if (!v_fits) continue;
              v_lo = v_hi = 2;
            }
            // The dispatcher runs one chunk per rank, or zb-v's V.
            const int shapes = s == ScheduleKind::adaptive && v_fits ? 2 : 1;
            // Just-in-time recomputation: whole backwards, no other recompute, a pipeline.
            const bool jit_able = !rc && pp > 1 &&
                                  (s == ScheduleKind::gpipe || s == ScheduleKind::one_f_one_b ||
                                   s == ScheduleKind::interleaved_one_f_one_b);
            for (int shape = 0; shape < shapes; ++shape) {
              for (int v = shape == 1 ? 2 : v_lo; v <= (shape == 1 ? 2 : v_hi); ++v) {
                for (bool jit : o.jit_recompute) {
                  if (jit && !jit_able) continue;
                  for (int zero : o.zero_stages) {
                    if (zero >= 1 && dp == 1) continue;  // nothing to shard
                    any_fit |= evaluate(t, pp, dp, v, b, m, Variant{s, rc, jit, shape == 1}, zero);
                  }
                }
              }
            }
          }
        }
        // Larger micro-batches only need more activation memory.
        if (!any_fit) break;
      }
    }
  }

  // Fastest first; among equals the one needing less memory, then the simpler settings.
  std::stable_sort(records_.begin(), records_.end(), [](const Record& a, const Record& b) {
    if (a.step != b.step) return a.step < b.step;
    if (a.memory != b.memory) return a.memory < b.memory;
    return std::tie(a.zero, a.recompute, a.jit, a.v) < std::tie(b.zero, b.recompute, b.jit, b.v);
  });
  std::set<std::tuple<int, int, int, int64_t, int>> seen;
  for (const Record& r : records_) {
    if (int(result_.ranked.size()) >= std::max(1, o.top_k)) break;
    if (!seen.insert({r.tp, r.pp, r.v, r.b, int(r.schedule)}).second) continue;
    Candidate c = candidate(r, r.split->units_per_stage);
    result_.ranked.push_back(std::move(c));
  }
  if (result_.ranked.empty()) result_.infeasible = infeasible_message();
  result_.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return std::move(result_);
}

int64_t Searcher::smallest_fitting_world() {
  // Add hosts one at a time (then in growing steps, to bound the work) until the most frugal
  // setting of some layout fits. The global batch is left out: the answer is about memory. Hosts
  // are whole ones of this kind, also when the request used part of one (--gpus 1 of a DGX), so
  // the answer does not depend on how many of a host's devices were asked for.
  const int64_t per_host = req_.cluster.whole_host_devices();
  int64_t step = per_host;
  for (int64_t w = (N_ / per_host + 1) * per_host, tries = 0;
       w <= int64_t(N_) * 1024 && w < (1 << 24); w += step, ++tries) {
    if (tries >= 256 && tries % 256 == 0) step *= 2;
    for (int t : tp_options(int(w), int(per_host))) {
      for (int64_t pp : divisors(w / t)) {
        if (pp > U_) break;
        if (frugal_memory(t, int(pp), int(w / (t * pp)), false) <= capacity_) return w;
      }
    }
  }
  return 0;
}

std::string Searcher::infeasible_message() {
  const int64_t G = req_.global_batch;
  if (!dp_fit_but_batch_.empty()) {
    const int d = *dp_fit_but_batch_.begin();
    std::vector<int> dps(dp_fit_but_batch_.begin(), dp_fit_but_batch_.end());
    const int64_t lower = G / d * d, upper = (G / d + 1) * d;
    return fmt::format(
        "global batch {} does not divide over any layout that fits: the layouts of {} devices "
        "that fit in memory have dp in {{{}}}, and dp must divide the global batch; use a global "
        "batch that is a multiple of {} (e.g. {}{})",
        G, N_, fmt::join(dps, ", "), d, lower > 0 ? fmt::format("{} or ", lower) : "", upper);
  }
  if (std::isinf(smallest_bytes_)) {
    const auto tps = tp_options(N_, req_.cluster.devices_per_host);
    return fmt::format(
        "no dp x tp x pp layout of {} devices suits model '{}' with global batch {}: tp must "
        "divide the {} devices of a host and the model's heads (possible: {}), pp can be at "
        "most the {} units (n_layer + 2) and dp must divide the global batch; use fewer devices "
        "or a larger global batch",
        N_, m_.name, G, req_.cluster.devices_per_host, fmt::join(tps, ", "), U_);
  }
  std::string msg =
      fmt::format("no layout of model '{}' fits on {} x {}: the smallest ({}) {}", m_.name, N_,
                  req_.cluster.device.name, smallest_what_, smallest_reason_);
  const int64_t need = smallest_fitting_world();
  if (need > 0) {
    msg += fmt::format("; use >= {} devices or a smaller model", need);
  } else {
    msg += "; use a smaller model, a shorter sequence or devices with more memory";
  }
  return msg;
}

}  // namespace

SearchResult search(const SearchRequest& req) {
  req.model.validate();
  req.cluster.validate();
  TESSEL_CHECK(req.global_batch >= 1, ConfigError,
               "plan search: the global batch is {}; it must be at least 1", req.global_batch);
  TESSEL_CHECK(req.seq >= 1 && req.seq <= req.model.max_seq_len, ConfigError,
               "plan search: sequence length {} is outside model '{}' (1 to max_seq_len {}); "
               "choose a --seq in that range",
               req.seq, req.model.name, req.model.max_seq_len);
  TESSEL_CHECK(!req.options.zero_stages.empty() && !req.options.recompute.empty() &&
                   !req.options.schedules.empty() && !req.options.jit_recompute.empty(),
               ConfigError,
               "plan search: the schedule, ZeRO and recompute choices must not be empty");
  for (int z : req.options.zero_stages) {
    TESSEL_CHECK(z == 0 || z == 1, ConfigError,
                 "plan search: ZeRO stage {} is not supported (use 0 or 1)", z);
  }
  return Searcher(req).run();
}

Candidate predict(const SearchRequest& req, const layout::Plan& plan) {
  req.model.validate();
  req.cluster.validate();
  TESSEL_CHECK(req.seq >= 1 && req.seq <= req.model.max_seq_len, ConfigError,
               "predict: sequence length {} is outside model '{}' (1 to max_seq_len {})", req.seq,
               req.model.name, req.model.max_seq_len);
  return Searcher(req).predict(plan);
}

}  // namespace tessel::planner
