// `tessel profile` and `tessel simulate` as a standalone executable, for bench/calibrate.py when
// the `tessel` binary does not carry those subcommands (they are the same functions:
// cli/profile_command.h, cli/simulate_command.h).
//
// Usage: bench_calibrate_helper profile ... | simulate ...   (the options of the subcommands)
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <functional>
#include <new>

#include "tessel/cli/profile_command.h"
#include "tessel/cli/simulate_command.h"
#include "tessel/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"bench_calibrate_helper: tessel profile / tessel simulate"};
  app.require_subcommand(1);
  std::function<int()> action;
  tessel::cli::add_profile_command(app, action);
  tessel::cli::add_simulate_command(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return action ? action() : 0;
  } catch (const tessel::ConfigError& e) {
    std::fflush(stdout);
    fmt::print(stderr, "bench_calibrate_helper: {}: {}\n", e.kind(), e.what());
    return 2;
  } catch (const tessel::Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "bench_calibrate_helper: {}: {}\n", e.kind(), e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "bench_calibrate_helper: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_calibrate_helper: internal error: {}\n", e.what());
    return 1;
  }
}
