// TrainingState: the names of everything a training job must carry from one layout to another.
//
// The state of a job is
//   - per parameter tensor (ModelSpec names, global shapes) a few *kinds* of float state:
//       param    the weights the model computes with. In this fp32 system they are also the
//                master weights of the optimizer (there is no separate copy).
//       master   fp32 master weights for when parameters are kept in bf16; no fp32 layout has
//                them yet, but the name is reserved so checkpoints and layouts can grow into it.
//       adam_m   Adam's first moment,
//       adam_v   Adam's second moment;
//     (model_spec.h names the tensors; state_layout.h says which rank holds which box of which
//     kind where), and
//   - ScalarState: small state every rank replicates -- the optimizer step, the position in the
//     learning-rate schedule, the data cursor and the RNG state -- moved as one opaque blob.
// A (tensor name, kind, box of the tensor) triple names any part of the tensor state.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::layout {

enum class StateKind : uint8_t { param, master, adam_m, adam_v };
inline constexpr std::array<StateKind, 4> kAllStateKinds = {StateKind::param, StateKind::master,
                                                            StateKind::adam_m, StateKind::adam_v};

// "param" / "master" / "adam_m" / "adam_v".
std::string_view state_kind_name(StateKind k);
// Throws ConfigError listing the known names.
StateKind parse_state_kind(std::string_view name);
// Whether the kind is optimizer state: ZeRO-1 shards these over dp (params stay replicated).
inline bool is_optimizer_state(StateKind k) {
  return k != StateKind::param;
}

// "<tensor>/<kind>", e.g. "transformer.h.0.attn.c_attn.weight/adam_m" (a kind's key in
// checkpoints and error messages; param is named by the tensor name alone).
std::string state_name(std::string_view tensor, StateKind kind);

// The replicated scalar state (identical on every rank).
struct ScalarState {
  int64_t step = 0;          // optimizer steps taken (Adam's bias correction uses step + 1)
  int64_t lr_step = 0;       // position in the learning-rate schedule (== step unless re-based)
  int64_t data_cursor = 0;   // samples of the global sample order consumed so far
  std::vector<uint8_t> rng;  // opaque RNG state; empty while training draws no random numbers

  bool operator==(const ScalarState&) const = default;
};

// Little-endian, versioned byte form of ScalarState (for messages and checkpoints).
std::vector<uint8_t> encode(const ScalarState& s);
// Throws CorruptDataError for a truncated or unknown blob.
ScalarState decode_scalar_state(const uint8_t* data, size_t size);

}  // namespace tessel::layout
