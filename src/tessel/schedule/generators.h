// Schedule generators: pure functions from sizes to per-stage instruction lists (conventions in
// instruction.h). Each stage's list ends with optimizer_step. All throw ConfigError when a size
// is below 1 or the combination is unsupported.
//
// In-flight activations (forwards whose backward has not run yet) peak at, on stage s:
//   gpipe                     m
//   one_f_one_b               min(p - s, m)
//   interleaved_one_f_one_b   min(warmup + 1, v * m) chunk activations, warmup as below
#pragma once

#include "tessel/schedule/instruction.h"

namespace tessel::schedule {

// GPipe: every stage runs all m forwards, then all m backwards (micro-batch order 0..m-1).
Schedule gpipe(int stages, int micro_batches);

// 1F1B (PipeDream-flush, Megatron-LM non-interleaved): stage s runs min(p - s - 1, m) warmup
// forwards, then alternates one forward and one backward, then drains the remaining backwards.
Schedule one_f_one_b(int stages, int micro_batches);

// Interleaved 1F1B (Megatron-LM, virtual pipeline stages): each stage holds `chunks` model chunks
// (virtual stages chunk * p + s). Forwards run in groups of p micro-batches per chunk (chunk 0
// for micro-batches 0..p-1, then chunk 1 for the same ones, ...); backwards in the same groups
// with chunks in reverse. Stage s warms up with min(2 * (p - s - 1) + (v - 1) * p, v * m)
// forwards, or all v * m of them when m == p, as Megatron-LM does.
// Requires micro_batches % stages == 0 when chunks > 1 (Megatron-LM's constraint). With
// chunks == 1 it is exactly one_f_one_b (Megatron-LM runs v = 1 through that schedule).
Schedule interleaved_one_f_one_b(int stages, int micro_batches, int chunks);

// Just-in-time recomputation (Varuna): `s` with every stage keeping one chunk's activations at a
// time. A forward's activations stay until the next forward of that chunk overwrites them; each
// B whose forward's were overwritten gets an R right before its receive of the gradient (before
// the B itself when the gradient comes from this stage), so the recomputation runs while the
// gradient travels. The name gains "+jit". Throws ConfigError for a schedule with split backward
// passes (the Bw would need the activations after the B).
Schedule with_jit_recompute(const Schedule& s);

}  // namespace tessel::schedule
