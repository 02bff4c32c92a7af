#include "tessel/config/train_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "tessel/config/init_from.h"
#include "tessel/config/yaml_reader.h"
#include "tessel/core/log.h"
#include "tessel/model/recompute.h"
#include "tessel/planner/local_plan.h"

namespace tessel::config {

namespace {

std::string resolve(const std::string& path, const std::filesystem::path& base) {
  if (path.empty() || std::filesystem::path(path).is_absolute()) return path;
  return (base / path).lexically_normal().string();
}

model::ModelConfig read_model(YamlSection s) {
  std::string preset;
  s.read("preset", preset);
  model::ModelConfig m;
  if (!preset.empty()) {
    m = model::ModelConfig::preset(preset);
  } else {
    TESSEL_CHECK(s.has("family"), ConfigError,
                 "{}: give either 'preset' (one of the named models) or 'family' (gpt2 or llama) "
                 "with the sizes",
                 s.where("preset"));
  }
  if (s.has("family")) {
    std::string family;
    s.read("family", family);
    const auto f = model::parse_family(family);
    // A family other than the preset's (or no preset) brings its own defaults: a llama has no
    // biases and no tied head unless the section says so.
    if (preset.empty() || f != m.family) {
      const auto d = model::ModelConfig::family_defaults(f);
      m.family = f;
      m.tie_embeddings = d.tie_embeddings;
      m.bias = d.bias;
      if (preset.empty()) {
        m.norm_eps = d.norm_eps;
        m.rope_theta = d.rope_theta;
      }
    }
  }
  s.read("name", m.name);
  s.read("n_layer", m.n_layer);
  s.read("n_embd", m.n_embd);
  s.read("n_head", m.n_head);
  s.read("n_kv_head", m.n_kv_head);
  s.read("ffn_hidden", m.ffn_hidden);
  s.read("vocab_size", m.vocab_size);
  s.read("max_seq_len", m.max_seq_len);
  s.read("norm_eps", m.norm_eps);
  s.read("rope_theta", m.rope_theta);
  s.read("tie_embeddings", m.tie_embeddings);
  s.read("bias", m.bias);
  // A preset's kv heads follow its heads unless set: changing n_head alone keeps MHA models MHA
  // (a preset's GQA stays); a model without a preset is MHA unless n_kv_head says otherwise.
  if (s.has("n_head") && !s.has("n_kv_head") && (m.family == model::Family::gpt2 || preset.empty()))
    m.n_kv_head = m.n_head;
  // Without a preset the MLP width follows the family's rule unless given.
  if (preset.empty() && !s.has("ffn_hidden") && m.n_embd > 0)
    m.ffn_hidden = model::ModelConfig::default_ffn_hidden(m.family, m.n_embd);
  if (m.name.empty()) m.name = preset.empty() ? "custom" : preset;
  s.reject_unknown_keys();
  return m;
}

// Reads the plan keys of a `parallel:` section into `p` (micro-batching derived from training,
// see train_config.h); returns the plan's micro_batch.
void read_plan(YamlSection& s, const TrainingConfig& training, layout::Plan& p) {
  s.read("dp", p.dp);
  s.read("tp", p.tp);
  s.read("pp", p.pp);
  s.read("virtual_stages", p.virtual_stages);
  s.read("zero_stage", p.zero_stage);
  s.read("memory_cap", p.memory_cap);
  s.read("jit_recompute", p.jit_recompute);
  s.read("v_shape", p.v_shape);
  s.read("layers_per_stage", p.layers_per_stage);
  std::string schedule = std::string(layout::schedule_name(p.schedule));
  s.read("schedule", schedule);
  p.schedule = layout::parse_schedule(schedule);
  std::string order = std::string(layout::rank_order_name(p.order));
  s.read("rank_order", order);
  p.order = layout::parse_rank_order(order);
  // none | selective | full (model/recompute.h); true and false say full and none.
  std::string recompute = std::string(model::recompute_name(p.recompute));
  s.read("recompute", recompute);
  if (recompute == "true") recompute = "full";
  if (recompute == "false") recompute = "none";
  try {
    p.recompute = model::parse_recompute(recompute);
  } catch (const ConfigError& e) {
    TESSEL_THROW(ConfigError, "{}: {}", s.where("recompute"), e.what());
  }
  TESSEL_CHECK(p.dp >= 1, ConfigError, "{}: must be >= 1, got {}", s.where("dp"), p.dp);
  const int64_t G = training.global_batch;
  const int64_t per_replica = G % p.dp == 0 ? G / p.dp : 0;
  if (s.has("micro_batch")) {
    s.read("micro_batch", p.micro_batch);
  } else if (p.dp == 1) {
    p.micro_batch = training.micro_batch;  // validate() explains a micro_batch that does not divide
  } else if (per_replica > 0) {
    int64_t mb = std::min(std::max<int64_t>(training.micro_batch, 1), per_replica);
    while (per_replica % mb != 0) --mb;
    p.micro_batch = mb;
  } else {
    p.micro_batch = std::max<int64_t>(training.micro_batch, 1);
  }
  // When the sizes do not divide, the floor still makes validate() explain which one to change.
  p.micro_batches = p.micro_batch >= 1 ? std::max<int64_t>(1, per_replica / p.micro_batch) : 1;
}

// Reads the optional `parallel:` section into c.plan (after `training`, whose batch sizes it uses).
void read_parallel(YamlSection s, TrainConfig& c, const std::filesystem::path& base) {
  if (s.has("plan_file")) {
    // A plan from `tessel plan --out plan.json` (or its whole --json document): the layout keys
    // come from it, so they may not be given here as well.
    std::string file;
    s.read("plan_file", file);
    file = resolve(file, base);
    for (const char* key :
         {"dp", "tp", "pp", "virtual_stages", "micro_batch", "schedule", "zero_stage",
          "layers_per_stage", "rank_order", "recompute", "memory_cap"})
      TESSEL_CHECK(!s.has(key), ConfigError,
                   "{}: 'plan_file' gives the whole layout; remove '{}' or the plan file",
                   s.where(key), key);
    std::ifstream in(file);
    TESSEL_CHECK(in.good(), IoError, "{}: cannot read plan file '{}'", s.where("plan_file"), file);
    nlohmann::json doc;
    try {
      doc = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TESSEL_THROW(ConfigError, "{}: plan file '{}' is not JSON: {}", s.where("plan_file"), file,
                   e.what());
    }
    try {
      c.plan = layout::plan_from_json(doc.is_object() && doc.contains("plan") ? doc["plan"] : doc);
    } catch (const Error& e) {
      TESSEL_THROW(ConfigError, "{}: plan file '{}': {}", s.where("plan_file"), file, e.what());
    }
  } else {
    read_plan(s, c.training, c.plan);
  }
  s.read("timeout_s", c.comm_timeout_s);
  TESSEL_CHECK(c.comm_timeout_s > 0, ConfigError, "{}: must be > 0 seconds, got {}",
               s.where("timeout_s"), c.comm_timeout_s);
  s.read("bucket_mb", c.bucket_mb);
  TESSEL_CHECK(c.bucket_mb > 0, ConfigError, "{}: must be > 0 MiB, got {}", s.where("bucket_mb"),
               c.bucket_mb);
  if (c.plan.micro_batch >= 1) c.training.micro_batch = c.plan.micro_batch;
  s.reject_unknown_keys();
}

// The optional `timeline:` list (after `parallel`).
void read_timeline(YamlSection& top, TrainConfig& c) {
  for (auto& entry : top.list("timeline")) {
    PlanSwitch sw;
    TESSEL_CHECK(entry.has("at_step"), ConfigError,
                 "{}: every timeline entry needs 'at_step' (e.g. {{at_step: 100, parallel: {{dp: "
                 "2}}}})",
                 entry.where("at_step"));
    entry.read("at_step", sw.at_step);
    TESSEL_CHECK(entry.has("parallel") != entry.has("workers"), ConfigError,
                 "{}: every timeline entry needs either the plan to switch to (parallel: {{dp: .., "
                 "tp: .., pp: ..}}) or a worker count for the planner (workers: N)",
                 entry.where("parallel"));
    if (entry.has("workers")) {
      entry.read("workers", sw.workers);
      TESSEL_CHECK(sw.workers >= 1, ConfigError, "{}: must be >= 1, got {}", entry.where("workers"),
                   sw.workers);
    } else {
      auto par = entry.section("parallel");
      read_plan(par, c.training, sw.plan);
      par.reject_unknown_keys();
    }
    entry.reject_unknown_keys();
    const int64_t prev = c.timeline.empty() ? 0 : c.timeline.back().at_step;
    TESSEL_CHECK(sw.at_step > prev && sw.at_step < c.training.steps, ConfigError,
                 "{}: is {} but timeline steps must increase and lie in ({}, {}) (after the "
                 "previous switch, before training.steps)",
                 entry.where("at_step"), sw.at_step, prev, c.training.steps);
    c.timeline.push_back(std::move(sw));
  }
}

// TrainConfig::load and TrainConfig::parse, from the YAML document.
TrainConfig from_yaml(const YAML::Node& root, const std::string& path) {
  auto base = std::filesystem::absolute(path).parent_path();
  TrainConfig c;
  c.source = path;
  YamlSection top(root, "", path);
  if (top.has("init_from")) {
    top.read("init_from", c.init_from);
    TESSEL_CHECK(!c.init_from.empty(), ConfigError,
                 "{}: is empty; name a Hugging Face model directory or a tessel checkpoint",
                 top.where("init_from"));
    c.init_from = resolve(c.init_from, base);
  }
  TESSEL_CHECK(top.has("model") || !c.init_from.empty(), ConfigError,
               "{}: missing section 'model' (e.g. model: {{preset: gpt2-tiny}}), or init_from: "
               "with the weights to start from",
               path);
  if (!c.init_from.empty()) {
    const auto source = init_from_model(c.init_from);
    if (top.has("model")) {
      c.model = read_model(top.section("model"));
      check_init_from_model(c.model, source, c.init_from);
    } else {
      c.model = source;
    }
  } else {
    c.model = read_model(top.section("model"));
  }

  auto data = top.section("data");
  data.read("path", c.data.path);
  data.read("seq_len", c.data.seq_len);
  data.read("eval_fraction", c.data.eval_fraction);
  data.read("seed", c.data.seed);
  data.reject_unknown_keys();
  c.data.path = resolve(c.data.path, base);

  auto t = top.section("training");
  t.read("steps", c.training.steps);
  t.read("global_batch", c.training.global_batch);
  t.read("micro_batch", c.training.micro_batch);
  if (!t.has("micro_batch")) c.training.micro_batch = c.training.global_batch;
  // Evaluation reads batches of the micro-batch as written, whatever a plan makes of it, so that
  // every layout evaluates the same samples.
  c.training.eval_micro_batch = c.training.micro_batch;
  t.read("seed", c.training.seed);
  t.read("grad_clip", c.training.grad_clip);
  t.read("eval_every", c.training.eval_every);
  t.read("eval_batches", c.training.eval_batches);
  t.read("log_every", c.training.log_every);
  t.read("backend", c.training.backend);
  t.read_choice("gemm", c.training.gemm, {"auto", "onednn", "openblas"});
  t.read_choice("precision", c.training.precision, {"fp32", "bf16"});
  t.read("huge_pages", c.training.huge_pages);
  t.read("threads", c.training.threads);
  t.read("stop_at", c.training.stop_at);
  t.reject_unknown_keys();

  auto o = top.section("optimizer");
  o.read("lr", c.optimizer.lr);
  c.optimizer.min_lr = c.optimizer.lr * 0.1;
  o.read("min_lr", c.optimizer.min_lr);
  o.read("warmup_steps", c.optimizer.warmup_steps);
  o.read("beta1", c.optimizer.beta1);
  o.read("beta2", c.optimizer.beta2);
  o.read("eps", c.optimizer.eps);
  o.read("weight_decay", c.optimizer.weight_decay);
  o.reject_unknown_keys();

  auto ck = top.section("checkpoint");
  ck.read("dir", c.checkpoint.dir);
  ck.read("every", c.checkpoint.every);
  ck.read("resume", c.checkpoint.resume);
  ck.read("keep", c.checkpoint.keep);
  ck.read("copies", c.checkpoint.copies);
  ck.read("async", c.checkpoint.async);
  ck.read_choice("on_error", c.checkpoint.on_error, {"continue", "stop"});
  ck.reject_unknown_keys();
  c.checkpoint.dir = resolve(c.checkpoint.dir, base);

  auto out = top.section("output");
  out.read("metrics", c.metrics_path);
  out.read("events", c.events_path);
  out.read("data_order", c.data_order_path);
  out.read("rank_params", c.rank_params_dir);
  out.read("trace", c.trace_path);
  out.read("trace_steps", c.trace_steps);
  out.reject_unknown_keys();
  TESSEL_CHECK(c.trace_steps >= 1 && c.trace_steps <= 1000, ConfigError,
               "{}: is {}; record between 1 and 1000 steps (a trace of many steps is large and "
               "slow to open)",
               out.where("trace_steps"), c.trace_steps);
  c.trace_path = resolve(c.trace_path, base);
  c.rank_params_dir = resolve(c.rank_params_dir, base);
  c.metrics_path = resolve(c.metrics_path, base);
  c.events_path = resolve(c.events_path, base);
  c.data_order_path = resolve(c.data_order_path, base);

  read_parallel(top.section("parallel"), c, base);
  read_timeline(top, c);
  auto el = top.section("elastic");
  el.read("hosts_file", c.hosts_file);
  el.read("replace_failed", c.replace_failed);
  el.read("prepare_steps", c.prepare_steps);
  el.read_choice("reshard_transport", c.reshard_transport, {"direct", "network"});
  el.read("transfer_streams", c.transfer_streams);
  TESSEL_CHECK(c.transfer_streams >= 1 && c.transfer_streams <= 16, ConfigError,
               "{}: must be 1..16 streams, got {}", el.where("transfer_streams"),
               c.transfer_streams);
  TESSEL_CHECK(c.prepare_steps >= 0, ConfigError, "{}: must be >= 0 steps, got {}",
               el.where("prepare_steps"), c.prepare_steps);
  el.read("control_store", c.control_store);
  TESSEL_CHECK(c.control_store == "embedded" || c.control_store.rfind("http://", 0) == 0 ||
                   c.control_store.rfind("https://", 0) == 0,
               ConfigError,
               "{}: '{}' is neither 'embedded' nor an etcd endpoint 'http://host:port' (etcd's "
               "--advertise-client-urls)",
               el.where("control_store"), c.control_store);
  el.read("heartbeat_timeout_s", c.heartbeat_timeout_s);
  TESSEL_CHECK(c.heartbeat_timeout_s >= 1 && c.heartbeat_timeout_s <= 3600, ConfigError,
               "{}: must be 1..3600 seconds, got {}", el.where("heartbeat_timeout_s"),
               c.heartbeat_timeout_s);
  el.read("stop_grace_s", c.stop_grace_s);
  TESSEL_CHECK(c.stop_grace_s >= 0 && c.stop_grace_s <= 86400, ConfigError,
               "{}: must be 0..86400 seconds, got {}", el.where("stop_grace_s"), c.stop_grace_s);
  el.read("grow_to_slots", c.grow_to_slots);
  el.reject_unknown_keys();
  c.hosts_file = resolve(c.hosts_file, base);

  top.reject_unknown_keys();
  // Worker counts become the planner's plans (deterministic: every worker gets the same).
  for (auto& sw : c.timeline)
    if (sw.workers > 0) sw.plan = c.plan_for_workers(sw.workers);
  c.validate();
  c.plan = c.plan.with_defaults(c.model);
  for (auto& sw : c.timeline) sw.plan = sw.plan.with_defaults(c.model);
  return c;
}
}  // namespace

TrainConfig TrainConfig::load(const std::string& path) {
  return from_yaml(load_yaml_file(path), path);
}

TrainConfig TrainConfig::parse(const std::string& text, const std::string& path) {
  return from_yaml(parse_yaml(text, path), path);
}

namespace {

// dp x tp x pp of a plan not validated yet, to check it against; Plan::world() would overflow
// its int for the sizes a config may hold. `where` names the plan in the config.
int checked_world(const layout::Plan& p, const std::string& source, const std::string& where) {
  int64_t world = 0;
  TESSEL_CHECK(!__builtin_mul_overflow(int64_t(p.dp) * p.tp, int64_t(p.pp), &world) &&
                   world >= std::numeric_limits<int>::min() &&
                   world <= std::numeric_limits<int>::max(),
               ConfigError,
               "{}: '{}' has dp {} x tp {} x pp {} workers, more than any job can start; lower "
               "them",
               source, where, p.dp, p.tp, p.pp);
  return int(world);
}

}  // namespace

void TrainConfig::validate() const {
  const std::string& f = source;
  model.validate();
  TESSEL_CHECK(!data.path.empty(), ConfigError,
               "{}: 'data.path' is required (a token file from `tessel data prepare`)", f);
  TESSEL_CHECK(data.seq_len >= 1 && data.seq_len <= model.max_seq_len, ConfigError,
               "{}: 'data.seq_len' is {} but must be in 1..{} (the model's max_seq_len)", f,
               data.seq_len, model.max_seq_len);
  TESSEL_CHECK(data.eval_fraction >= 0 && data.eval_fraction < 1, ConfigError,
               "{}: 'data.eval_fraction' must be in [0, 1), got {}", f, data.eval_fraction);
  TESSEL_CHECK(training.steps >= 1, ConfigError, "{}: 'training.steps' must be >= 1", f);
  TESSEL_CHECK(training.global_batch >= 1 && training.micro_batch >= 1, ConfigError,
               "{}: 'training.global_batch' and 'training.micro_batch' must be >= 1", f);
  TESSEL_CHECK(training.global_batch % training.micro_batch == 0, ConfigError,
               "{}: 'training.micro_batch' ({}) must divide 'training.global_batch' ({}); e.g. "
               "micro_batch {}",
               f, training.micro_batch, training.global_batch,
               std::gcd(training.micro_batch, training.global_batch));
  TESSEL_CHECK(training.eval_every >= 0 && training.eval_batches >= 1, ConfigError,
               "{}: 'training.eval_every' must be >= 0 and 'training.eval_batches' >= 1", f);
  TESSEL_CHECK(training.eval_every == 0 || data.eval_fraction > 0, ConfigError,
               "{}: 'training.eval_every' is set but 'data.eval_fraction' is 0: nothing to "
               "evaluate on",
               f);
  // 0: the launcher's share of the cores. More than a machine has cores only oversubscribes, and
  // OpenMP fails to create tens of thousands of threads (it crashed the process).
  TESSEL_CHECK(training.threads >= 0 && training.threads <= 1024, ConfigError,
               "{}: 'training.threads' is {}; it must be from 0 (automatic) to 1024", f,
               training.threads);
  TESSEL_CHECK(training.stop_at >= 0, ConfigError, "{}: 'training.stop_at' must be >= 0", f);
  TESSEL_CHECK(optimizer.lr > 0 && optimizer.min_lr >= 0 && optimizer.min_lr <= optimizer.lr,
               ConfigError, "{}: need 0 <= 'optimizer.min_lr' <= 'optimizer.lr' and lr > 0", f);
  TESSEL_CHECK(optimizer.warmup_steps >= 0, ConfigError,
               "{}: 'optimizer.warmup_steps' must be >= 0", f);
  TESSEL_CHECK(
      optimizer.beta1 >= 0 && optimizer.beta1 < 1 && optimizer.beta2 >= 0 && optimizer.beta2 < 1,
      ConfigError, "{}: 'optimizer.beta1' and 'optimizer.beta2' must be in [0, 1)", f);
  TESSEL_CHECK(optimizer.eps > 0 && optimizer.weight_decay >= 0, ConfigError,
               "{}: 'optimizer.eps' must be > 0 and 'optimizer.weight_decay' >= 0", f);
  TESSEL_CHECK(checkpoint.every >= 0 && checkpoint.keep >= 1, ConfigError,
               "{}: 'checkpoint.every' must be >= 0 and 'checkpoint.keep' >= 1", f);
  TESSEL_CHECK(checkpoint.copies == 1 || checkpoint.copies == 2, ConfigError,
               "{}: 'checkpoint.copies' is {}: 1 (each host's own disk) or 2 (and a copy on "
               "another host)",
               f, checkpoint.copies);
  validate_plan(checked_world(plan, f, "parallel"));
}

void TrainConfig::use_plan(const layout::Plan& p, const std::string& path) {
  TESSEL_CHECK(timeline.empty(), ConfigError,
               "--plan {}: {} has a timeline of plans, which --plan cannot replace; remove the "
               "timeline or leave out --plan",
               path, source);
  const layout::Plan with = p.with_defaults(model);
  TESSEL_CHECK(with.global_batch() == training.global_batch, ConfigError,
               "--plan {}: its global batch is {} (dp {} x micro_batch {} x micro_batches {}), "
               "{}'s training.global_batch {}; plan for that batch or change the config",
               path, with.global_batch(), with.dp, with.micro_batch, with.micro_batches, source,
               training.global_batch);
  plan = with;
  training.micro_batch = plan.micro_batch;
  try {
    validate();
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("--plan {}: {}", path, e.what()));
  }
}

void TrainConfig::validate_plan(int workers) const {
  try {
    plan.validate(model, training.global_batch, workers);
  } catch (const ConfigError& e) {
    // Adds the config file to the plan's message; its location already names where it failed.
    throw ConfigError(fmt::format("{}: parallel: {}", source, e.what()));
  }
  for (size_t i = 0; i < timeline.size(); ++i) {
    const auto& p = timeline[i].plan;
    const int world = checked_world(p, source, fmt::format("timeline[{}].parallel", i));
    try {
      p.validate(model, training.global_batch, world);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{}: timeline[{}].parallel: {}", source, i, e.what()));
    }
  }
}

const layout::Plan& TrainConfig::plan_of_generation(int generation) const {
  TESSEL_CHECK(generation >= 0 && generation <= int(timeline.size()), InvalidArgumentError,
               "generation {} is outside the config's 0..{}", generation, timeline.size());
  return generation == 0 ? plan : timeline[size_t(generation - 1)].plan;
}

int TrainConfig::generation_at(int64_t step) const {
  int g = 0;
  while (g < int(timeline.size()) && timeline[size_t(g)].at_step <= step) ++g;
  return g;
}

const layout::Plan& TrainConfig::plan_at(int64_t step) const {
  return plan_of_generation(generation_at(step));
}

layout::Plan TrainConfig::plan_for_workers(int workers, int prefer_micro_batch) const {
  return planner::plan_for_workers(
      {model, training.global_batch, data.seq_len, workers, source, prefer_micro_batch});
}

int TrainConfig::max_workers() const {
  int n = plan.world();
  for (const auto& sw : timeline) n = std::max(n, sw.plan.world());
  return n;
}

void TrainConfig::validate_for_workers(int workers) const {
  validate();
  if (timeline.empty()) {
    validate_plan(workers);
  } else {
    TESSEL_CHECK(workers == max_workers(), ConfigError,
                 "{}: the timeline's largest plan needs {} workers but {} were started; run "
                 "with --nproc {}",
                 source, max_workers(), workers, max_workers());
  }
  if (workers > 1) {
    for (int g = 0; g < generations(); ++g) {
      const auto& p = plan_of_generation(g);
      TESSEL_CHECK(p.zero_stage == 0 || p.zero_stage == 1, ConfigError,
                   "{}: '{}zero_stage' is {} but the multi-worker trainer supports only 0 "
                   "and 1 yet; set it to 0 or 1",
                   source,
                   g == 0 ? std::string("parallel.") : fmt::format("timeline[{}].parallel.", g - 1),
                   p.zero_stage);
    }
  }
}

kernels::AdamWConfig OptimizerConfig::adamw_step(double lr, int64_t step, float clip_factor) const {
  kernels::AdamWConfig opt;
  opt.lr = float(lr);
  opt.beta1 = float(beta1);
  opt.beta2 = float(beta2);
  opt.eps = float(eps);
  opt.step = step + 1;
  opt.grad_scale = clip_factor;
  opt.zero_grad = true;
  return opt;
}

}  // namespace tessel::config
