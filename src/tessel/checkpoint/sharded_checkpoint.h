// Training checkpoints of any plan, in the tensor store's format (store/checkpoint_store.h).
//
// checkpoint.dir holds one store checkpoint per saved step, `step-00000100/`, and a file `latest`
// naming the newest complete one (replaced atomically after the checkpoint was published; a crash
// leaves it naming the previous one). The newest checkpoint.keep are kept.
//
// What is saved is the whole training state of the plan (layout/state_layout.h): every parameter
// under its Hugging Face name and Adam's moments as "<name>/adam_m" and "<name>/adam_v", each
// element written by exactly one rank: replicas are skipped (only dp rank 0 writes what dp
// replicates -- with ZeRO-1 every dp rank writes its own optimizer ranges -- only the primary tp
// copy of a tensor tp replicates, and not the head stage's copy of a tied embedding). The
// manifest's "meta" carries the model config, the plan, the step, the data cursor and position
// in the learning-rate schedule, and the seeds. Loading reads into any plan's layout: each rank
// reads only the boxes it holds, so a checkpoint saved under one layout resumes under another.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessel/config/train_config.h"
#include "tessel/layout/state_layout.h"
#include "tessel/layout/training_state.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::checkpoint {

// "step-00000100"
std::string checkpoint_step_name(int64_t step);

// The newest complete checkpoint under `dir` (the one `latest` names), if any. Throws
// CorruptDataError when `latest` names something that is not there.
std::optional<std::string> latest_sharded_checkpoint(const std::string& dir);

// The newest checkpoint under `dir` that reads back whole (CheckpointReader::verify: every byte
// against its checksum). A newer one that does not -- damaged on disk, or by hand -- is moved
// aside as step-N.corrupt (kept for a look, never read again) with a warning naming the damage,
// and `latest` is pointed at the one returned. Nothing when no intact checkpoint is left (and
// `latest`, which would name nothing, is removed).
std::optional<std::string> newest_intact_checkpoint(const std::string& dir);

// Where a run of `cfg` starts: the newest intact checkpoint under checkpoint.dir when
// checkpoint.resume is on, with its step; nothing for a fresh start. `tessel train` decides this
// once and tells its workers (runtime/worker_env.h: TESSEL_RESUME_FROM), so they cannot disagree.
// Throws CorruptDataError when the directory shows earlier saves (`latest`, step-N, step-N.corrupt)
// but none is intact: a silent fresh start would throw away what the job trained.
struct ResumePoint {
  std::string path;
  int64_t step = 0;
};
std::optional<ResumePoint> find_resume_point(const config::TrainConfig& cfg);

// Before a job writes into checkpoint.dir (`tessel train`, once, before its workers start):
//  * lock_checkpoint_dir: the directory is this job's alone while the returned lock lives (an
//    flock on <dir>/.lock, released by the kernel when the process dies, so a killed job leaves no
//    stale lock). Throws ConfigError when another live process holds it.
//  * Creates the directory; throws ConfigError when it is a file, IoError when it cannot be
//    written (read-only, no permission) -- at start, not at the first save.
//  * Removes what interrupted saves left (step-N.tmp-* staging directories, step-N.old-* from an
//    interrupted swap, moved back when step-N is missing); returns how many.
class CheckpointDirLock {
 public:
  explicit CheckpointDirLock(int fd) : fd_(fd) {}
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

 private:
  int fd_;
};
std::unique_ptr<CheckpointDirLock> lock_checkpoint_dir(const std::string& dir);
int remove_interrupted_saves(const std::string& dir);

// What identifies a run's data (data.path's file -- a Megatron prefix's .bin -- by size and an
// xxh3 of its first MiB), recorded in checkpoints so that a resume on other data is refused
// instead of applying the cursor to it. Empty when the file cannot be read.
nlohmann::json data_fingerprint(const std::string& path);

// Adds rank `rank`'s share of the state (see above) to `writer`, gathered from `buffers` (the
// rank's buffers in layout order) into copies the writer owns, so the buffers may change as soon
// as this returns.
void add_rank_state(store::CheckpointWriter& writer, const layout::StateLayout& layout, int rank,
                    const std::vector<std::span<const float>>& buffers);

// On one rank, after every rank's write_rank_file(): commits the checkpoint of `step` (written by
// `writer` into dir/step-N), points `latest` at it and removes all but the newest `keep`, and
// the damaged ones set aside (step-N.corrupt) older than every kept one.
void publish_checkpoint(store::CheckpointWriter& writer, int num_ranks, const nlohmann::json& meta,
                        const std::string& dir, int keep);

// What publish_checkpoint does after the commit: points dir/latest at step directory `name` and
// keeps the newest `keep` (and the set-aside damaged ones younger than every kept one). Also for
// a checkpoint committed by other means (a cluster's hosts, elastic/cluster_checkpoints.h).
void point_latest_and_prune(const std::string& dir, const std::string& name, int keep);

// The manifest's "meta" of a checkpoint of `cfg`'s model trained under `plan` at `step` (data
// cursor `cursor`).
nlohmann::json checkpoint_meta(const config::TrainConfig& cfg, const layout::Plan& plan,
                               int64_t step, int64_t cursor);
// Throws ConfigError (naming the checkpoint at `path`) unless a run of `cfg` may continue from a
// checkpoint with `meta`: the same model, and the same data seed, sequence length, global batch
// and data (data_fingerprint, when the checkpoint has one), else samples would repeat or be
// skipped.
void check_resumable(const config::TrainConfig& cfg, const nlohmann::json& meta,
                     const std::string& path);

// Fills rank `rank`'s buffers (layout order) from a checkpoint saved under any plan of the same
// model. Throws CorruptDataError naming the tensor (and file) when a piece is missing, damaged or
// of another shape.
// With `fetch`, pieces of rank files this host does not hold (a reader opened with
// allow_missing_files) are read through it: from other hosts (store/remote_pieces.h).
void load_rank_state(const store::CheckpointReader& reader, const layout::StateLayout& layout,
                     int rank, const std::vector<std::span<float>>& buffers,
                     const store::PieceFetcher& fetch = {});

}  // namespace tessel::checkpoint
