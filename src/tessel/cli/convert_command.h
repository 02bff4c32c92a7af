// `tessel convert ...`: between tessel checkpoints and Hugging Face models
// (checkpoint/hf_convert.h).
//
//   tessel convert --to hf CHECKPOINT_DIR OUT_DIR [--dtype f32|bf16|f16]
//       writes OUT_DIR/model.safetensors and OUT_DIR/config.json (GPT2LMHeadModel or
//       LlamaForCausalLM) from the parameters of a tessel checkpoint
//   tessel convert --from hf HF_DIR OUT_CHECKPOINT_DIR [--model PRESET]
//       writes a tessel checkpoint from a Hugging Face model directory (config.json and
//       model.safetensors or a sharded index); --model imports as a named preset instead of (or
//       checked against) config.json
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `convert` subcommand to `app`; parsing it sets `action` to run it.
void add_convert_command(CLI::App& app, std::function<int()>& action);
// Adds `init`: a preset's deterministic initial weights as a tessel checkpoint.
void add_init_command(CLI::App& app, std::function<int()>& action);

}  // namespace tessel::cli
