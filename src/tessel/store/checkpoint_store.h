// Sharded checkpoints: a directory of safetensors files (one per writing rank), an index and a
// manifest. The store knows nothing about models or plans: callers hand it boxes of logical
// tensors and opaque JSON (model spec, plan, step, data cursor, RNG, LR state) for the manifest.
//
// A checkpoint directory DIR holds
//   rank-00000.safetensors ...  one per writing rank; each tensor in it is one *piece*: a box of
//                               a logical tensor (named "<name>" when the box is the whole
//                               tensor, so a one-rank checkpoint is a plain Hugging Face file,
//                               else "<name>[lo:hi,...]")
//   index.json                  per logical tensor: dtype, global shape and its pieces (file,
//                               tensor in the file, box, xxh3-64 of the piece bytes and of each
//                               chunk of them); per file: size and xxh3 of its header
//   manifest.json               format name and version, the index's size and xxh3, the
//                               caller's JSON under "meta", and an xxh3 of the manifest itself
// The pieces of a tensor tile it exactly (no gap, no overlap); writers and readers check this.
//
// Atomic saves. A save never writes into DIR. Every rank writes its file into the staging
// directory `DIR.tmp-<save_id>` (beside DIR); then one rank commits: it writes index.json and,
// last, manifest.json there (each temp file + fsync + rename + directory fsync), and publishes
// the staging directory as DIR in one step: rename(2) when DIR does not exist, else
// renameat2(RENAME_EXCHANGE), which swaps the two directories atomically; the previous checkpoint,
// now under the staging name, is then deleted. A crash at any moment leaves DIR either the
// previous complete checkpoint or the new complete one, never a mix, plus possibly a stale
// `DIR.tmp-*` that cleanup_interrupted_saves() removes. (On a filesystem without
// RENAME_EXCHANGE the swap is two renames through `DIR.old-<save_id>`; a crash between them
// leaves no DIR, and cleanup_interrupted_saves() moves the previous checkpoint back.) A directory
// without manifest.json is never read as a checkpoint.
//
// Checksums and reads. Each piece's bytes are hashed whole and in chunks of `chunk_bytes`
// (default 1 MiB). A box read touches, for every piece it intersects, only the chunks holding the
// needed bytes, and verifies each chunk it reads, every time (no "already verified" cache, which
// would miss damage that appears later and would force whole-piece reads). The trade-off is the
// chunk size: a read costs at most one extra chunk at each end of every contiguous byte run it
// needs (small boxes read up to 2 chunks per run; whole-piece loads read exactly the piece),
// while the index grows by 19 bytes per chunk (1 MiB chunks: 0.002% of the state). Without
// chunks a piece's checksum could only be checked by reading the whole piece. Column slices of a
// row-major piece whose rows are shorter than a chunk (a tensor-parallel split of a matrix saved
// whole) therefore read the whole piece; row slices and whole pieces read what they need.
//
// Ranks on several hosts must write to one shared filesystem: the commit reads every rank file's
// header, and the publish renames one directory.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/store/safetensors.h"
#include "tessel/tensor/box.h"
#include "tessel/tensor/tensor.h"

namespace tessel::store {

inline constexpr std::string_view kCheckpointFormat = "tessel-checkpoint";
inline constexpr int kCheckpointVersion = 1;

// "rank-00003.safetensors"
std::string rank_file_name(int rank);
// "rank-00003.failed": left in the staging directory by a rank whose write failed, so that the
// committing rank stops waiting for its file (CheckpointWriter::mark_failed).
std::string rank_failed_name(int rank);
// DIR.tmp-<save_id>: where a save's files are written before the commit publishes them.
std::string staging_dir_for(const std::string& dir, const std::string& save_id);

struct CheckpointWriterOptions {
  // Names one save attempt: every rank of the save passes the same id (e.g. rank 0 draws one and
  // broadcasts it), and no two attempts reuse one. Letters, digits, '-' and '_'. Empty: a random
  // id, which only works when one process writes every rank file and commits.
  std::string save_id;
  // Checksum granularity (see the file comment); > 0.
  uint64_t chunk_bytes = uint64_t(1) << 20;
  // Test hook, called after each durable step: "rank_file" (this rank's file is in place),
  // "index", "manifest" (both in the staging directory), "publish" (DIR is the new checkpoint,
  // the previous one not yet deleted). Crash tests kill the process here.
  std::function<void(std::string_view stage)> on_stage;
};

// Writes one rank's pieces of a checkpoint, and (on one rank, after every rank has written)
// commits it. Usage:
//   CheckpointWriterOptions opt;
//   opt.save_id = id;                      // the same on every rank of this save
//   CheckpointWriter w(dir, rank, opt);
//   w.add("wte", DType::f32, {50304, 768}, box_of_this_rank, ptr);  ...
//   w.write_rank_file();
//   barrier();
//   if (rank == 0) w.commit(world_size, meta);
class CheckpointWriter {
 public:
  // Throws IoError when DIR exists but is not a checkpoint directory (a file, or a non-empty
  // directory without manifest.json): a save never replaces what it did not write.
  CheckpointWriter(std::string dir, int rank, CheckpointWriterOptions options = {});

  // Adds the piece `box` of logical tensor `name` (of `global_shape` and `dtype`). `data` holds
  // the box's elements, dense row-major; it must stay valid and unchanged until
  // write_rank_file() returns, unless snapshot() copied it. Throws InvalidArgumentError for a box
  // outside the shape, a piece added twice or a name with '[' (reserved for piece names).
  void add(const std::string& name, DType dtype, const Shape& global_shape, const Box& box,
           const void* data);
  // The whole tensor as one piece.
  void add(const std::string& name, const Tensor& tensor);
  // Copies the bytes of every piece added so far into host memory the writer owns (from
  // HostAllocator, which keeps the block for the next save), so the caller's buffers may change:
  // what AsyncSaver does before writing in the background.
  void snapshot();
  // Bytes of all pieces added.
  uint64_t bytes() const;

  // Writes DIR.tmp-<id>/rank-<rank>.safetensors atomically; returns its path. Throws IoError.
  std::string write_rank_file();
  // After write_rank_file() failed: leaves DIR.tmp-<id>/rank-<rank>.failed (an empty file) for
  // the committing rank to find. Best effort (a full disk may refuse even that: the committer
  // then waits for its timeout); returns whether the marker is there.
  bool mark_failed() noexcept;
  // Builds index.json from rank files 0..num_ranks-1 (reading their headers only), writes
  // manifest.json last (with `meta`, a JSON object, under "meta") and publishes the checkpoint as
  // DIR. Call on one rank after every rank's write_rank_file() returned. Throws IoError when a
  // rank file is missing or a write fails, InvalidArgumentError when the pieces of a tensor do
  // not tile it exactly or disagree on its dtype or shape. On any failure DIR is unchanged.
  void commit(int num_ranks, const nlohmann::json& meta);

  const std::string& dir() const { return dir_; }
  const std::string& staging_dir() const { return staging_; }
  const std::string& save_id() const { return options_.save_id; }
  int rank() const { return rank_; }

 private:
  struct Piece {
    std::string name;
    DType dtype;
    Shape global_shape;
    Box box;
    const void* data;
    uint64_t nbytes;
  };
  void stage(std::string_view name) const;

  std::string dir_;
  int rank_;
  CheckpointWriterOptions options_;
  std::string staging_;
  std::vector<Piece> pieces_;
  std::shared_ptr<std::byte> snapshot_;  // from HostAllocator
};

// Removes what interrupted saves of DIR left beside it (DIR.tmp-*, DIR.old-*); if a crash
// between the two renames of the fallback swap left no DIR, first moves the previous checkpoint
// back. Call only while no save of DIR is running. Returns the number of directories removed.
int cleanup_interrupted_saves(const std::string& dir);

struct CheckpointPiece {
  std::string file;    // rank file name in the checkpoint directory
  std::string tensor;  // tensor name inside that file
  Box box;             // box of the logical tensor
  uint64_t nbytes = 0;
  uint64_t xxh3 = 0;  // of all nbytes
  uint64_t chunk_bytes = 0;
  std::vector<uint64_t> chunk_xxh3;  // one per chunk
};

struct CheckpointTensor {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::vector<CheckpointPiece> pieces;
  uint64_t nbytes() const { return uint64_t(shape.numel()) * dtype_size(dtype); }
};

struct VerifyReport {
  size_t files = 0, tensors = 0, pieces = 0;
  uint64_t bytes = 0;  // piece bytes hashed
};

// Reads a checkpoint. Opening validates the manifest (format, version, its own checksum), the
// index (its checksum, structure, that pieces tile their tensors) and every rank file (present,
// of the recorded size, header checksum, each piece present with the recorded dtype and shape),
// reading headers only. Errors name the directory and the file or tensor at fault:
// CorruptDataError for a missing manifest (interrupted save), missing or truncated shard, damaged
// bytes or an unknown format version; IoError when the directory cannot be read.
// A reader is safe to use from several threads at once.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& manifest() const { return manifest_; }
  // The caller's JSON given to commit().
  const nlohmann::json& meta() const { return manifest_.at("meta"); }
  // Sorted by name.
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }
  const CheckpointTensor* find(std::string_view name) const;
  // Throws InvalidArgumentError naming the checkpoint when absent.
  const CheckpointTensor& at(std::string_view name) const;
  std::vector<std::string> files() const;

  // Reads `box` of tensor `name` into `out` (box.volume() elements, dense row-major), reading
  // only the checksum chunks that hold needed bytes and verifying every chunk read. Throws
  // InvalidArgumentError for an unknown name or a box outside the tensor, CorruptDataError
  // naming tensor, piece and file when bytes fail their checksum.
  void read_box(std::string_view name, const Box& box, void* out) const;
  // The box (default: the whole tensor) as a new tensor.
  Tensor read(std::string_view name, const std::optional<Box>& box = std::nullopt) const;
  // Reads and checks every piece (whole and chunk checksums). Throws the first error.
  VerifyReport verify() const;

  // Bytes read from rank files so far (headers included), by all threads.
  uint64_t bytes_read() const;

 private:
  void load_manifest();
  void load_index();
  CheckpointTensor load_tensor(const std::string& name, const nlohmann::json& entry,
                               const std::string& what, const std::string& index_name) const;
  void read_piece(const CheckpointTensor& t, const CheckpointPiece& p, const Box& region,
                  const Box& out_frame, char* out) const;
  const SafetensorsReader& file(const std::string& name) const;

  std::string dir_;
  nlohmann::json manifest_;
  std::vector<CheckpointTensor> tensors_;
  std::map<std::string, SafetensorsReader, std::less<>> files_;
};

}  // namespace tessel::store
