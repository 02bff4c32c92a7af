// Internal to the op harness: each op family's cases, with their bounds derived beside them
// (op_harness_cases.cpp). op_cases() in op_harness.cpp puts them together.
#pragma once

#include <vector>

#include "tessel/kernels/op_harness.h"

namespace tessel::kernels::harness::cases {

void add_embedding(std::vector<OpCase>& out);
void add_layernorm(std::vector<OpCase>& out);
void add_rmsnorm(std::vector<OpCase>& out);
void add_linear(std::vector<OpCase>& out);
void add_attention(std::vector<OpCase>& out);
void add_rope(std::vector<OpCase>& out);
void add_activations(std::vector<OpCase>& out);  // gelu, swiglu, residual
void add_cross_entropy(std::vector<OpCase>& out);
void add_vocab_parallel_ce(std::vector<OpCase>& out);
void add_optimizer(std::vector<OpCase>& out);  // adamw_update, sum_of_squares, scale

}  // namespace tessel::kernels::harness::cases
