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
// Many hosts, each with its own disk. No host need hold every rank file: each rank writes its
// file into the staging directory on its own host, other hosts keep copies
// (download_rank_file, remote_pieces.h), and what the commit needs of each file travels as a
// small JSON *entry* (CheckpointWriter::rank_file_entry: name, size, header checksum, piece list)
// through the control store. Every host then commits from the same entries
// (commit_checkpoint): the index and manifest come out byte for byte the same everywhere, and each
// host publishes its own staging directory, holding only some rank files, as DIR. A reader
// opened with allow_missing_files reads the pieces this host holds and asks a PieceFetcher
// (e.g. another host's tensor store over HTTP) for the rest. On one shared filesystem the same
// code runs with one staging directory that holds every file.
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
// 3 for "rank-00003.safetensors"; nothing for any name rank_file_name does not give.
std::optional<int> rank_of_file_name(std::string_view name);
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
  // A piece whose bytes are produced while the rank file is written, so that a checkpoint larger
  // than memory can be written in bounded memory (a conversion, a generated model):
  // produce(offset, n, out) fills bytes [offset, offset + n) of the piece (dense row-major),
  // called once per range, in increasing order, with ranges of at most chunk_bytes. snapshot()
  // refuses such pieces (InvalidArgumentError): they are read when written.
  using PieceProducer = std::function<void(uint64_t offset, uint64_t n, void* out)>;
  void add_streamed(const std::string& name, DType dtype, const Shape& global_shape, const Box& box,
                    PieceProducer produce);
  // Copies the bytes of every piece added so far into host memory the writer owns (from
  // HostAllocator, which keeps the block for the next save), so the caller's buffers may change:
  // what AsyncSaver does before writing in the background.
  void snapshot();
  // Bytes of all pieces added.
  uint64_t bytes() const;

  // Writes DIR.tmp-<id>/rank-<rank>.safetensors atomically; returns its path. Throws IoError.
  std::string write_rank_file();
  // After write_rank_file(): what the commit needs to know of this rank's file, as
  // read_rank_file_entry() gives it. Throws InvalidArgumentError before write_rank_file().
  const nlohmann::json& rank_file_entry() const;
  // After write_rank_file() failed: leaves DIR.tmp-<id>/rank-<rank>.failed (an empty file) for
  // the committing rank to find. Best effort (a full disk may refuse even that: the committer
  // then waits for its timeout); returns whether the marker is there.
  bool mark_failed() noexcept;
  // Reads the entries of rank files 0..num_ranks-1 from the staging directory (headers only)
  // and commits them: commit_checkpoint(dir(), save_id(), entries, meta, num_ranks). Call on one
  // rank after every rank's write_rank_file() returned, when the staging directory holds every
  // rank file. Throws IoError when a rank file is missing, and as commit_checkpoint does.
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
    PieceProducer produce;  // set for add_streamed pieces (data is then null)
  };
  void stage(std::string_view name) const;
  std::string write_streamed_rank_file(const std::string& path);

  std::string dir_;
  int rank_;
  CheckpointWriterOptions options_;
  std::string staging_;
  std::vector<Piece> pieces_;
  std::shared_ptr<std::byte> snapshot_;  // from HostAllocator
  nlohmann::json entry_;                 // null until write_rank_file()
};

// The entry of rank file `path` of save `save_id`, from its header alone:
//   {"file": "rank-00003.safetensors", "rank": 3, "save_id": ..., "bytes": <file size>,
//    "header_xxh3": "<16 hex digits>", "pieces": [<the piece list of its metadata>]}
// where each piece is {"tensor", "name" (in the file), "dtype", "shape", "box", "bytes", "xxh3",
// "chunk_bytes"[, "chunks"]}. Its size is about 200 bytes per piece plus 19 per checksum chunk.
// Throws IoError when the file cannot be read or belongs to another save, CorruptDataError when
// it is not a tessel rank file or its piece list disagrees with its tensors.
nlohmann::json read_rank_file_entry(const std::string& path, const std::string& save_id);

// Commits save `save_id` of DIR from the entries of its rank files 0..num_ranks-1 (in any order):
// builds index.json (each tensor's pieces must tile it exactly once and agree on its dtype and
// shape), writes it and then manifest.json (`meta`, a JSON object, under "meta") into the staging
// directory staging_dir_for(DIR, save_id) (created if absent), and publishes that directory as
// DIR atomically (see the file comment). The staging directory may hold any subset of the rank
// files; each one it holds must match its entry (size, header checksum, piece list) and is
// published with the rest. Given the same entries and meta, every host writes the same index and
// manifest bytes. `on_stage` as CheckpointWriterOptions::on_stage ("index", "manifest",
// "publish"). Throws InvalidArgumentError for a missing, repeated or out-of-range rank, an entry
// of another file, or pieces that do not tile their tensor; CorruptDataError for a malformed
// entry or a held rank file that differs from its entry; IoError when the entries belong to
// another save or a write fails. On any failure DIR is unchanged.
void commit_checkpoint(const std::string& dir, const std::string& save_id,
                       const std::vector<nlohmann::json>& entries, const nlohmann::json& meta,
                       int num_ranks,
                       const std::function<void(std::string_view stage)>& on_stage = {});

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
  size_t files = 0, tensors = 0, pieces = 0;  // files and pieces verified; tensors of the index
  uint64_t bytes = 0;                         // piece bytes hashed
  // A partial reader verifies only the files it holds: these it did not, nor their pieces.
  std::vector<std::string> missing_files;
  size_t pieces_not_held = 0;
  bool complete() const { return missing_files.empty(); }
};

struct CheckpointReaderOptions {
  // Open a checkpoint of which this host holds only some rank files (see the file comment). The
  // files present are validated as always (a truncated or damaged one is still an error); the
  // absent ones' pieces come from a PieceFetcher.
  bool allow_missing_files = false;
};

// Reads `region` (inside piece.box, in the tensor's global coordinates) of a piece whose rank
// file this host does not hold into `out` (region.volume() elements of tensor.dtype, dense
// row-major). Throws to fail the read. Called from the thread calling read_box.
using PieceFetcher = std::function<void(
    const CheckpointTensor& tensor, const CheckpointPiece& piece, const Box& region, void* out)>;

// Reads a checkpoint. Opening validates the manifest (format, version, its own checksum), the
// index (its checksum, structure, that pieces tile their tensors) and every rank file (present,
// of the recorded size, header checksum, each piece present with the recorded dtype and shape),
// reading headers only. Errors name the directory and the file or tensor at fault:
// CorruptDataError for a missing manifest (interrupted save), missing (unless allowed) or
// truncated shard, damaged bytes or an unknown format version; IoError when the directory cannot
// be read. A reader is safe to use from several threads at once.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir, CheckpointReaderOptions options = {});

  const std::string& dir() const { return dir_; }
  const nlohmann::json& manifest() const { return manifest_; }
  // The caller's JSON given to commit().
  const nlohmann::json& meta() const { return manifest_.at("meta"); }
  // Sorted by name.
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }
  const CheckpointTensor* find(std::string_view name) const;
  // Throws InvalidArgumentError naming the checkpoint when absent.
  const CheckpointTensor& at(std::string_view name) const;
  // Every rank file of the checkpoint (held or not), sorted.
  std::vector<std::string> files() const;
  // Whether this host holds rank file `file` (always, for a complete reader).
  bool holds(std::string_view file) const;
  // The rank files this host does not hold, sorted; empty for a complete reader.
  const std::vector<std::string>& missing_files() const { return missing_; }

  // Reads `box` of tensor `name` into `out` (box.volume() elements, dense row-major), reading
  // only the checksum chunks that hold needed bytes and verifying every chunk read. Throws
  // InvalidArgumentError for an unknown name or a box outside the tensor, CorruptDataError
  // naming tensor, piece and file when bytes fail their checksum, or when a piece lies in a file
  // this host does not hold (then nothing is read).
  void read_box(std::string_view name, const Box& box, void* out) const;
  // The same, asking `fetch` for the parts of the box that lie in files this host does not hold
  // (an empty `fetch` behaves as the overload above); local pieces are read as above.
  void read_box(std::string_view name, const Box& box, void* out, const PieceFetcher& fetch) const;
  // The box (default: the whole tensor) as a new tensor.
  Tensor read(std::string_view name, const std::optional<Box>& box = std::nullopt,
              const PieceFetcher& fetch = {}) const;
  // Reads and checks every piece this host holds (whole and chunk checksums). Throws the first
  // error. The report lists the files it could not verify because this host lacks them.
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
  CheckpointReaderOptions options_;
  nlohmann::json manifest_;
  std::vector<CheckpointTensor> tensors_;
  std::map<std::string, SafetensorsReader, std::less<>> files_;  // held
  std::vector<std::string> all_files_, missing_;                 // sorted
};

}  // namespace tessel::store
