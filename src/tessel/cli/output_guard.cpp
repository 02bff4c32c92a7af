#include "tessel/cli/output_guard.h"

#include <filesystem>
#include <optional>

#include "tessel/core/check.h"

namespace tessel::cli {

namespace {

namespace fs = std::filesystem;

// The checkpoint directory `p` lies in (p itself or an ancestor holding manifest.json), if any.
std::optional<fs::path> enclosing_checkpoint(const fs::path& p) {
  std::error_code ec;
  fs::path at = fs::weakly_canonical(fs::absolute(p), ec);
  if (ec) return std::nullopt;
  for (; !at.empty(); at = at.parent_path()) {
    if (fs::exists(at / "manifest.json", ec)) return at;
    if (at == at.parent_path()) break;
  }
  return std::nullopt;
}

void check_not_an_input(const std::string& output, const std::vector<std::string>& inputs,
                        std::string_view flag) {
  for (const auto& in : inputs) {
    std::error_code ec;
    TESSEL_CHECK(!fs::equivalent(output, in, ec), ConfigError,
                 "{} {} is the input {}: writing it would destroy what is read; name another file",
                 flag, output, in);
  }
  if (auto ck = enclosing_checkpoint(output)) {
    TESSEL_THROW(ConfigError,
                 "{} {} lies inside the checkpoint {}: writing there would damage it; write "
                 "outside it",
                 flag, output, ck->string());
  }
}

}  // namespace

void check_output_file(const std::string& output, const std::vector<std::string>& inputs,
                       bool force, std::string_view flag) {
  check_not_an_input(output, inputs, flag);
  std::error_code ec;
  TESSEL_CHECK(force || !fs::is_regular_file(output, ec), ConfigError,
               "{} {} exists; add --force to replace it", flag, output);
}

void check_output_dir(const std::string& output, const std::vector<std::string>& inputs, bool force,
                      std::string_view flag) {
  check_not_an_input(output, inputs, flag);
  std::error_code ec;
  const bool holds_files = fs::is_directory(output, ec) && !fs::is_empty(output, ec);
  TESSEL_CHECK(force || !holds_files, ConfigError,
               "{} {} is a directory that holds files already; add --force to write into it "
               "(files of the same names are replaced)",
               flag, output);
}

}  // namespace tessel::cli
