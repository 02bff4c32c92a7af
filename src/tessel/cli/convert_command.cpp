#include "tessel/cli/convert_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "tessel/checkpoint/hf_convert.h"
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
  bool force = false;
};

int convert_to_hf(const ConvertArgs& a) {
  TESSEL_CHECK(a.model.empty(), ConfigError,
               "--model applies to --from hf only: an export takes the model from the checkpoint");
  check_output_dir(a.output, {a.input}, a.force, "output");
  checkpoint::HfExportOptions opt;
  if (!a.dtype.empty()) opt.dtype = parse_dtype(a.dtype);
  const auto r = checkpoint::export_hf(a.input, a.output, opt);
  fmt::print("wrote {}/model.safetensors ({} tensors, {}, {} bytes) and {}/config.json: {} '{}'",
             a.output, r.tensors, dtype_name(opt.dtype), r.bytes, a.output, r.architecture,
             r.model.name);
  if (r.skipped > 0) fmt::print(" (skipped {} non-parameter tensors of the checkpoint)", r.skipped);
  fmt::print("\n");
  std::fflush(stdout);
  return 0;
}

int convert_from_hf(const ConvertArgs& a) {
  TESSEL_CHECK(a.dtype.empty(), ConfigError,
               "--dtype applies to --to hf only: tessel checkpoints hold f32 parameters");
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

}  // namespace tessel::cli
