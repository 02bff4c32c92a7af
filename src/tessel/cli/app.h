// The `tessel` command line: parses arguments and dispatches to subcommands. Every tessel::Error
// is caught here and reported as one line naming its kind; the exit code is non-zero.
#pragma once

namespace tessel::cli {

int run(int argc, char** argv);

}  // namespace tessel::cli
