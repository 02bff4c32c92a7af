#include "tessel/runtime/parallel_trainer.h"

#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <span>
#include <thread>

#include "tessel/checkpoint/model_json.h"
#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/comm/bucketed_all_reduce.h"
#include "tessel/comm/process_groups.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/data/batch_loader.h"
#include "tessel/data/token_source.h"
#include "tessel/elastic/switch_marker.h"
#include "tessel/kernels/backend.h"
#include "tessel/layout/state_layout.h"
#include "tessel/layout/training_state.h"
#include "tessel/layout/zero_split.h"
#include "tessel/model/transformer.h"
#include "tessel/reshard/executor.h"
#include "tessel/reshard/transfer_plan.h"
#include "tessel/runtime/lr_schedule.h"
#include "tessel/runtime/metrics.h"
#include "tessel/runtime/prepared_chunks.h"
#include "tessel/runtime/tp_comm_group.h"
#include "tessel/store/async_saver.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/tensor/allocator.h"

namespace tessel::runtime {

using checkpoint::add_rank_state;
using checkpoint::check_resumable;
using checkpoint::checkpoint_meta;
using checkpoint::checkpoint_step_name;
using checkpoint::latest_sharded_checkpoint;
using checkpoint::load_rank_state;
using checkpoint::publish_checkpoint;
using comm::BucketedAllReduce;
using config::PlanSwitch;
using config::TrainConfig;
using elastic::failure_report_path;
using elastic::FailureReport;
using elastic::prepare_marker_path;
using elastic::recovery_deadline;
using elastic::recovery_path;
using elastic::scale_request_path;
using elastic::switch_marker_path;
using elastic::SwitchMarker;

namespace {

std::string env_string(const char* name, bool required) {
  const char* v = std::getenv(name);
  TESSEL_CHECK(v != nullptr || !required, ConfigError,
               "environment variable {} is not set: start workers with `tessel train CONFIG "
               "--nproc N` (or `tessel launch`), which sets it",
               name);
  return v != nullptr ? std::string(v) : std::string();
}

int64_t env_int(const char* name, bool required) {
  std::string s = env_string(name, required);
  if (s.empty()) return 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  TESSEL_CHECK(end != nullptr && *end == '\0' && v >= 0, ConfigError,
               "environment variable {}='{}' is not a non-negative integer", name, s);
  return v;
}

enum class Kind : uint32_t { activation = 0, grad = 1 };

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Waits until rank files 0..n-1 are in a save's staging directory (each appears whole: they are
// renamed into place), bounded by `timeout`.
// `cancelled` (set when a peer failed) ends the wait at once with PeerLostError.
void wait_for_rank_files(const std::string& staging, int n, std::chrono::milliseconds timeout,
                         const std::atomic<bool>& cancelled) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int r = 0; r < n; ++r) {
    const auto path = std::filesystem::path(staging) / store::rank_file_name(r);
    while (!std::filesystem::exists(path)) {
      TESSEL_CHECK(!cancelled.load(), PeerLostError,
                   "checkpoint: a peer failed before rank {}'s file {} was written", r,
                   path.string());
      TESSEL_CHECK(std::chrono::steady_clock::now() < deadline, TimeoutError,
                   "checkpoint: rank {}'s file {} did not appear within {} ms", r, path.string(),
                   timeout.count());
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

// Pipeline messages are matched by (micro-batch, virtual stage of the sender, kind).
uint32_t message_tag(int micro_batch, int sender_vs, int num_vs, Kind kind) {
  return ((uint32_t(micro_batch) * uint32_t(num_vs) + uint32_t(sender_vs)) << 1) | uint32_t(kind);
}

}  // namespace

WorkerEnv WorkerEnv::from_environment() {
  WorkerEnv e;
  e.rank = int(env_int("TESSEL_RANK", true));
  e.world_size = int(env_int("TESSEL_WORLD_SIZE", true));
  e.store_dir = env_string("TESSEL_STORE_DIR", true);
  e.job_id = env_string("TESSEL_JOB_ID", true);
  e.generation = env_int("TESSEL_GENERATION", false);
  // A worker started for a switch (TESSEL_JOIN_GENERATION) may take a rank beyond the world the
  // job started with: its place comes from the switch.
  TESSEL_CHECK(
      e.world_size >= 1 && (e.rank < e.world_size || env_int("TESSEL_JOIN_GENERATION", false) > 0),
      ConfigError, "TESSEL_RANK {} is not below TESSEL_WORLD_SIZE {}", e.rank, e.world_size);
  return e;
}

namespace {

// One generation of the job: this process as rank `rank` of `plan`, with its process groups, its
// model chunks and its optimizer state. A live switch of plans builds a new World and moves the
// state into it (ParallelTrainer::Impl::transition).
struct World {
  // One model chunk (virtual stage) of this pipeline rank.
  struct Chunk {
    int vs = 0;
    model::StageRange range;
    std::unique_ptr<model::Transformer> model;
    Tensor adam_m, adam_v;          // ZeRO-1: only the owned range [own_lo, own_lo + own_n)
    std::vector<size_t> dp_counts;  // ZeRO-1: the flat buffer's split over dp ranks
    int64_t own_lo = 0, own_n = 0;
    int tied_view = -1;      // the token embedding's view when its two copies are summed
    bool tied_copy = false;  // the head stage's copy (left out of the gradient norm)
    // Activation slots: slot_of[mb] is the slot holding micro-batch mb's activations (-1:
    // none); a forward takes a free slot, its backward gives it back.
    std::vector<int> slot_of;
    std::vector<int> free_slots;
    int backwards_done = 0;   // this step's backwards so far (the M-th completes the gradients)
    int grad_bucket_id = -1;  // the chunk's gradient buffer in grad_reduce
  };

  const TrainConfig& cfg;
  WorkerEnv env;
  layout::Plan plan;
  int rank = 0;  // in this generation's world
  comm::ProcessGroups groups;
  std::unique_ptr<CommTpGroup> tp_group;
  // Shared with the next generation's World, which may take over models that refer to it.
  std::shared_ptr<kernels::Backend> backend;
  std::shared_ptr<const data::TokenSource> source;
  std::unique_ptr<data::BatchLoader> loader;
  std::vector<Chunk> chunks;
  // dp > 1 without ZeRO: the dp all-reduce of the gradients, in buckets, overlapped with each
  // chunk's last backward of the step.
  std::unique_ptr<BucketedAllReduce> grad_reduce;
  std::vector<schedule::Instruction> program;  // this pipeline rank's instruction list
  int num_vs = 1;
  int64_t B = 1, T = 1, C = 1, M = 1;               // micro-batch, seq_len, n_embd, micro-batches
  std::vector<int32_t> inputs, targets;             // this replica's share of the global batch
  std::vector<std::vector<float>> act_in, grad_in;  // [chunk * M + mb] received boundary data
  LrSchedule lr_schedule;
  int64_t step = 0, cursor = 0;
  MetricsWriter metrics;
  double last_grad_norm = 0;
  double pipeline_idle = 0;  // last step: share of the pipeline phase all ranks spent waiting
  std::optional<layout::StateLayout> state_layout;  // built at the first checkpoint
  // Set when a peer failed: a background save then stops waiting for the other ranks' files.
  std::atomic<bool> save_cancelled{false};
  store::AsyncSaver saver;  // checkpoint.async (after save_cancelled: its thread reads it)
  int generation = 0;       // the job's generation this world belongs to
  // True while a ZeRO-1 update is half applied (owned range stepped, parameters not yet
  // gathered): a failure then leaves this rank's state inconsistent.
  bool updating = false;
  // The step's pipeline transfers. Members, not locals: when a step fails they must outlive the
  // unwinding until abort() has broken the communicators, or destroying them would wait for
  // peers that are themselves stuck.
  std::deque<std::vector<float>> send_buffers;
  std::vector<comm::Request> sends;
  std::vector<std::optional<comm::Request>> recvs;
  // Chunk state taken over from the donor world of a switch: (chunk, donor chunk, buffer kind
  // 0 params / 1 adam_m / 2 adam_v), so a failed switch can give it back (give_back).
  std::vector<std::tuple<int, int, int>> taken;
  int data_log_fd = -1;  // output.data_order, on the first tp and pp rank of each replica
  bool cancelled_save_checked = false;  // see ParallelTrainer::run

  // Joins generation `generation` (store prefix) as `rank` of `p`'s world and builds this rank's
  // chunks: initialised from the seed when `init_params`, else zero (state arrives by resharding).
  // `donor` (a live switch): the old world of this process; chunks whose state the transfer plan
  // keeps in place (same shard, same layout) are taken over from it instead of being rebuilt
  // when their micro-batch size and activation slots match. `prepared`: chunks built ahead for
  // this rank of `p` (prepared_chunks.h), used where nothing is taken over.
  World(const TrainConfig& c, const WorkerEnv& e, const layout::Plan& p, int rank_in_plan,
        int64_t generation, bool init_params, World* donor = nullptr,
        const reshard::TransferPlan* transfer = nullptr, PreparedChunks* prepared = nullptr)
      : cfg(c), env(e), plan(p.with_defaults(c.model)), rank(rank_in_plan) {
    if (cfg.training.threads > 0) omp_set_num_threads(cfg.training.threads);

    comm::GridLayout grid;
    grid.dp = plan.dp;
    grid.tp = plan.tp;
    grid.pp = plan.pp;
    if (plan.order == layout::RankOrder::dp_tp_pp)
      grid.order = {comm::Axis::kDp, comm::Axis::kTp, comm::Axis::kPp};
    comm::StoreOptions store;
    store.path = env.store_dir;
    store.job_id = env.job_id;
    store.generation = generation;
    const auto timeout = std::chrono::milliseconds(int64_t(cfg.comm_timeout_s * 1000));
    store.timeout = timeout;
    groups = comm::connect_process_groups(store, grid, rank, plan.world(), timeout);
    if (plan.tp > 1) tp_group = std::make_unique<CommTpGroup>(*groups.tp);

    if (donor != nullptr)
      backend = donor->backend;
    else if (prepared != nullptr)
      backend = prepared->backend;
    else
      backend = std::shared_ptr<kernels::Backend>(kernels::make_backend(cfg.training.backend));
    source = data::open_token_source(cfg.data.path);
    TESSEL_CHECK(source->vocab_size() <= uint64_t(cfg.model.vocab_size), ConfigError,
                 "{}: the data {} has token ids up to {} but model '{}' has vocab_size {}",
                 cfg.source, source->describe(), source->vocab_size() - 1, cfg.model.name,
                 cfg.model.vocab_size);
    loader = std::make_unique<data::BatchLoader>(source, cfg.data.seq_len, cfg.data.seed,
                                                 cfg.data.eval_fraction);
    B = plan.micro_batch;
    T = cfg.data.seq_len;
    C = cfg.model.n_embd;
    M = plan.micro_batches;
    num_vs = plan.num_stages();

    program = pipeline_program(plan, groups.coord.pp);
    const std::vector<int> peak = activation_peaks(program, plan.virtual_stages);

    const auto ranges = plan.stage_ranges(cfg.model);
    const std::string wte =
        model::global_param_name(cfg.model.family, model::GlobalParam::token_embedding);
    for (int c = 0; c < plan.virtual_stages; ++c) {
      Chunk ch;
      ch.vs = plan.stage_of(groups.coord.pp, c);
      ch.range = ranges[size_t(ch.vs)];
      // Buffers in StateLayout order: per chunk its parameters, Adam m, Adam v.
      auto kept = [&](int kind) {
        return donor != nullptr && transfer != nullptr ? transfer->kept_from(rank, 3 * c + kind)
                                                       : -1;
      };
      if (const int b = kept(0); b >= 0) {
        auto& old = donor->chunks[size_t(b / 3)].model;
        if (old && !old->training_buffers_released() &&
            old->activation_slots() == peak[size_t(c)] && donor->B == B) {
          old->rebind_tp_group(tp_group.get());
          // A step that failed half-way (a recovery) left partial sums in the gradients.
          old->zero_grad();
          ch.model = std::move(old);
          taken.emplace_back(c, b / 3, 0);
        }
      }
      if (!ch.model && prepared != nullptr && prepared->models[size_t(c)]) {
        ch.model = std::move(prepared->models[size_t(c)]);
        ch.model->rebind_tp_group(tp_group.get());
      }
      if (!ch.model)
        ch.model = std::make_unique<model::Transformer>(cfg.model, *backend, int(B), int(T),
                                                        ch.range, tp_group.get(), peak[size_t(c)]);
      ch.slot_of.assign(size_t(M), -1);
      for (int i = peak[size_t(c)] - 1; i >= 0; --i) ch.free_slots.push_back(i);
      if (init_params) ch.model->init(cfg.training.seed);
      const int64_t n = ch.model->num_params();
      ch.own_n = n;
      if (plan.zero_stage == 1) {
        auto z = layout::zero_split(n, plan.dp, groups.coord.dp);
        ch.dp_counts = std::move(z.counts);
        ch.own_lo = z.lo;
        ch.own_n = z.n_own;
      }
      // Adam moments: the donor's where the transfer keeps them, else prepared ones, else new.
      const int64_t n_adam = std::max<int64_t>(ch.own_n, 1);
      auto adam = [&](int kind, Tensor Chunk::*member, std::vector<Tensor> PreparedChunks::*ready) {
        if (const int b = kept(kind); b >= 0) {
          Tensor& t = donor->chunks[size_t(b / 3)].*member;
          if (t.defined() && t.numel() == n_adam) {
            taken.emplace_back(c, b / 3, kind);
            return std::move(t);
          }
        }
        if (prepared != nullptr) {
          Tensor& t = (prepared->*ready)[size_t(c)];
          if (t.defined() && t.numel() == n_adam) return std::move(t);
        }
        return Tensor::zeros({n_adam});
      };
      ch.adam_m = adam(1, &Chunk::adam_m, &PreparedChunks::adam_m);
      ch.adam_v = adam(2, &Chunk::adam_v, &PreparedChunks::adam_v);
      if (cfg.model.tie_embeddings && plan.pp > 1 &&
          (ch.range.has_embedding || ch.range.has_head)) {
        const auto& views = ch.model->param_views();
        for (size_t i = 0; i < views.size(); ++i)
          if (views[i].name == wte) ch.tied_view = int(i);
        ch.tied_copy = !ch.range.has_embedding;
      }
      chunks.push_back(std::move(ch));
    }
    if (plan.dp > 1 && plan.zero_stage == 0) {
      const auto bucket = std::max<int64_t>(1, int64_t(cfg.bucket_mb * (1 << 20) / sizeof(float)));
      grad_reduce = std::make_unique<BucketedAllReduce>(*groups.dp_grad, bucket);
      for (auto& ch : chunks)
        ch.grad_bucket_id =
            grad_reduce->add_buffer(ch.model->grads().data<float>(), ch.model->num_params());
    }

    inputs.resize(size_t(B * M * T));
    targets.resize(inputs.size());
    act_in.assign(size_t(plan.virtual_stages * M), std::vector<float>(size_t(B * T * C)));
    grad_in.assign(act_in.size(), std::vector<float>(size_t(B * T * C)));
    lr_schedule = LrSchedule{cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.warmup_steps,
                             cfg.training.steps};
    if (rank == 0) metrics = MetricsWriter(cfg.metrics_path);
    if (!cfg.data_order_path.empty() && groups.coord.tp == 0 && groups.coord.pp == 0) {
      data_log_fd =
          ::open(cfg.data_order_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      TESSEL_CHECK(data_log_fd >= 0, IoError, "cannot open output.data_order file {}",
                   cfg.data_order_path);
    }
  }

  ~World() {
    if (data_log_fd >= 0) ::close(data_log_fd);
  }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  // Breaks every communicator of this world (comm::ProcessGroups::abort), so that peers waiting
  // on this process fail at once, stops a background save from waiting for the other ranks'
  // files, then drops the step's pending transfers.
  void abort(const std::string& why) noexcept {
    groups.abort(why);
    save_cancelled = true;
    recvs.clear();
    sends.clear();
    send_buffers.clear();
  }

  // Gives the chunk state this world took over from `donor` back to it (a switch failed).
  void give_back(World& donor) {
    for (const auto& [c, b, kind] : taken) {
      auto& mine = chunks[size_t(c)];
      auto& theirs = donor.chunks[size_t(b)];
      if (kind == 0) {
        theirs.model = std::move(mine.model);
        theirs.model->rebind_tp_group(donor.tp_group.get());
      } else {
        (kind == 1 ? theirs.adam_m : theirs.adam_v) =
            std::move(kind == 1 ? mine.adam_m : mine.adam_v);
      }
    }
    taken.clear();
  }

  // One line of output.data_order for the samples this replica has just loaded for step + 1
  // (O_APPEND: lines of different processes do not mix). Written before any collective of the
  // step, so a step that commits anywhere has every replica's line in its generation; a step
  // that is redone after a failure appears again in a later generation, which then counts.
  void log_data_order(int64_t first, int64_t count) const {
    if (data_log_fd < 0) return;
    const std::string line = nlohmann::json({{"step", step + 1},
                                             {"generation", generation},
                                             {"process", env.rank},
                                             {"dp_rank", groups.coord.dp},
                                             {"first", first},
                                             {"count", count}})
                                 .dump() +
                             "\n";
    TESSEL_CHECK(::write(data_log_fd, line.data(), line.size()) == ssize_t(line.size()), IoError,
                 "writing {} failed", cfg.data_order_path);
  }

  // Saves the whole state as checkpoint.dir/step-N (sharded_checkpoint.h): every rank writes its
  // share, then rank 0 publishes it. Collective over the world.
  void save_checkpoint() {
    const auto& dir = cfg.checkpoint.dir;
    if (rank == 0) std::filesystem::create_directories(dir);
    groups.world->barrier();
    if (!state_layout) state_layout = layout::StateLayout::build(cfg.model, plan);
    store::CheckpointWriterOptions opt;
    opt.save_id = fmt::format("{}-{}", env.job_id, step);
    store::CheckpointWriter writer(
        (std::filesystem::path(dir) / checkpoint_step_name(step)).string(), rank, opt);
    std::vector<std::span<const float>> buffers;
    for (auto b : state_buffers()) buffers.emplace_back(b.data(), b.size());
    add_rank_state(writer, *state_layout, rank, buffers);
    if (cfg.checkpoint.async) {
      // The state is already copied (add_rank_state): write in the background. Rank 0 then waits
      // for every rank's file and publishes; a save that fails is reported and leaves the previous
      // checkpoint in place, training goes on.
      const int world_size = plan.world();
      const auto meta = checkpoint_meta();
      const auto timeout = std::chrono::milliseconds(int64_t(cfg.comm_timeout_s * 1000));
      const int keep = cfg.checkpoint.keep;
      const int r = rank;
      const std::atomic<bool>* cancelled = &save_cancelled;
      saver.save(std::move(writer),
                 [world_size, meta, timeout, keep, r, dir, cancelled](store::CheckpointWriter& w) {
                   if (r != 0) return;
                   wait_for_rank_files(w.staging_dir(), world_size, timeout, *cancelled);
                   publish_checkpoint(w, world_size, meta, dir, keep);
                   spdlog::info("saved checkpoint {} ({:.1f} MB from this rank, in the background)",
                                w.dir(), double(w.bytes()) / 1e6);
                 });
      return;
    }
    writer.write_rank_file();
    groups.world->barrier();
    if (rank == 0) {
      publish_checkpoint(writer, plan.world(), checkpoint_meta(), dir, cfg.checkpoint.keep);
      spdlog::info("saved checkpoint {} ({:.1f} MB)", writer.dir(), double(writer.bytes()) / 1e6);
    }
    // Nobody runs ahead (and could die) before the checkpoint is published.
    groups.world->barrier();
  }

  // Ends the background save, if one runs; rethrows its error.
  void finish_checkpoint() { saver.wait(); }

  // Saves this step's checkpoint unless checkpoint.dir already has it published (rank 0 looks;
  // collective over the world). The barrier first: a member may still be finishing the previous
  // world's background save of this very step.
  void save_checkpoint_unless_published() {
    groups.world->barrier();
    int64_t published = -1;
    if (rank == 0)
      if (const auto latest = latest_sharded_checkpoint(cfg.checkpoint.dir))
        published = store::CheckpointReader(*latest).meta().at("step").get<int64_t>();
    std::vector<int64_t> all(size_t(groups.world->size()));
    groups.world->all_gather(&published, 1, all.data());
    if (all[0] != step) save_checkpoint();
  }

  nlohmann::json checkpoint_meta() const {
    return checkpoint::checkpoint_meta(cfg, plan, step, cursor);
  }

  // This rank's training state in StateLayout order (layout/state_layout.h): per chunk, its
  // parameters, Adam m and Adam v (ZeRO-1: the owned range only).
  std::vector<std::span<float>> state_buffers() {
    std::vector<std::span<float>> out;
    for (auto& ch : chunks) {
      out.emplace_back(ch.model->params().data<float>(), size_t(ch.model->num_params()));
      out.emplace_back(ch.adam_m.data<float>(), size_t(ch.adam_m.numel()));
      out.emplace_back(ch.adam_v.data<float>(), size_t(ch.adam_v.numel()));
    }
    return out;
  }

  // Writes <dir>/rank<R>.params: for every parameter view of every chunk, a text line
  // "<name> <numel> <tp_rank> <tp_size>\n" followed by numel raw native floats (this rank's
  // local shard; tensor-parallel shards are not reassembled here).
  void dump_params(const std::string& dir) const {
    auto path = fmt::format("{}/rank{}.params", dir, rank);
    std::FILE* f = std::fopen(path.c_str(), "wb");
    TESSEL_CHECK(f != nullptr, IoError, "cannot write {} (TESSEL_DUMP_PARAMS)", path);
    bool ok = true;
    for (const auto& ch : chunks) {
      const float* params = ch.model->params().data<float>();
      for (const auto& v : ch.model->param_views()) {
        auto head = fmt::format("{} {} {} {}\n", v.name, v.numel, groups.coord.tp, plan.tp);
        ok = ok && std::fwrite(head.data(), 1, head.size(), f) == head.size();
        ok = ok &&
             std::fwrite(params + v.offset, sizeof(float), size_t(v.numel), f) == size_t(v.numel);
      }
    }
    ok = std::fclose(f) == 0 && ok;
    TESSEL_CHECK(ok, IoError, "writing {} failed (TESSEL_DUMP_PARAMS)", path);
  }

  // Runs the chunk's forward on micro-batch mb in a free activation slot (its received input
  // copied there); returns the loss sum on the head stage (0 elsewhere).
  double forward(int c, int mb, float grad_scale) {
    Chunk& ch = chunks[size_t(c)];
    auto& m = *ch.model;
    TESSEL_CHECK(ch.slot_of[size_t(mb)] < 0 && !ch.free_slots.empty(), Error,
                 "internal: no free activation slot for micro-batch {} on virtual stage {} (the "
                 "slots are sized from the schedule's peak in-flight micro-batches)",
                 mb, ch.vs);
    const int slot = ch.free_slots.back();
    ch.free_slots.pop_back();
    ch.slot_of[size_t(mb)] = slot;
    if (!ch.range.has_embedding) {
      const auto& in = act_in[size_t(c * M + mb)];
      std::copy(in.begin(), in.end(), m.input_hidden(slot).data<float>());
    }
    const int32_t* tok = inputs.data() + mb * B * T;
    const int32_t* tgt = targets.data() + mb * B * T;
    const int32_t* first = ch.range.has_embedding ? tok : nullptr;
    if (ch.range.has_head) return m.forward_stage(first, tgt, grad_scale, slot).loss_sum;
    m.forward_stage(first, nullptr, std::nullopt, slot);
    return 0;
  }

  void backward(int c, int mb) {
    Chunk& ch = chunks[size_t(c)];
    const int slot = ch.slot_of[size_t(mb)];
    TESSEL_CHECK(slot >= 0, Error,
                 "internal: backward of micro-batch {} on virtual stage {} without its forward", mb,
                 ch.vs);
    auto& m = *ch.model;
    if (!ch.range.has_head) {
      const auto& g = grad_in[size_t(c * M + mb)];
      std::copy(g.begin(), g.end(), m.output_grad(slot).data<float>());
    }
    if (++ch.backwards_done == M && grad_reduce) {
      m.backward_stage(slot,
                       [&](int64_t from) { grad_reduce->ready_from(ch.grad_bucket_id, from); });
    } else {
      m.backward_stage(slot);
    }
    ch.slot_of[size_t(mb)] = -1;
    ch.free_slots.push_back(slot);
  }

  // The slot holding micro-batch mb's activations on chunk c (for sending its output).
  int slot_of(int c, int mb) const {
    const int slot = chunks[size_t(c)].slot_of[size_t(mb)];
    TESSEL_CHECK(slot >= 0, Error, "internal: send of micro-batch {} before its forward", mb);
    return slot;
  }

  double train_step(double* grad_norm_out) {
    const int64_t per_replica = B * M;
    loader->load(cursor, groups.coord.dp * per_replica, per_replica, inputs.data(), targets.data());
    log_data_order(cursor + groups.coord.dp * per_replica, per_replica);
    int64_t valid = 0;
    for (int32_t t : targets) valid += t != model::Transformer::kIgnoreIndex;
    groups.dp->all_reduce_sum(&valid, 1);
    const float grad_scale = valid > 0 ? 1.0f / float(valid) : 0.0f;

    send_buffers.clear();
    sends.clear();
    double loss_sum = 0;
    for (auto& ch : chunks) ch.backwards_done = 0;
    // The pipeline's idle time: waiting for a receive or for the last sends (the bubble, plus
    // any imbalance between stages), against the time the instruction list took.
    double idle_s = 0;
    const auto pipeline_start = std::chrono::steady_clock::now();
    const size_t boundary = size_t(B * T * C);
    // Every receive of the step is posted up front (each (chunk, micro-batch) has its own
    // buffer) and only waited for at its instruction: Gloo's transport moves a message once the
    // receiver has posted it, so posting late would put a handshake and the whole transfer on the
    // critical path of every micro-batch instead of overlapping them with compute.
    recvs.clear();
    recvs.resize(program.size());
    for (size_t i = 0; i < program.size(); ++i) {
      const auto& ins = program[i];
      const int mb = ins.micro_batch, c = ins.chunk;
      if (ins.op == schedule::Op::recv_activation)
        recvs[i] =
            groups.pp->recv(act_in[size_t(c * M + mb)].data(), boundary * sizeof(float), ins.peer,
                            message_tag(mb, chunks[size_t(c)].vs - 1, num_vs, Kind::activation));
      else if (ins.op == schedule::Op::recv_grad)
        recvs[i] =
            groups.pp->recv(grad_in[size_t(c * M + mb)].data(), boundary * sizeof(float), ins.peer,
                            message_tag(mb, chunks[size_t(c)].vs + 1, num_vs, Kind::grad));
    }
    for (size_t i = 0; i < program.size(); ++i) {
      const auto& ins = program[i];
      const int mb = ins.micro_batch, c = ins.chunk;
      switch (ins.op) {
        case schedule::Op::forward:
          loss_sum += forward(c, mb, grad_scale);
          break;
        case schedule::Op::backward:
          backward(c, mb);
          break;
        case schedule::Op::send_activation: {
          const float* out = chunks[size_t(c)].model->output_hidden(slot_of(c, mb)).data<float>();
          send_buffers.emplace_back(out, out + boundary);
          sends.push_back(
              groups.pp->send(send_buffers.back().data(), boundary * sizeof(float), ins.peer,
                              message_tag(mb, chunks[size_t(c)].vs, num_vs, Kind::activation)));
          break;
        }
        case schedule::Op::recv_activation:
        case schedule::Op::recv_grad: {
          const auto t0 = std::chrono::steady_clock::now();
          recvs[i]->wait();
          idle_s += seconds_since(t0);
          break;
        }
        case schedule::Op::send_grad: {
          const float* g = chunks[size_t(c)].model->input_grad().data<float>();
          send_buffers.emplace_back(g, g + boundary);
          sends.push_back(
              groups.pp->send(send_buffers.back().data(), boundary * sizeof(float), ins.peer,
                              message_tag(mb, chunks[size_t(c)].vs, num_vs, Kind::grad)));
          break;
        }

        case schedule::Op::optimizer_step:
          break;  // below, after the sends completed
        default:
          TESSEL_THROW(UnsupportedError, "pipeline instruction {} is not supported by the worker",
                       schedule::to_string(ins));
      }
    }
    {
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& r : sends) r.wait();
      idle_s += seconds_since(t0);
    }
    const double pipeline_s = seconds_since(pipeline_start);

    // Gradient reductions: over dp (each replica's grad_scale already divides by the global
    // count, so the sum is the global mean's gradient; grad_reduce ran most of it during the last
    // backwards), then the tied embedding's two copies.
    // ZeRO-1 sums the tied copies first (sums commute) and then reduce-scatters over dp, so each
    // dp rank holds the full gradient of its owned range only.
    const bool zero = plan.zero_stage == 1;
    if (grad_reduce) grad_reduce->finish();
    double sq = 0;
    for (auto& ch : chunks) {
      float* grads = ch.model->grads().data<float>();
      const auto& views = ch.model->param_views();
      if (zero) {
        if (ch.tied_view >= 0) {
          const auto& v = views[size_t(ch.tied_view)];
          float* g = grads + v.offset;
          groups.embed->all_reduce_sum(g, size_t(v.numel));
          // The two pipeline ends hold the tied embedding at different offsets of their flat
          // buffers, so the reduce-scatter below would add its dp contributions in different
          // orders on the two (dp >= 3) and the copies would drift apart in the last bits. Reduce
          // it over dp on its own instead (the same ring on both ends, so the same bits) and
          // leave only dp rank 0's sum in the buffer: adding zeros is exact in any order.
          // (With dp 2 both orders are a + b = b + a, exact: nothing to do.)
          if (plan.dp >= 3) {
            groups.dp->all_reduce_sum(g, size_t(v.numel));
            if (groups.coord.dp != 0) std::fill(g, g + v.numel, 0.0f);
          }
        }
        groups.dp->reduce_scatter_sum(grads, ch.dp_counts);
      } else {
        if (ch.tied_view >= 0) {
          const auto& v = views[size_t(ch.tied_view)];
          groups.embed->all_reduce_sum(grads + v.offset, size_t(v.numel));
        }
      }
      const int64_t lo = ch.own_lo, hi = ch.own_lo + ch.own_n;
      for (size_t i = 0; i < views.size(); ++i) {
        if (!views[i].tp_primary || (ch.tied_copy && int(i) == ch.tied_view)) continue;
        const int64_t a = std::max(lo, views[i].offset);
        const int64_t b = std::min(hi, views[i].offset + views[i].numel);
        if (b > a) sq += backend->sum_of_squares(grads + a, b - a);
      }
    }
    // With ZeRO-1 each dp rank counted a distinct range, so the norm also sums over dp.
    if (zero) groups.dp->all_reduce_sum(&sq, 1);
    groups.tp->all_reduce_sum(&sq, 1);
    groups.pp->all_reduce_sum(&sq, 1);
    const double norm = std::sqrt(sq);
    *grad_norm_out = norm;

    kernels::AdamWConfig opt = cfg.optimizer.adamw_step(
        lr_schedule.at(step), step, kernels::clip_factor(norm, float(cfg.training.grad_clip)));
    updating = true;
    for (auto& ch : chunks) {
      float* params = ch.model->params().data<float>();
      float* grads = ch.model->grads().data<float>();
      const int64_t lo = ch.own_lo, hi = ch.own_lo + ch.own_n;
      for (const auto& v : ch.model->param_views()) {
        const int64_t a = std::max(lo, v.offset), b = std::min(hi, v.offset + v.numel);
        if (b <= a) continue;
        opt.weight_decay = v.weight_decay ? float(cfg.optimizer.weight_decay) : 0.0f;
        backend->adamw_update(params + a, grads + a, ch.adam_m.data<float>() + (a - lo),
                              ch.adam_v.data<float>() + (a - lo), b - a, opt);
      }
      if (zero) {
        // The other ranges hold partial sums of the reduce-scatter: clear them for the next step.
        std::fill(grads, grads + ch.model->num_params(), 0.0f);
        groups.dp->all_gather_v(params + lo, ch.dp_counts, params);
      }
    }

    updating = false;
    // The step is committed here: this rank's state is consistent at step + 1 whatever happens
    // to the loss's reduction below (a failure then loses no work of this rank).
    ++step;
    cursor += plan.global_batch();
    send_buffers.clear();

    // The head stages hold the loss; one tp rank of each dp replica contributes it. The idle
    // and pipeline times ride along to give the world's idle share.
    double sums[3] = {groups.tp->rank() == 0 ? loss_sum : 0.0, idle_s, pipeline_s};
    groups.world->all_reduce_sum(sums, 3);
    const double loss = sums[0];
    pipeline_idle = sums[2] > 0 ? sums[1] / sums[2] : 0.0;
    return valid > 0 ? loss / double(valid) : 0.0;
  }
};

}  // namespace

namespace {

int index_of(const std::vector<int>& v, int x) {
  auto it = std::find(v.begin(), v.end(), x);
  return it == v.end() ? -1 : int(it - v.begin());
}

std::vector<int> iota_members(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = i;
  return v;
}

}  // namespace

struct ParallelTrainer::Impl {
  TrainConfig cfg;
  WorkerEnv env;  // env.rank: this process's id (switch_marker.h), fixed for its lifetime
  // Switches so far: the current world lives under store generation env.generation + generation.
  int generation = 0;
  layout::Plan plan;             // in force now (also known while this process has no rank)
  std::vector<int> members;      // the process of each rank of `plan`
  int next_process_id = 0;       // the id the next process a switch adds gets
  int64_t failures = 0;          // failures of the job recovered from (or being recovered from)
  size_t next_static = 0;        // the next timeline entry
  int64_t applied_request = 0;   // the newest scale request applied
  std::unique_ptr<World> world;  // null while this process has no rank in the plan
  std::optional<SwitchMarker> joining;  // started to join this switch (TESSEL_JOIN_GENERATION)
  bool joining_early = false;  // ... from its announcement (prepare-<g>): wait for the switch
  // A switch announced ahead (a timeline entry or a scale request, elastic.prepare_steps): made
  // after `at_step` steps; until then this process builds its buffers in the new plan in the
  // background.
  struct Preparation {
    SwitchMarker sw;
    int64_t at_step = 0;
    bool timeline = false;               // the next timeline entry (else a scale request)
    std::future<PreparedChunks> chunks;  // invalid: this process prepares nothing
  };
  std::optional<Preparation> preparing;
  std::optional<MetricsWriter> events;  // output.events, opened by the first rank 0 writing
  bool fatal = false;  // a failure recovery cannot help (the coordinator gave no answer)

  Impl(TrainConfig c, const WorkerEnv& e) : cfg(std::move(c)), env(e) {
    // Workers of a timeline or of scale requests are started as the plans need them, so the
    // world size in the environment is only checked against a fixed run.
    cfg.validate_for_workers(cfg.timeline.empty() && !elastic() ? env.world_size
                                                                : cfg.max_workers());
    plan = cfg.plan;
    const int64_t join = env_int("TESSEL_JOIN_GENERATION", false);
    if (join > 0) {
      // Started for the switch to generation `join`: take part in it as a receiver only. Its
      // description was written before this process was started.
      // Announced ahead (prepare-<g>) unless the switch itself is already there.
      auto path = switch_marker_path(env.store_dir, env.job_id, int(join));
      if (!std::filesystem::exists(path)) {
        path = prepare_marker_path(env.store_dir, env.job_id, int(join));
        joining_early = true;
      }
      auto m = SwitchMarker::from_json(read_json_file(path), path);
      TESSEL_CHECK(index_of(m.to_members, env.rank) >= 0, ConfigError,
                   "TESSEL_JOIN_GENERATION={}: process {} has no place in {} ({})", join, env.rank,
                   m.to.describe(), path);
      generation = int(join) - 1;
      plan = m.from;
      members = m.from_members;
      next_process_id = m.next_process_id;
      failures = m.failures;
      applied_request = m.applied_request;
      skip_timeline_through(m.step);
      joining = std::move(m);
      return;
    }
    if (resume()) return;
    TESSEL_CHECK(env.rank < plan.world(), ConfigError,
                 "worker rank {} has no place in {}: `tessel train` starts workers as the plans "
                 "need them",
                 env.rank, plan.describe());
    members = iota_members(plan.world());
    next_process_id = plan.world();
    world = std::make_unique<World>(cfg, env, plan, env.rank, env.generation, true);
  }

  // Whether the launcher takes scale requests for this job (`tessel ctl scale`) and recovers
  // from failed workers; read once, not at every step boundary.
  bool elastic() const { return elastic_; }
  const bool elastic_ = env_int("TESSEL_ELASTIC", false) == 1;

  // The process reporting progress, metrics and events: rank 0 of the current world.
  bool lead() const { return world != nullptr && world->rank == 0; }

  void skip_timeline_through(int64_t step) {
    while (next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step <= step)
      ++next_static;
  }

  // Continues from the newest checkpoint in checkpoint.dir, saved under any plan: this process
  // joins the plan the config has in force at the saved step and reads its share. Returns false
  // when there is none (or resume is off).
  bool resume() {
    if (cfg.checkpoint.dir.empty() || !cfg.checkpoint.resume) return false;
    auto path = latest_sharded_checkpoint(cfg.checkpoint.dir);
    if (!path) return false;
    store::CheckpointReader reader(*path);
    const auto& meta = reader.meta();
    check_resumable(cfg, meta, *path);
    const int64_t step = meta.at("step").get<int64_t>();
    plan = cfg.plan_at(step);
    skip_timeline_through(step);
    TESSEL_CHECK(env.rank < plan.world(), ConfigError,
                 "worker rank {} has no place in {}, the plan at step {}", env.rank,
                 plan.describe(), step);
    members = iota_members(plan.world());
    next_process_id = plan.world();
    world = std::make_unique<World>(cfg, env, plan, env.rank, env.generation, false);
    load_rank_state(reader, layout::StateLayout::build(cfg.model, world->plan), env.rank,
                    world->state_buffers());
    world->step = step;
    world->cursor = meta.at("cursor").get<int64_t>();
    if (env.rank == 0)
      spdlog::info("resumed from {} at step {} (saved under {}, continuing under {})", *path, step,
                   layout::plan_from_json(meta.at("plan")).describe(), world->plan.describe());
    return true;
  }

  // The switch to make after the step just finished, if any (collective over the world when the
  // job takes scale requests: every rank must decide alike, and every rank computes the same
  // new members).
  std::optional<SwitchMarker> next_switch() {
    const int64_t step = world->step;
    std::optional<SwitchMarker> sw;
    if (preparing) {
      // Requests wait (queued) while a switch is prepared; it happens at its step.
      if (preparing->at_step > step) return std::nullopt;
      if (preparing->timeline) ++next_static;
      sw = preparing->sw;  // the buffers stay in `preparing` for transition()
    } else if (next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step == step) {
      sw = timeline_switch(cfg.timeline[next_static++]);
    } else if (elastic()) {
      // The newest request any rank has seen; the request files only ever appear, so every rank
      // can read the agreed one after the all-reduce.
      int64_t seen = applied_request;
      while (std::filesystem::exists(scale_request_path(env.store_dir, env.job_id, seen + 1)))
        ++seen;
      std::vector<int64_t> all(size_t(world->groups.world->size()));
      world->groups.world->all_gather(&seen, 1, all.data());
      seen = *std::max_element(all.begin(), all.end());
      if (seen <= applied_request) return std::nullopt;
      const auto req = read_json_file(scale_request_path(env.store_dir, env.job_id, seen));
      auto to = layout::plan_from_json(req.at("plan")).with_defaults(cfg.model);
      applied_request = seen;
      if (to == plan) return std::nullopt;
      sw = make_switch(std::move(to), "scale request");
      sw->request = seen;
      // Prepared over the next elastic.prepare_steps steps, unless the timeline switches first
      // or the run ends before (then now, built during the pause).
      const int64_t at = step + cfg.prepare_steps;
      const bool timeline_first =
          next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step <= at;
      if (cfg.prepare_steps > 0 && at < cfg.training.end_step() && !timeline_first) {
        start_preparation(std::move(*sw), at, false);
        return std::nullopt;
      }
    }
    if (!sw) return std::nullopt;
    sw->step = step;
    sw->cursor = world->cursor;
    return sw;
  }

  // The switch from the current world to plan `to` (the next generation). The first ranks keep
  // their processes; ranks beyond the old world get new processes, whose ids it takes.
  SwitchMarker make_switch(layout::Plan to, const std::string& cause) {
    SwitchMarker sw;
    sw.to = std::move(to);
    sw.cause = cause;
    sw.generation = generation + 1;
    sw.from = plan;
    sw.from_members = members;
    const int n = sw.to.world();
    sw.to_members.assign(members.begin(),
                         members.begin() + std::min<ptrdiff_t>(n, ptrdiff_t(members.size())));
    while (int(sw.to_members.size()) < n) {
      sw.to_members.push_back(next_process_id);
      sw.spawn.push_back(next_process_id++);
    }
    sw.next_process_id = next_process_id;
    sw.applied_request = applied_request;
    sw.failures = failures;
    sw.step = world->step;
    sw.cursor = world->cursor;
    return sw;
  }

  SwitchMarker timeline_switch(const PlanSwitch& e) {
    return make_switch(e.plan, e.workers > 0 ? "timeline (workers)" : "timeline (plan)");
  }

  // Prepares the next timeline switch once it is elastic.prepare_steps or fewer steps away
  // (every rank decides alike, from the config).
  void maybe_prepare() {
    if (preparing || cfg.prepare_steps <= 0 || next_static >= cfg.timeline.size()) return;
    const auto& e = cfg.timeline[next_static];
    const int64_t step = world->step;
    if (e.at_step <= step || e.at_step - step > cfg.prepare_steps ||
        e.at_step >= cfg.training.end_step())
      return;
    start_preparation(timeline_switch(e), e.at_step, true);
  }

  // Announces switch `sw`, to be made after `at_step` steps: rank 0 writes prepare-<g>, so the
  // coordinator starts the processes it adds now, and this process starts building, on a
  // background thread, the chunks it will hold in the new plan and cannot take over from its
  // current world.
  void start_preparation(SwitchMarker sw, int64_t at_step, bool timeline) {
    Preparation p;
    p.sw = std::move(sw);
    p.at_step = at_step;
    p.timeline = timeline;
    if (world->rank == 0 && !p.sw.spawn.empty())
      write_json_file(prepare_marker_path(env.store_dir, env.job_id, p.sw.generation),
                      p.sw.to_json());
    if (const int new_rank = index_of(p.sw.to_members, env.rank); new_rank >= 0) {
      const auto tplan = transfer_plan(p.sw);
      std::vector<bool> kept(tplan.new_buffer_sizes(new_rank).size() / 3);
      for (size_t c = 0; c < kept.size(); ++c) kept[c] = tplan.kept_from(new_rank, int(3 * c)) >= 0;
      p.chunks = std::async(std::launch::async,
                            [this, to = p.sw.to, new_rank, backend = world->backend, kept] {
                              return prepare_chunks(cfg, to, new_rank, backend, kept);
                            });
    }
    preparing = std::move(p);
  }

  // Drops a preparation (its switch will not happen: a failure came first), after its
  // background build ended.
  void drop_preparation() noexcept {
    if (!preparing) return;
    if (preparing->chunks.valid()) {
      try {
        preparing->chunks.get();
      } catch (const std::exception& e) {
        spdlog::warn("preparing the switch to generation {} failed: {}", preparing->sw.generation,
                     e.what());
      }
    }
    preparing.reset();
  }

  // The buffers prepared for switch `sw`, if it is the prepared one, after their build ended;
  // `record` gets when it was announced and how long the switch waited for the build.
  std::optional<PreparedChunks> take_prepared(const SwitchMarker& sw, nlohmann::json& record) {
    if (!preparing || sw.recovery || preparing->sw.generation != sw.generation) return {};
    auto p = std::move(*preparing);
    preparing.reset();
    record["announced_at_step"] = p.sw.step;
    if (!p.chunks.valid()) return {};
    const auto t0 = std::chrono::steady_clock::now();
    try {
      auto chunks = p.chunks.get();
      record["prepare_wait_s"] = seconds_since(t0);
      return chunks;
    } catch (const std::exception& e) {
      // E.g. no memory for both worlds at once: the switch builds them after freeing the old.
      spdlog::warn("preparing the switch to generation {} failed ({}); building during the pause",
                   sw.generation, e.what());
      return {};
    }
  }

  // One host: every process is local.
  reshard::TransferPlan transfer_plan(const SwitchMarker& sw) const {
    return reshard::TransferPlan::build(
        layout::StateLayout::build(cfg.model, sw.from),
        layout::StateLayout::build(cfg.model, sw.to), std::vector<int>(size_t(sw.from.world()), 0),
        std::vector<int>(size_t(sw.to.world()), 0), sw.from_members, sw.to_members);
  }

  // A process started for a switch announced ahead (joining_early): builds its chunks while the
  // job still trains, then waits for the switch itself (switch-<g>, with the step it happens
  // at) and returns it. Returns nothing when a failure recovery overtook the switch (its
  // decision for the failure after sw.failures appeared first): this process is not needed.
  // Throws TimeoutError when neither comes within the bound.
  std::optional<SwitchMarker> await_switch(const SwitchMarker& announced) {
    const int new_rank = index_of(announced.to_members, env.rank);
    Preparation p;
    p.sw = announced;
    p.chunks = std::async(std::launch::async, [this, to = announced.to, new_rank] {
      return prepare_chunks(
          cfg, to, new_rank,
          std::shared_ptr<kernels::Backend>(kernels::make_backend(cfg.training.backend)), {});
    });
    preparing = std::move(p);
    const auto go = switch_marker_path(env.store_dir, env.job_id, announced.generation);
    const auto overtaken = recovery_path(env.store_dir, env.job_id, announced.failures + 1);
    const auto limit = recovery_deadline(cfg.comm_timeout_s) * (cfg.prepare_steps + 1);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      if (std::filesystem::exists(go)) {
        auto sw = SwitchMarker::from_json(read_json_file(go), go);
        skip_timeline_through(sw.step);
        return sw;
      }
      if (std::filesystem::exists(overtaken)) {
        drop_preparation();
        spdlog::info(
            "process {}: a failure recovery overtook the switch to generation {} it "
            "was started for; leaving",
            env.rank, announced.generation);
        return std::nullopt;
      }
      fatal = std::chrono::steady_clock::now() >= deadline;  // no recovery helps this
      TESSEL_CHECK(!fatal, TimeoutError,
                   "process {} was started for the switch to generation {} ({}), which did not "
                   "happen within {} s ({} did not appear)",
                   env.rank, announced.generation, announced.to.describe(), limit.count() / 1000,
                   go);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  void write_event(const nlohmann::json& record) {
    if (!events) events.emplace(cfg.events_path);
    events->write(record);
  }

  // The event line of a switch this process measured for `total_s`, with what the switch's
  // author recorded (the coordinator's detection and planning times, steps lost, ...). The pause
  // of a recovery runs from the failure's detection.
  void write_switch_event(nlohmann::json record, const SwitchMarker& sw, double total_s) {
    for (const auto& [k, v] : sw.record.items()) record[k] = v;
    record["total_pause_s"] = sw.recovery
                                  ? record.value("detection_s", 0.0) +
                                        record.value("planning_s_coordinator", 0.0) + total_s
                                  : total_s;
    write_event(record);
  }

  // Enters generation sw.generation: every process of the old or the new world joins one
  // transition world, the training state moves by the TransferPlan (each piece from the nearest
  // holder; nothing a process keeps moves), the new world's members build their chunks in the
  // new generation and continue with the old world's step, data cursor and learning-rate
  // position. Processes without a rank in the new plan drop their state and leave. A recovery
  // (sw.recovery) takes its sources from sw.from_members only (the others' ranks are lost), or
  // reads the whole state from sw.checkpoint. If the switch fails, this process keeps its old
  // world and state (chunks a successor took over are given back), so it can report them.
  void transition(const SwitchMarker& sw) {
    const int me = env.rank;
    const int new_rank = index_of(sw.to_members, me);
    const int old_rank = world != nullptr ? index_of(sw.from_members, me) : -1;
    const auto t0 = std::chrono::steady_clock::now();
    if (!sw.recovery && world != nullptr && world->rank == 0) {
      // Tells the coordinator (which starts the processes this switch adds) and those processes
      // what it is.
      write_json_file(switch_marker_path(env.store_dir, env.job_id, sw.generation), sw.to_json());
    }
    auto enter = [&] {
      generation = sw.generation;
      plan = sw.to;
      members = sw.to_members;
      next_process_id = std::max(next_process_id, sw.next_process_id);
      failures = std::max(failures, sw.failures);
      applied_request = std::max(applied_request, sw.applied_request);
    };
    if (new_rank < 0 && old_rank < 0) {  // nothing to give or take
      world.reset();
      enter();
      return;
    }
    const int64_t store_generation = env.generation + sw.generation;
    if (!sw.checkpoint.empty()) {
      restore_from_checkpoint(sw, new_rank, store_generation, t0);
      enter();
      return;
    }
    // A survivor whose state is not a source drops it first (its memory is needed).
    if (old_rank < 0) world.reset();
    const auto tplan = transfer_plan(sw);
    const double planning_s = seconds_since(t0);
    comm::StoreOptions store;
    store.path = env.store_dir;
    store.job_id = env.job_id;
    store.generation = store_generation;
    const auto timeout = std::chrono::milliseconds(int64_t(cfg.comm_timeout_s * 1000));
    store.timeout = timeout;
    // Waits for every process of the transition, joiners (being started now) included.
    auto t1 = std::chrono::steady_clock::now();
    auto union_world = reshard::connect_transition_world(store, tplan, me, timeout);
    const double connect_s = seconds_since(t1);
    t1 = std::chrono::steady_clock::now();
    // The old buffers first: the successor may take over chunks (and their memory) it keeps.
    reshard::ProcessBuffers buffers;
    if (world) {
      for (auto b : world->state_buffers()) buffers.old_buffers.emplace_back(b.data(), b.size());
      release_unkept_buffers(tplan, new_rank);
    }
    std::unique_ptr<World> successor;
    double rebuild_s = 0, transfer_s = 0;
    nlohmann::json prepare_record = nlohmann::json::object();
    reshard::ExecuteStats moved;
    layout::ScalarState shared{sw.step, sw.step, sw.cursor, {}};
    try {
      // Prepared ahead (maybe_prepare, await_switch): waits for the build if it still runs.
      auto prepared = take_prepared(sw, prepare_record);
      if (new_rank >= 0)
        successor = std::make_unique<World>(cfg, env, sw.to, new_rank, store_generation, false,
                                            world.get(), &tplan, prepared ? &*prepared : nullptr);
      rebuild_s = seconds_since(t1);
      t1 = std::chrono::steady_clock::now();
      if (successor) buffers.new_buffers = successor->state_buffers();
      // Within this host, receivers read the senders' memory directly (one copy; the network
      // when that is not allowed). TESSEL_RESHARD_DIRECT=0 forces the network.
      reshard::ExecuteOptions how;
      const char* direct = std::getenv("TESSEL_RESHARD_DIRECT");
      how.same_host_direct = direct == nullptr || std::string(direct) != "0";
      moved = reshard::execute(tplan, me, *union_world, buffers, how);
      int64_t by[2] = {moved.bytes_read_directly, moved.bytes_received};
      union_world->all_reduce_sum(by, 2);  // the whole transition's, for the event line
      moved = {by[0], by[1]};
      if (!sw.recovery) {
        layout::ScalarState mine;
        if (world) mine = {world->step, world->step, world->cursor, {}};
        shared = reshard::share_scalar_state(tplan, me, *union_world, world ? &mine : nullptr);
      }
      transfer_s = seconds_since(t1);
    } catch (...) {
      if (successor && world) successor->give_back(*world);
      throw;
    }
    world = std::move(successor);
    enter();
    if (!world) return;  // left the job
    world->generation = generation;
    world->step = shared.step;
    world->cursor = shared.data_cursor;
    if (world->rank == 0) {
      const auto& st = tplan.stats();
      const double total_s = seconds_since(t0);
      spdlog::info(
          "step {}: {} from {} to {} in {:.3f} s: {:.1f} MB moved between processes, {:.1f} MB "
          "copied locally, {} messages",
          shared.step, sw.recovery ? "recovered" : "switched", sw.from.describe(), sw.to.describe(),
          total_s, double(st.bytes_moved) / 1e6, double(st.local_copy_bytes) / 1e6, st.messages);
      nlohmann::json record = {{"event", sw.recovery ? "recover" : "reconfigure"},
                               {"cause", sw.cause},
                               {"generation", generation},
                               {"step", shared.step},
                               {"old_plan", sw.from.describe()},
                               {"new_plan", sw.to.describe()},
                               {"old_workers", sw.from.world()},
                               {"new_workers", sw.to.world()},
                               {"restored_from", "survivors"},
                               {"detection_s", 0.0},
                               {"planning_s", planning_s},
                               {"connect_s", connect_s},
                               {"rebuild_s", rebuild_s},
                               {"transfer_s", transfer_s},
                               {"bytes_moved", st.bytes_moved},
                               {"bytes_cross_host", st.bytes_cross_host},
                               {"bytes_copied_locally", st.local_copy_bytes},
                               {"max_send_bytes", st.max_send_bytes},
                               {"max_recv_bytes", st.max_recv_bytes},
                               {"messages", st.messages},
                               {"bytes_read_directly", moved.bytes_read_directly},
                               {"bytes_over_network", moved.bytes_received},
                               {"steps_lost", 0}};
      record.update(prepare_record);
      write_switch_event(std::move(record), sw, total_s);
    }
  }

  // Before the successor is built: the gradients and activations of old chunks the successor
  // will not take over are not state, so they are freed and handed back to the OS. The
  // successor's new buffers then reuse those pages instead of touching fresh memory, which on a
  // VM whose host backs memory lazily costs seconds per GiB (bench/README.md, elastic).
  void release_unkept_buffers(const reshard::TransferPlan& tplan, int new_rank) {
    std::vector<bool> kept(world->chunks.size(), false);
    if (new_rank >= 0)
      for (size_t c = 0; c < tplan.new_buffer_sizes(new_rank).size() / 3; ++c)
        if (const int b = tplan.kept_from(new_rank, int(3 * c)); b >= 0) kept[size_t(b / 3)] = true;
    bool released = false;
    for (size_t b = 0; b < kept.size(); ++b) {
      auto& m = world->chunks[b].model;
      if (kept[b] || !m || m->training_buffers_released()) continue;
      m->release_training_buffers();
      released = true;
    }
    if (world->grad_reduce) world->grad_reduce.reset();  // it points at the gradients
    if (released) HostAllocator::instance().release_cached();
  }

  // A recovery from a checkpoint: the new world's members read their share of it (each only
  // what its rank holds) and continue from its step and data cursor.
  void restore_from_checkpoint(const SwitchMarker& sw, int new_rank, int64_t store_generation,
                               std::chrono::steady_clock::time_point t0) {
    world.reset();
    if (new_rank < 0) return;
    store::CheckpointReader reader(sw.checkpoint);
    check_resumable(cfg, reader.meta(), sw.checkpoint);
    world = std::make_unique<World>(cfg, env, sw.to, new_rank, store_generation, false);
    const double rebuild_s = seconds_since(t0);
    const auto t1 = std::chrono::steady_clock::now();
    load_rank_state(reader, layout::StateLayout::build(cfg.model, world->plan), new_rank,
                    world->state_buffers());
    const double transfer_s = seconds_since(t1);
    world->generation = sw.generation;
    world->step = reader.meta().at("step").get<int64_t>();
    world->cursor = reader.meta().at("cursor").get<int64_t>();
    if (new_rank == 0) {
      const double total_s = seconds_since(t0);
      spdlog::info("step {}: restored {} from {} in {:.3f} s ({})", world->step, sw.to.describe(),
                   sw.checkpoint, total_s, sw.cause);
      nlohmann::json record = {{"event", "recover"},
                               {"cause", sw.cause},
                               {"generation", sw.generation},
                               {"step", world->step},
                               {"old_plan", sw.from.describe()},
                               {"new_plan", sw.to.describe()},
                               {"new_workers", sw.to.world()},
                               {"restored_from", sw.checkpoint},
                               {"detection_s", 0.0},
                               {"planning_s", 0.0},
                               {"rebuild_s", rebuild_s},
                               {"transfer_s", transfer_s},
                               {"bytes_read", reader.bytes_read()},
                               {"bytes_moved", 0}};
      write_switch_event(std::move(record), sw, total_s);
    }
  }

  // After a peer failed (`what`): breaks this process's communicators (so every peer notices),
  // reports what state it holds to the coordinator, waits for the coordinator's decision and
  // carries it out (transition). Throws TimeoutError when no decision comes.
  void recover(const std::string& what) {
    drop_preparation();
    ++failures;
    FailureReport r;
    r.process = env.rank;
    r.error = what;
    r.applied_request = applied_request;
    r.generation = generation;
    r.plan = plan;
    r.members = members;
    if (world) {
      world->abort(what);
      try {
        world->finish_checkpoint();  // a background save may still be writing
      } catch (const std::exception& e) {
        spdlog::warn("the checkpoint being saved when the failure happened is lost: {}", e.what());
      }
      r.valid = !world->updating;
      r.generation = world->generation;
      r.plan = world->plan;
      r.rank = world->rank;
      r.step = world->step;
      r.cursor = world->cursor;
    }
    spdlog::warn("process {}: {}; reporting to the coordinator (failure {}, {} at step {})",
                 env.rank, what, failures, r.valid ? "state valid" : "no usable state", r.step);
    write_json_file(failure_report_path(env.store_dir, env.job_id, failures, env.rank),
                    r.to_json());
    const auto path = recovery_path(env.store_dir, env.job_id, failures);
    // The coordinator's bound on gathering the reports (this wait starts after its own).
    const auto limit = recovery_deadline(cfg.comm_timeout_s);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!std::filesystem::exists(path)) {
      fatal = std::chrono::steady_clock::now() >= deadline;
      TESSEL_CHECK(!fatal, TimeoutError,
                   "process {}: the coordinator decided nothing about failure {} within {} s "
                   "({} did not appear)",
                   env.rank, failures, limit.count() / 1000, path);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    auto sw = SwitchMarker::from_json(read_json_file(path), path);
    skip_timeline_through(sw.step);
    transition(sw);
  }
};

ParallelTrainer::ParallelTrainer(TrainConfig config, const WorkerEnv& env)
    : impl_(std::make_unique<Impl>(std::move(config), env)) {}
ParallelTrainer::~ParallelTrainer() = default;

double ParallelTrainer::train_step() {
  TESSEL_CHECK(impl_->world != nullptr, InvalidArgumentError,
               "process {} has no rank in the current plan", impl_->env.rank);
  double norm = 0;
  return impl_->world->train_step(&norm);
}

TrainSummary ParallelTrainer::run() {
  auto& s = *impl_;
  const auto& cfg = s.cfg;
  const int64_t tokens_per_step = cfg.training.global_batch * cfg.data.seq_len;
  if (s.lead()) {
    spdlog::info("training {} on {} workers ({}) for {} steps, {} tokens per step", cfg.model.name,
                 cfg.plan.world(), cfg.plan.describe(), cfg.training.steps, tokens_per_step);
  }
  RunTracker tracker(s.world ? s.world->step : 0, cfg.training.steps, cfg.training.log_every,
                     tokens_per_step, s.lead());
  // In an elastic job a failed peer (PeerLostError, TimeoutError) is not the end: the process
  // recovers (Impl::recover) and goes on in the generation the coordinator decides.
  std::optional<std::string> failed;
  for (;;) {
    try {
      if (failed) {
        const std::string what = *failed;
        failed.reset();
        s.recover(what);
      } else if (s.joining) {
        std::optional<SwitchMarker> sw = std::move(s.joining);
        s.joining.reset();
        if (s.joining_early) sw = s.await_switch(*sw);
        if (!sw) break;  // overtaken by a failure recovery: not needed
        s.transition(*sw);
      }
      // A checkpoint is due after a step that checkpoint.every divides, and after the last.
      auto due = [&](int64_t step) {
        const auto& ck = cfg.checkpoint;
        return !ck.dir.empty() && step > 0 &&
               ((ck.every > 0 && step % ck.every == 0) || step == cfg.training.end_step());
      };
      // A failure while a due checkpoint was being written cancels that save; the world its
      // recovery made, standing at that step, writes it again. Once per world (a collective).
      auto resave_cancelled = [&](World& w) {
        if (w.cancelled_save_checked) return;
        w.cancelled_save_checked = true;
        if (due(w.step)) w.save_checkpoint_unless_published();
      };
      while (s.world && s.world->step < cfg.training.end_step()) {
        resave_cancelled(*s.world);
        // Here, not after a switch: every way into a world (a switch, joining, a recovery, a
        // resume) passes, so all ranks decide alike whether a preparation runs.
        s.maybe_prepare();
        World& w = *s.world;
        tracker.show_progress(s.lead(), cfg.training.steps, cfg.training.log_every);
        tracker.begin_step();
        double lr = w.lr_schedule.at(w.step);
        double grad_norm = 0;
        double loss = w.train_step(&grad_norm);
        nlohmann::json record = tracker.end_step(w.step, loss, lr, grad_norm, w.cursor);
        if (w.plan.pp > 1) record["pipeline_idle"] = w.pipeline_idle;
        if (s.generation > 0) record["generation"] = s.generation;
        record["workers"] = w.plan.world();
        if (w.rank == 0) w.metrics.write(record);
        if (due(w.step)) w.save_checkpoint();
        if (w.step >= cfg.training.end_step()) break;
        if (auto sw = s.next_switch()) {
          s.transition(*sw);
          // A worker the new plan does not need leaves; `tessel train` starts a fresh process
          // when a later plan needs one again.
          if (s.world == nullptr) break;
        }
      }
      if (s.world) {
        World& w = *s.world;
        w.finish_checkpoint();
        resave_cancelled(w);  // a world a recovery made at the last step
        if (const char* dir = std::getenv("TESSEL_DUMP_PARAMS"); dir != nullptr && *dir != '\0')
          w.dump_params(dir);
        // Nobody leaves before everyone is done with the last step's collectives.
        w.groups.world->barrier();
      }
      break;
    } catch (const PeerLostError& e) {
      if (!s.elastic()) throw;
      failed = e.what();
    } catch (const TimeoutError& e) {
      if (!s.elastic() || s.fatal) throw;
      failed = e.what();
    }
    // Before anything else: peers blocked on this process must fail now, not at their timeout.
    if (s.world) s.world->abort(*failed);
  }
  const double elapsed = tracker.elapsed_seconds();
  const TrainSummary& summary = tracker.finish();
  if (s.world == nullptr) return summary;  // left the job at a switch
  World& w = *s.world;
  if (w.rank == 0 && summary.steps_run > 0) {
    std::printf("done: %lld steps in %s on %d workers, final loss %.4f, %s tokens/s\n",
                static_cast<long long>(summary.steps_run), format_duration(elapsed).c_str(),
                w.plan.world(), summary.final_loss, format_rate(summary.tokens_per_second).c_str());
  }
  return summary;
}

}  // namespace tessel::runtime
