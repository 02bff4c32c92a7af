// Internal to the store's HTTP servers (http_server.h, checkpoint_root_server.h): what both serve
// the same way -- the tensor list, the streamed box response with its checks and error codes, and
// the guarded server with its token rules and exception handler -- so that the two endpoints
// cannot drift apart. Not an interface of the store.
#pragma once

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "tessel/net/guarded_server.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/http_server.h"

namespace tessel::store::detail {

// A component of a checkpoint path under a root: letters, digits, '.', '_' and '-', not empty,
// "." or "..". A path of such components joined to a directory stays inside it (symbolic links
// aside).
bool valid_path_component(const std::string& component);

// A JSON error {"error": message} (plus the fields of `extra`, an object) with `status`.
void send_error(httplib::Response& res, int status, const std::string& message,
                const nlohmann::json& extra = nullptr);

// GET .../tensors: [{"name", "dtype", "shape", "bytes"}].
void send_tensor_list(const CheckpointReader& reader, httplib::Response& res);

// GET .../tensors/<name>[?box=...][&format=raw|npy][&dtype=...] as http_server.h describes. A box
// that needs a piece of a rank file the reader does not hold gets 404 naming the files in
// "missing_files". The response keeps `reader` alive while it streams.
void send_tensor(std::shared_ptr<const CheckpointReader> reader, const std::string& name,
                 const httplib::Request& req, httplib::Response& res,
                 const StoreServerOptions& options);

// The rank files the reader does not hold that a GET of tensor `name` with `req`'s box would
// need; empty when it needs none, or when the request is invalid (send_tensor answers that).
std::vector<std::string> missing_files_for(const CheckpointReader& reader, const std::string& name,
                                           const httplib::Request& req);

// A GuardedServer for `options` (host, port, token file, limits; GET only) whose exception
// handler answers InvalidArgumentError with 400 and anything else with 500 (logged). Throws
// InvalidArgumentError for a port outside 0..65535, ConfigError as GuardedServer does and for a
// zero chunk_bytes.
std::unique_ptr<net::GuardedServer> make_store_server(const StoreServerOptions& options);

}  // namespace tessel::store::detail
