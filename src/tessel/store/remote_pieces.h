// Reading what this host does not hold from the hosts that do, through their
// CheckpointRootServer (checkpoint_root_server.h): boxes of pieces for a partial reader's
// read_box, and whole rank files to keep a second copy of them.
//
//   CheckpointReaderOptions ro;
//   ro.allow_missing_files = true;
//   CheckpointReader local(root + "/step-100", ro);
//   auto fetch = http_piece_fetcher("step-100", {{"rank-00003.safetensors",
//                                                 {"http://b:7070", "http://c:7070"}}});
//   local.read_box("wte", box, out, fetch);
//
// Nothing read from another host is trusted more than a local file: a piece region must come
// with the dtype and shape asked for and exactly its bytes (the serving host verified its
// checksum chunks before sending them), and a downloaded rank file is checked against its entry
// -- size, header checksum and every piece's checksum -- before it gets its name.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "tessel/store/checkpoint_store.h"

namespace tessel::store {

struct RemoteOptions {
  // Connecting, and each wait for the peer to send or take bytes. A piece request must also end
  // within it as a whole; a rank file download, which may be large, only must keep moving.
  std::chrono::milliseconds timeout{30'000};
  // Sent as "Authorization: Bearer <token>" when not empty: the token of the hosts' servers
  // (net::read_token_file reads it from the same file).
  std::string bearer_token;
};

// For each rank file name, the base URLs ("http://host:port") of the hosts that hold it, in the
// order to try them.
using FileHosts = std::map<std::string, std::vector<std::string>>;

// A PieceFetcher that GETs <base>/v1/checkpoints/<rel>/tensors/<name>?box=<region>&format=raw
// from the hosts holding the piece's file, in order, until one answers with X-Tessel-Dtype and
// X-Tessel-Shape of the region and exactly its bytes; connections are kept for the next call.
// Safe to call from several threads. The fetcher throws PeerLostError naming the file, the
// tensor and region, and every host tried with what went wrong there, when none answers (or no
// host is known to hold the file). Throws ConfigError at once for a base URL cpp-httplib cannot
// use or a <rel> that is not a relative path of plain components.
PieceFetcher http_piece_fetcher(std::string rel, FileHosts hosts, RemoteOptions options = {});

// Copies rank file entry["file"] of checkpoint (or staging directory) <rel> from the host at
// `base_url` (GET .../v1/checkpoints/<rel>/files/<file>) into `dest_dir`: streamed into a
// temporary file beside the destination while its size, header checksum and every piece's
// checksum are compared with `entry` (from CheckpointWriter::rank_file_entry or
// read_rank_file_entry), then fsynced and renamed into place, so a copy that does not match is
// never kept under the name. Memory: a buffer, plus the file's header. Returns the path written.
// Throws PeerLostError when the host cannot be reached or the transfer breaks off or stalls,
// IoError when the host refuses (e.g. 404: it does not hold the file) or the file cannot be
// written, CorruptDataError when the bytes do not match the entry, InvalidArgumentError for a
// malformed entry. On any failure nothing is left in dest_dir.
std::string download_rank_file(const std::string& base_url, const std::string& rel,
                               const nlohmann::json& entry, const std::string& dest_dir,
                               const RemoteOptions& options = {});

}  // namespace tessel::store
