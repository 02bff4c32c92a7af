#include "tessel/layout/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "tessel/core/check.h"

namespace tessel::layout {

std::string_view schedule_name(ScheduleKind s) {
  switch (s) {
    case ScheduleKind::gpipe:
      return "gpipe";
    case ScheduleKind::one_f_one_b:
      return "1f1b";
    case ScheduleKind::interleaved_one_f_one_b:
      return "interleaved-1f1b";
    case ScheduleKind::zb_h1:
      return "zb-h1";
    case ScheduleKind::zb_v:
      return "zb-v";
    case ScheduleKind::adaptive:
      return "adaptive";
  }
  return "?";
}

ScheduleKind parse_schedule(std::string_view name) {
  for (auto s :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved_one_f_one_b,
        ScheduleKind::zb_h1, ScheduleKind::zb_v, ScheduleKind::adaptive}) {
    if (schedule_name(s) == name) return s;
  }
  TESSEL_THROW(ConfigError,
               "unknown schedule '{}' (known: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, "
               "adaptive)",
               name);
}

int Plan::dispatch_cap(int pp_rank) const {
  if (memory_cap > 0) return memory_cap;
  const int64_t v = virtual_stages, m = micro_batches, r = pp_rank;
  if (v_shaped()) return int(std::max<int64_t>(1, std::min<int64_t>(v * m, 2 * pp)));
  if (v == 1) return int(std::max<int64_t>(1, std::min<int64_t>(m, pp)));
  return int(std::max<int64_t>(1, std::min<int64_t>(v * m, 2 * (pp - r - 1) + (v - 1) * pp + 1)));
}

int Plan::dispatch_backward_cap(int pp_rank) const {
  if (memory_cap > 0 || virtual_stages != 1) return 0;
  return int(std::max<int64_t>(1, std::min<int64_t>(micro_batches, pp - pp_rank)));
}

std::string_view rank_order_name(RankOrder o) {
  switch (o) {
    case RankOrder::tp_dp_pp:
      return "tp-dp-pp";
    case RankOrder::dp_tp_pp:
      return "dp-tp-pp";
  }
  return "?";
}

RankOrder parse_rank_order(std::string_view name) {
  for (auto o : {RankOrder::tp_dp_pp, RankOrder::dp_tp_pp}) {
    if (rank_order_name(o) == name) return o;
  }
  TESSEL_THROW(ConfigError, "unknown rank order '{}' (known: tp-dp-pp, dp-tp-pp)", name);
}

Coord Plan::coord_of(int rank) const {
  TESSEL_CHECK(0 <= rank && rank < world(), InvalidArgumentError,
               "rank {} is outside the plan's {} workers", rank, world());
  Coord c;
  c.pp = rank / (dp * tp);
  const int inner = rank % (dp * tp);
  if (order == RankOrder::tp_dp_pp) {
    c.tp = inner % tp;
    c.dp = inner / tp;
  } else {
    c.dp = inner % dp;
    c.tp = inner / dp;
  }
  return c;
}

int Plan::rank_of(Coord c) const {
  TESSEL_CHECK(0 <= c.dp && c.dp < dp && 0 <= c.tp && c.tp < tp && 0 <= c.pp && c.pp < pp,
               InvalidArgumentError,
               "coordinate (dp {}, tp {}, pp {}) is outside the plan's grid "
               "dp {} x tp {} x pp {}",
               c.dp, c.tp, c.pp, dp, tp, pp);
  return order == RankOrder::tp_dp_pp ? (c.pp * dp + c.dp) * tp + c.tp
                                      : (c.pp * tp + c.tp) * dp + c.dp;
}

namespace {

int num_units(const model::ModelConfig& config) {
  return config.n_layer + 2;
}

std::string units_text(const model::ModelConfig& config) {
  return fmt::format("{} units ({} layers + embedding + head)", num_units(config), config.n_layer);
}

void check_stage_count(const model::ModelConfig& config, int pp, int virtual_stages) {
  const int64_t stages = int64_t(pp) * virtual_stages;
  TESSEL_CHECK(
      stages <= num_units(config), ConfigError,
      "plan: pp {} x virtual_stages {} = {} pipeline stages but model '{}' has only {}; lower "
      "pp or virtual_stages",
      pp, virtual_stages, stages, config.name, units_text(config));
}

// Up to `limit` divisors of n, for "choose one of ..." hints.
std::string divisors(int64_t n, int limit = 8) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n && int(d.size()) < limit; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return fmt::format("{}", fmt::join(d, ", "));
}

// The layers_per_stage contract (see plan.h): one positive entry per stage, summing to the
// model's units.
void check_layers_per_stage(const Plan& plan, const model::ModelConfig& config) {
  const auto& lps = plan.layers_per_stage;
  TESSEL_CHECK(
      int(lps.size()) == plan.num_stages(), ConfigError,
      "plan: layers_per_stage has {} entries but pp {} x virtual_stages {} = {} stages need "
      "one each; list {} unit counts or leave it empty for the default split",
      lps.size(), plan.pp, plan.virtual_stages, plan.num_stages(), plan.num_stages());
  int64_t sum = 0;
  for (size_t s = 0; s < lps.size(); ++s) {
    TESSEL_CHECK(
        lps[s] >= 1, ConfigError,
        "plan: layers_per_stage[{}] is {}; every stage needs at least one unit (a layer, the "
        "embedding or the head)",
        s, lps[s]);
    sum += lps[s];
  }
  TESSEL_CHECK(
      sum == num_units(config), ConfigError,
      "plan: layers_per_stage [{}] sums to {} but model '{}' has {}; the embedding and the head "
      "count one unit each",
      fmt::join(lps, ", "), sum, config.name, units_text(config));
}

}  // namespace

std::vector<int> default_layers_per_stage(const model::ModelConfig& config, int pp,
                                          int virtual_stages) {
  const int units = num_units(config);
  TESSEL_CHECK(pp >= 1 && virtual_stages >= 1, ConfigError,
               "pp {} and virtual_stages {} must both be at least 1", pp, virtual_stages);
  check_stage_count(config, pp, virtual_stages);
  const int S = pp * virtual_stages;
  std::vector<int> lps(S, units / S);
  int extra = units % S;  // < S, so at most all interior stages plus stage 0
  for (int s = 1; s + 1 < S && extra > 0; ++s, --extra) ++lps[s];
  if (extra > 0) ++lps[0];
  return lps;
}

Plan Plan::with_defaults(const model::ModelConfig& config) const {
  Plan p = *this;
  if (!p.layers_per_stage.empty()) return p;
  p.layers_per_stage = default_layers_per_stage(config, pp, virtual_stages);
  if (p.v_shaped() && virtual_stages == 2 && int(p.layers_per_stage.size()) == 2 * pp) {
    // A V pairs virtual stages s and 2 pp - 1 - s on one rank: equal units per rank (the rest
    // to the ranks without the embedding and the head, which rank 0 holds both of), each rank's
    // share split between its two chunks.
    const int units = num_units(config);
    std::vector<int> quota(size_t(pp), units / pp);
    for (int r = pp - 1, extra = units % pp; r >= 1 && extra > 0; --r, --extra) ++quota[size_t(r)];
    for (int r = 0; r < pp; ++r) {
      const int first = (quota[size_t(r)] + 1) / 2;
      p.layers_per_stage[size_t(r)] = first;
      p.layers_per_stage[size_t(2 * pp - 1 - r)] = quota[size_t(r)] - first;
    }
  }
  return p;
}

std::vector<model::StageRange> Plan::stage_ranges(const model::ModelConfig& config) const {
  check_layers_per_stage(*this, config);
  const int head_unit = config.n_layer + 1;
  std::vector<model::StageRange> ranges;
  int begin = 0;  // first unit of the stage
  for (int count : layers_per_stage) {
    const int end = begin + count;
    // Unit u in [1, n_layer] is block u - 1; clamp away the embedding and head units.
    const int first_block = std::max(begin, 1) - 1;
    const int end_block = std::min(end, head_unit) - 1;
    ranges.push_back(
        model::StageRange{first_block, end_block, begin == 0, end == head_unit + 1}.resolved(
            config));
    begin = end;
  }
  return ranges;
}

void Plan::validate(const model::ModelConfig& config, int64_t global_batch, int world_size) const {
  config.validate();
  auto positive = [](int64_t value, const char* field) {
    TESSEL_CHECK(value >= 1, ConfigError, "plan: {} is {}; it must be at least 1", field, value);
  };
  positive(dp, "dp");
  positive(tp, "tp");
  positive(pp, "pp");
  positive(virtual_stages, "virtual_stages");
  positive(micro_batch, "micro_batch");
  positive(micro_batches, "micro_batches");
  positive(global_batch, "the global batch (training.global_batch)");
  TESSEL_CHECK(zero_stage == 0 || zero_stage == 1, ConfigError,
               "plan: zero_stage is {}; tessel supports 0 (replicated optimizer state) and 1 "
               "(optimizer state sharded over dp)",
               zero_stage);

  int64_t workers = 0;
  const bool huge = __builtin_mul_overflow(int64_t(dp) * tp, int64_t(pp), &workers);
  TESSEL_CHECK(!huge && workers == world_size, ConfigError,
               "plan has dp {} x tp {} x pp {} = {} workers but {} were started; start {} workers "
               "or change dp, tp or pp so that their product is {}",
               dp, tp, pp, workers, world_size, workers, world_size);

  // tp shards heads (and with them n_embd = n_head * head_dim), the MLP's hidden features and the
  // padded vocabulary of the embedding and head.
  const std::string_view name = config.name;
  TESSEL_CHECK(config.n_head % tp == 0, ConfigError,
               "plan: tp {} does not divide n_head {} of model '{}'; choose tp from {}", tp,
               config.n_head, name, divisors(config.n_head));
  // K/V heads are split when tp divides them and replicated (each kv head shared by tp /
  // n_kv_head ranks) when tp is a multiple of them; anything else leaves a rank with part of one.
  TESSEL_CHECK(config.n_kv_head % tp == 0 || tp % config.n_kv_head == 0, ConfigError,
               "plan: tp {} neither divides n_kv_head {} of model '{}' nor is a multiple of it; "
               "choose tp dividing n_kv_head ({}) or a multiple of it that divides n_head {}",
               tp, config.n_kv_head, name, divisors(config.n_kv_head), config.n_head);
  TESSEL_CHECK(config.ffn_hidden % tp == 0, ConfigError,
               "plan: tp {} does not divide ffn_hidden {} of model '{}'; choose tp from {}", tp,
               config.ffn_hidden, name, divisors(config.ffn_hidden));
  TESSEL_CHECK(config.padded_vocab() % tp == 0, ConfigError,
               "plan: tp {} does not divide the padded vocabulary {} (vocab_size {} rounded up to "
               "a multiple of 128) of model '{}'; use a tp dividing {}, e.g. a power of two",
               tp, config.padded_vocab(), config.vocab_size, name, config.padded_vocab());

  if (schedule == ScheduleKind::interleaved_one_f_one_b) {
    TESSEL_CHECK(pp >= 2 && virtual_stages >= 2, ConfigError,
                 "plan: the interleaved-1f1b schedule needs pp >= 2 and virtual_stages >= 2 "
                 "(have pp {}, virtual_stages {}); raise them or use schedule 1f1b",
                 pp, virtual_stages);
    TESSEL_CHECK(micro_batches % pp == 0, ConfigError,
                 "plan: the interleaved-1f1b schedule needs micro_batches ({}) to be a multiple "
                 "of pp ({}); use micro_batches {} or {}",
                 micro_batches, pp, std::max<int64_t>(pp, micro_batches / pp * pp),
                 (micro_batches / pp + 1) * pp);
  } else if (v_shaped()) {
    TESSEL_CHECK(virtual_stages == 2, ConfigError,
                 "plan: the {} places two model chunks per pipeline rank as a V; set "
                 "virtual_stages to 2 (have {})",
                 schedule == ScheduleKind::zb_v ? "zb-v schedule" : "v_shape placement",
                 virtual_stages);
    // Rank 0 holds the embedding (virtual stage 0) and the head (the last): tied, it would hold
    // the embedding twice.
    TESSEL_CHECK(
        !config.tie_embeddings, ConfigError,
        "plan: the V (schedule zb-v, or v_shape) puts the embedding and the head of model "
        "'{}' on pipeline rank 0, and its head is tied to the embedding, which the runtime "
        "does not share within a rank yet; use schedule zb-h1 or 1f1b (or no v_shape), or a "
        "model with tie_embeddings: false",
        name);
  } else if (schedule != ScheduleKind::adaptive) {
    TESSEL_CHECK(virtual_stages == 1, ConfigError,
                 "plan: virtual_stages is {} but only the interleaved-1f1b, zb-v and adaptive "
                 "schedules run more than one stage per pipeline rank; set virtual_stages to 1 or "
                 "schedule to interleaved-1f1b",
                 virtual_stages);
  }
  TESSEL_CHECK(!jit_recompute || schedule == ScheduleKind::gpipe ||
                   schedule == ScheduleKind::one_f_one_b ||
                   schedule == ScheduleKind::interleaved_one_f_one_b,
               ConfigError,
               "plan: jit_recompute re-runs a forward before its whole backward, and the {} "
               "schedule splits its backward passes; use schedule gpipe, 1f1b or "
               "interleaved-1f1b, or remove jit_recompute",
               schedule_name(schedule));
  TESSEL_CHECK(!jit_recompute || recompute == model::Recompute::none, ConfigError,
               "plan: jit_recompute recomputes whole stages; set recompute to none (it is {})",
               model::recompute_name(recompute));
  TESSEL_CHECK(!v_shape || schedule == ScheduleKind::adaptive, ConfigError,
               "plan: v_shape places the adaptive schedule's chunks as a V; the {} schedule "
               "fixes its own placement (zb-v is the V of fixed lists); remove v_shape",
               schedule_name(schedule));
  TESSEL_CHECK(memory_cap >= 0, ConfigError,
               "plan: memory_cap {} is negative; give the micro-batches of activations a "
               "pipeline rank may hold (>= 1), or 0 for 1F1B's budget",
               memory_cap);
  TESSEL_CHECK(memory_cap == 0 || schedule == ScheduleKind::adaptive, ConfigError,
               "plan: memory_cap {} applies only to the adaptive schedule (the {} schedule's "
               "lists fix what is held); remove it or set schedule: adaptive",
               memory_cap, schedule_name(schedule));

  check_stage_count(config, pp, virtual_stages);
  check_layers_per_stage(with_defaults(config), config);

  int64_t per_step = 0;
  const bool overflow = __builtin_mul_overflow(micro_batch, micro_batches, &per_step) ||
                        __builtin_mul_overflow(per_step, int64_t(dp), &per_step);
  if (overflow || per_step != global_batch) {
    std::string fix;
    if (global_batch % dp != 0) {
      fix = fmt::format("dp {} must divide the global batch; choose dp from {}", dp,
                        divisors(global_batch));
    } else if ((global_batch / dp) % micro_batch != 0) {
      fix = fmt::format("micro_batch must divide the {} samples per replica; choose from {}",
                        global_batch / dp, divisors(global_batch / dp));
    } else {
      fix = fmt::format("set micro_batches to {}", global_batch / dp / micro_batch);
    }
    TESSEL_THROW(ConfigError,
                 "plan: micro_batch {} x micro_batches {} x dp {} = {} samples per step but the "
                 "global batch is {}; {}",
                 micro_batch, micro_batches, dp,
                 overflow ? std::string("too many") : std::to_string(per_step), global_batch, fix);
  }
}

std::string Plan::describe() const {
  std::string s =
      fmt::format("dp={} tp={} pp={} v={} mb={}x{} {} zero{}", dp, tp, pp, virtual_stages,
                  micro_batch, micro_batches, schedule_name(schedule), zero_stage);
  if (recompute != model::Recompute::none)
    s += recompute == model::Recompute::full ? " recompute" : " recompute=selective";
  if (memory_cap > 0) s += fmt::format(" cap={}", memory_cap);
  if (jit_recompute) s += " jit-recompute";
  if (v_shape) s += " v-shape";
  if (order != RankOrder::tp_dp_pp) s += fmt::format(" order={}", rank_order_name(order));
  if (layers_per_stage.size() > 1) s += fmt::format(" units={}", fmt::join(layers_per_stage, ","));
  return s;
}

nlohmann::json to_json(const Plan& p) {
  return nlohmann::json{
      {"dp", p.dp},
      {"tp", p.tp},
      {"pp", p.pp},
      {"virtual_stages", p.virtual_stages},
      {"micro_batch", p.micro_batch},
      {"micro_batches", p.micro_batches},
      {"schedule", schedule_name(p.schedule)},
      {"zero_stage", p.zero_stage},
      {"recompute", std::string(model::recompute_name(p.recompute))},
      {"layers_per_stage", p.layers_per_stage},
      {"rank_order", rank_order_name(p.order)},
      {"memory_cap", p.memory_cap},
      {"jit_recompute", p.jit_recompute},
      {"v_shape", p.v_shape},
  };
}

namespace {

const nlohmann::json& field(const nlohmann::json& doc, const char* key) {
  TESSEL_CHECK(doc.contains(key), CorruptDataError, "plan document has no '{}' field", key);
  return doc.at(key);
}

template <typename Int>
Int to_int(const nlohmann::json& v, const std::string& what) {
  bool ok = v.is_number_integer();
  if (ok && v.is_number_unsigned()) {
    ok = v.get<uint64_t>() <= uint64_t(std::numeric_limits<Int>::max());
  } else if (ok) {
    const int64_t x = v.get<int64_t>();
    ok = x >= std::numeric_limits<Int>::min() && x <= std::numeric_limits<Int>::max();
  }
  TESSEL_CHECK(ok, CorruptDataError, "plan document: '{}' is {}, not a {}-bit integer", what,
               v.dump(), sizeof(Int) * 8);
  return v.get<Int>();
}

template <typename Int>
Int int_field(const nlohmann::json& doc, const char* key) {
  return to_int<Int>(field(doc, key), key);
}

std::string string_field(const nlohmann::json& doc, const char* key) {
  const auto& v = field(doc, key);
  TESSEL_CHECK(v.is_string(), CorruptDataError, "plan document: '{}' is {}, not a string", key,
               v.dump());
  return v.get<std::string>();
}

// Re-throws a name parser's ConfigError as corrupt data: the name came from a stored document.
template <typename Parse>
auto parse_stored(Parse parse, const std::string& name) {
  try {
    return parse(name);
  } catch (const ConfigError& e) {
    throw CorruptDataError(std::string("plan document: ") + e.what());
  }
}

}  // namespace

Plan plan_from_json(const nlohmann::json& doc) {
  TESSEL_CHECK(doc.is_object(), CorruptDataError, "plan document is {}, not a JSON object",
               doc.type_name());
  Plan p;
  p.dp = int_field<int>(doc, "dp");
  p.tp = int_field<int>(doc, "tp");
  p.pp = int_field<int>(doc, "pp");
  p.virtual_stages = int_field<int>(doc, "virtual_stages");
  p.micro_batch = int_field<int64_t>(doc, "micro_batch");
  p.micro_batches = int_field<int64_t>(doc, "micro_batches");
  p.schedule = parse_stored(parse_schedule, string_field(doc, "schedule"));
  p.zero_stage = int_field<int>(doc, "zero_stage");
  // "none" / "selective" / "full"; plans written before selective existed say false / true.
  const auto& recompute = field(doc, "recompute");
  TESSEL_CHECK(recompute.is_boolean() ||
                   (recompute.is_string() &&
                    (recompute == "none" || recompute == "selective" || recompute == "full")),
               CorruptDataError,
               "plan document: 'recompute' is {}, not \"none\", \"selective\" or \"full\"",
               recompute.dump());
  p.recompute = recompute.is_boolean()
                    ? (recompute.get<bool>() ? model::Recompute::full : model::Recompute::none)
                    : model::parse_recompute(recompute.get<std::string>());
  const auto& lps = field(doc, "layers_per_stage");
  TESSEL_CHECK(lps.is_array(), CorruptDataError,
               "plan document: 'layers_per_stage' is {}, not an array", lps.dump());
  for (size_t i = 0; i < lps.size(); ++i)
    p.layers_per_stage.push_back(to_int<int>(lps[i], fmt::format("layers_per_stage[{}]", i)));
  p.order = parse_stored(parse_rank_order, string_field(doc, "rank_order"));
  // Absent from plans written before the adaptive schedule.
  if (doc.contains("memory_cap")) p.memory_cap = int_field<int>(doc, "memory_cap");
  if (doc.contains("jit_recompute")) {
    const auto& jit = doc.at("jit_recompute");
    TESSEL_CHECK(jit.is_boolean(), CorruptDataError,
                 "plan document: 'jit_recompute' is {}, not true or false", jit.dump());
    p.jit_recompute = jit.get<bool>();
  }
  if (doc.contains("v_shape")) {
    const auto& v = doc.at("v_shape");
    TESSEL_CHECK(v.is_boolean(), CorruptDataError,
                 "plan document: 'v_shape' is {}, not true or false", v.dump());
    p.v_shape = v.get<bool>();
  }
  return p;
}

}  // namespace tessel::layout
