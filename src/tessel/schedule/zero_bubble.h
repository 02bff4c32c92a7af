// ZB-H1, the memory-neutral zero-bubble schedule of "Zero Bubble Pipeline Parallelism" (Qi, Wan,
// Huang, Lin; ICLR 2024), in the instruction-list form of instruction.h (chunks = 1).
//
// The backward of every (micro_batch, stage) is split into Bi (input gradient, on the critical
// path: the previous stage waits for it) and Bw (weight gradient, needed only by the optimizer
// step). Stage s runs, in order:
//   warmup   min(p - s - 1, m) forwards                        (as 1F1B)
//   F Bi     s times: one forward, one Bi, no Bw               (Bw deferred)
//   F Bi Bw  while forwards remain
//   Bi Bw    while Bis remain
//   Bw       the s deferred weight gradients
// (the order of the authors' DeepSpeed-based ZeroBubbleH1Pipeline with its exact-semantics
// option). Stage s defers s weight gradients, which its later start leaves room for:
// every stage holds at most min(p, m) activations (an F adds one, its Bw releases it), the same
// as stage 0 of 1F1B, so the peak over stages equals 1F1B's. The deferred Bws fill the drain,
// where 1F1B's later stages sit idle.
//
// Analytic bubble with free communication and equal times T_F = T_Bi = T_Bw = 1 (validate()'s
// DryRunCosts{1, 2, 1, 1}); every stage computes 3m units:
//   makespan = 3m + p - 1          when m >= p:  bubble = (p - 1) / (3m + p - 1)
//   makespan = 2(m + p) - 1        when m <  p:  bubble = (2p - m - 1) / (2(m + p) - 1)
// For m >= p that is a third of 1F1B's fill and drain (3(p - 1) units with B = 2). With unequal
// times, m >= p and T_Bw <= min(T_F, T_Bi), every stage idles (p - 1)(T_F + T_Bi - T_Bw), the
// paper's ZB-H1 bubble (zero_bubble_test checks several such costs; with a larger T_Bw the
// deferred Bws no longer fit the drain and the bubble is larger). (When m < p the schedule is all
// warmup and drain: one micro-batch's round trip 2p + 1 plus two units per further micro-batch.)
#pragma once

#include "tessel/schedule/instruction.h"

namespace tessel::schedule {

// Throws ConfigError when a size is below 1. Every stage's list ends with optimizer_step; with
// p == 1 it is F Bi Bw per micro-batch.
Schedule zb_h1(int stages, int micro_batches);

// The bubble of zb_h1 under the unit costs above (formula above). Throws ConfigError when a size
// is below 1.
double zb_h1_bubble_fraction(int stages, int micro_batches);

}  // namespace tessel::schedule
