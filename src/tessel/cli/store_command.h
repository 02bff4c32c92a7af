// `tessel store ...`: inspect, extract, verify and serve checkpoints (see store/).
//
//   tessel store ls DIR                         table of tensors: name, dtype, shape, pieces, bytes
//   tessel store get DIR NAME [--box B] [--out FILE] [--format raw|npy] [--dtype T]
//                                               a box of a tensor, raw little-endian or .npy, to
//                                               FILE (atomically) or to stdout (not a terminal)
//   tessel store verify DIR                     reads every byte and checks every checksum;
//                                               prints OK or the first error (exit 1)
//   tessel store serve DIR [--host 127.0.0.1] [--port N]
//                                               HTTP server (store/http_server.h) until SIGINT
//                                               or SIGTERM
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `store` subcommand to `app`; parsing one of its commands sets `action` to run it.
void add_store_command(CLI::App& app, std::function<int()>& action);

}  // namespace tessel::cli
