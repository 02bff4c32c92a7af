// Test helper: runs a `tessel` command line in-process through the given subcommand registrars
// (add_plan_command, ...) and returns what the action printed on std::cout.
#pragma once

#include <gtest/gtest.h>
#include <CLI/CLI.hpp>

#include <functional>
#include <initializer_list>
#include <iostream>
#include <sstream>
#include <string>

namespace tessel::cli::test_util {

using AddCommand = void (*)(CLI::App&, std::function<int()>&);

// Parses `args` (throws CLI::ParseError on a usage error), runs the chosen action and stores its
// return value in *status when given.
inline std::string run_cli(const std::string& args, std::initializer_list<AddCommand> commands,
                           int* status = nullptr) {
  CLI::App app{"test"};
  std::function<int()> action;
  for (AddCommand add : commands) add(app, action);
  app.parse(args, false);
  EXPECT_TRUE(action) << args;
  std::ostringstream captured;
  auto* old = std::cout.rdbuf(captured.rdbuf());
  int rc = -1;
  try {
    rc = action();
  } catch (...) {
    std::cout.rdbuf(old);
    throw;
  }
  std::cout.rdbuf(old);
  if (status) *status = rc;
  return captured.str();
}

}  // namespace tessel::cli::test_util
