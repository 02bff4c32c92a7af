// `tessel generate`: text from a model, to see what it learned.
//
//   tessel generate --checkpoint PATH --prompt TEXT [--max-new-tokens 64] [--temperature 0.8]
//                   [--top-k 50] [--top-p 0.95] [--seed 1] [--tokenizer PATH] [--no-stop-at-eot]
//
// PATH is anything checkpoint::ModelWeights reads: a tessel checkpoint (a step directory, or a
// run's checkpoint.dir: its newest step) or a Hugging Face model directory. The tokenizer is
// --tokenizer, else the model directory's tokenizer.json or tokenizer.model, else tessel's
// byte-level tokenizer (the one `tessel data prepare` uses by default). Prints the prompt and
// then the generated text as it comes (model/decoder.h with its KV cache, model/sampler.h), and on
// stderr the speed. Generation stops after --max-new-tokens, at the tokenizer's end-of-text id
// (unless --no-stop-at-eot), or at the model's context (max_seq_len), saying so on stderr.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `generate` subcommand to `app`; parsing it sets `action` to run it.
void add_generate_command(CLI::App& app, std::function<int()>& action);

}  // namespace tessel::cli
