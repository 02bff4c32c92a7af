#include "tessel/cli/convert_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cctype>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "tessel/checkpoint/hf_convert.h"
#include "tessel/checkpoint/initialised_checkpoint.h"
#include "tessel/cli/output_guard.h"
#include "tessel/core/check.h"
#include "tessel/model/model_config.h"

namespace tessel::cli {

namespace {

struct ConvertArgs {
  std::string to, from;
  std::string input, output;
  std::string dtype;
  std::string model;
  std::string shard_size;
  bool force = false;
};

// "5GB", "500MB", "2GiB", "1048576": a size in bytes as transformers' max_shard_size writes it
// (KB/MB/GB decimal, KiB/MiB/GiB binary). Throws ConfigError naming the flag.
uint64_t parse_size(const std::string& text, const char* flag) {
  size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  const std::string unit = text.substr(digits);
  double scale = 0;
  for (const auto& [name, value] :
       std::initializer_list<std::pair<const char*, double>>{{"", 1},
                                                             {"B", 1},
                                                             {"KB", 1e3},
                                                             {"MB", 1e6},
                                                             {"GB", 1e9},
                                                             {"KiB", 1024.0},
                                                             {"MiB", 1048576.0},
                                                             {"GiB", 1073741824.0}})
    if (unit == name) scale = value;
  double number = 0;
  try {
    size_t used = 0;
    number = digits > 0 ? std::stod(text.substr(0, digits), &used) : 0;
    if (used != digits) number = 0;
  } catch (const std::exception&) {
    number = 0;
  }
  const double bytes = number * scale;
  TESSEL_CHECK(scale > 0 && bytes >= 1 && bytes < 1e18, ConfigError,
               "{} '{}' is not a size: write e.g. 5GB, 500MB or 2GiB (more than 0 bytes)", flag,
               text);
  return uint64_t(bytes);
}

int convert_to_hf(const ConvertArgs& a) {
  TESSEL_CHECK(a.model.empty(), ConfigError,
               "--model applies to --from hf only: an export takes the model from the checkpoint");
  check_output_dir(a.output, {a.input}, a.force, "output");
  checkpoint::HfExportOptions opt;
  if (!a.dtype.empty()) opt.dtype = parse_dtype(a.dtype);
  if (!a.shard_size.empty()) opt.max_shard_bytes = parse_size(a.shard_size, "--shard-size");
  const auto r = checkpoint::export_hf(a.input, a.output, opt);
  const std::string files = r.shards == 1 ? fmt::format("{}/model.safetensors", a.output)
                                          : fmt::format(
                                                "{} shards {}/model-*-of-{:05d}.safetensors with "
                                                "model.safetensors.index.json",
                                                r.shards, a.output, r.shards);
  fmt::print("wrote {} ({} tensors, {}, {} bytes) and {}/config.json: {} '{}'", files, r.tensors,
             dtype_name(opt.dtype), r.bytes, a.output, r.architecture, r.model.name);
  if (r.skipped > 0) fmt::print(" (skipped {} non-parameter tensors of the checkpoint)", r.skipped);
  fmt::print("\n");
  std::fflush(stdout);
  return 0;
}

int convert_from_hf(const ConvertArgs& a) {
  TESSEL_CHECK(a.dtype.empty(), ConfigError,
               "--dtype applies to --to hf only: tessel checkpoints hold f32 parameters");
  TESSEL_CHECK(a.shard_size.empty(), ConfigError,
               "--shard-size applies to --to hf only: it sets the size of the exported files");
  checkpoint::HfImportOptions opt;
  if (!a.model.empty()) opt.model = model::ModelConfig::preset(a.model);
  const auto r = checkpoint::import_hf(a.input, a.output, opt);
  fmt::print(
      "wrote tessel checkpoint {}: {} model '{}', {} parameter tensors (f32) from {} "
      "weights in {}",
      a.output, model::family_name(r.model.family), r.model.name, r.tensors, r.architecture,
      r.source_dtypes);
  if (r.ignored > 0) fmt::print(" (ignored {} non-parameter tensors)", r.ignored);
  fmt::print("\n");
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_convert_command(CLI::App& app, std::function<int()>& action) {
  auto args = std::make_shared<ConvertArgs>();
  auto* cmd = app.add_subcommand(
      "convert", "convert between tessel checkpoints and Hugging Face models (GPT-2, LLaMA)");
  auto* to = cmd->add_option("--to", args->to, "export a tessel checkpoint to this format (hf)")
                 ->check(CLI::IsMember({"hf"}));
  auto* from = cmd->add_option("--from", args->from, "import a model of this format (hf)")
                   ->check(CLI::IsMember({"hf"}));
  to->excludes(from);
  cmd->add_option("input", args->input,
                  "tessel checkpoint directory (--to) or Hugging Face model directory (--from)")
      ->required();
  cmd->add_option("output", args->output,
                  "Hugging Face model directory (--to) or tessel checkpoint directory (--from)")
      ->required();
  cmd->add_option("--dtype", args->dtype, "--to hf: dtype of model.safetensors (f32, bf16, f16)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  cmd->add_option("--model", args->model,
                  "--from hf: import as this preset (see `tessel presets`) instead of config.json");
  cmd->add_option("--shard-size", args->shard_size,
                  "--to hf: largest file, as transformers' max_shard_size (default 5GB); a larger "
                  "model is written as shards with model.safetensors.index.json");
  cmd->add_flag("--force", args->force, "--to hf: write into an output directory that holds files");
  cmd->callback([&action, args] {
    action = [args] {
      TESSEL_CHECK(!args->to.empty() || !args->from.empty(), ConfigError,
                   "tessel convert needs a direction: --to hf (tessel checkpoint to Hugging "
                   "Face) or --from hf (Hugging Face to tessel checkpoint)");
      return args->to.empty() ? convert_from_hf(*args) : convert_to_hf(*args);
    };
  });
}

void add_init_command(CLI::App& app, std::function<int()>& action) {
  struct InitArgs {
    std::string model, output;
    uint64_t seed = 1234;
    bool force = false;
  };
  auto args = std::make_shared<InitArgs>();
  auto* cmd = app.add_subcommand(
      "init",
      "write a model's deterministic initial weights as a tessel checkpoint (any size, streamed)");
  cmd->add_option("--model", args->model, "model preset (see `tessel presets`)")->required();
  cmd->add_option("--seed", args->seed, "initialisation seed (training.seed)");
  cmd->add_option("output", args->output, "tessel checkpoint directory to write")->required();
  cmd->add_flag("--force", args->force, "replace the output directory's checkpoint");
  cmd->callback([&action, args] {
    action = [args] {
      check_output_dir(args->output, {}, args->force, "output");
      const auto model = model::ModelConfig::preset(args->model);
      const uint64_t bytes =
          checkpoint::write_initialised_checkpoint(model, args->seed, args->output);
      fmt::print(
          "wrote tessel checkpoint {}: {} model '{}' ({:.3g} parameters, {} bytes), seed {}\n",
          args->output, model::family_name(model.family), model.name, double(model.num_params()),
          bytes, args->seed);
      std::fflush(stdout);
      return 0;
    };
  });
}

}  // namespace tessel::cli
