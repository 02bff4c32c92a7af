// What a command may write over. Before `tessel data prepare`, `store get --out` or `convert`
// writes, its output is checked against its inputs: an output that is one of the inputs (the
// same file under any name or link) or lies inside a tessel checkpoint (a directory holding
// manifest.json, or below one) is refused even with --force -- writing it would destroy what
// the command reads; an existing regular file, or a directory that holds anything, is replaced
// only with --force. Devices and pipes are written through (core/atomic_file.h) and need no
// --force. Each refusal is a ConfigError naming the flag, the path and the way out.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tessel::cli {

void check_output_file(const std::string& output, const std::vector<std::string>& inputs,
                       bool force, std::string_view flag);

void check_output_dir(const std::string& output, const std::vector<std::string>& inputs, bool force,
                      std::string_view flag);

}  // namespace tessel::cli
