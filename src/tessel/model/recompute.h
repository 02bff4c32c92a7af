// Recompute: which block activations a Transformer keeps between a micro-batch's forward and its
// backward, and which it recomputes in backward instead (activation recomputation, also called
// activation checkpointing).
//
// - none:      every block's activations are kept per activation slot (the llm.c layout).
// - selective: as none, except the attention probabilities [B, Hq, T, T] (Megatron-LM's
//              "selective activation recomputation", Korthikanti et al. 2022): one buffer shared
//              by every block and slot, refilled from the block's saved q and k right before its
//              attention backward.
// - full:      only each block's input (the residual stream entering it) is kept per slot; the
//              rest of a block's activations exist once, shared by every block and slot, and a
//              block's backward first re-runs the block's forward from its saved input.
// Recomputation runs the same kernels on the same inputs as the forward did, so losses, logits
// and gradients are bit-identical to none; it costs one extra attention forward per block
// (selective) or one extra block forward (full). transformer.h gives the exact bytes of each.
#pragma once

#include <string_view>

namespace tessel::model {

enum class Recompute { none, selective, full };

// "none", "selective", "full".
std::string_view recompute_name(Recompute r);
// The inverse of recompute_name; throws ConfigError for any other name, listing the valid ones.
Recompute parse_recompute(std::string_view name);

}  // namespace tessel::model
