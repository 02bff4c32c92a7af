// Deterministic, shard-independent parameter initialisation.
//
// Every element's initial value is a pure function of (seed, tensor name, global flat index):
// element i (row-major index in the FULL tensor) comes from output i/2 of a splitmix64 stream
// keyed by (seed, hash(name)), turned into two normal samples by Box-Muller (i even takes one,
// i odd the other). No state is carried from element to element, so any box of any tensor -- a
// tensor-parallel shard, a pipeline stage's layers -- can be generated alone and equals, bit for
// bit, the same slice of the whole tensor generated at once, whatever the layout, thread count
// or rank count. (Bit-exact across machines that share the C math library: log, sin and cos
// are float libm calls.)
//
// Values follow ParamSpec::init (normal(0, std), zeros, ones); rows at or beyond
// ParamSpec::init_rows (vocabulary padding) are zero.
#pragma once

#include <cstdint>
#include <string_view>

#include "tessel/model/model_spec.h"
#include "tessel/tensor/box.h"

namespace tessel::model {

// The stream key of one tensor: mixes the seed with a hash of the name.
uint64_t init_key(uint64_t seed, std::string_view name);

// The initial value of the element at global flat index `index` of `spec`.
float init_value(const ParamSpec& spec, uint64_t seed, int64_t index);

// Writes the elements of `box` (in the full tensor's index space) to `out`, packed row-major
// (box.volume() floats). Throws InvalidArgumentError when the box's rank differs from the
// tensor's or the box leaves it.
void init_box(const ParamSpec& spec, uint64_t seed, const Box& box, float* out);

// The whole tensor (spec.numel() floats).
void init_full(const ParamSpec& spec, uint64_t seed, float* out);

}  // namespace tessel::model
