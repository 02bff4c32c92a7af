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

// ZB-V, the paper's V-shaped schedule: two model chunks per stage placed as a V (instruction.h,
// Placement::v_shape: rank s holds virtual stages s and 2p - 1 - s, so rank 0 computes both the
// embedding and the loss and rank p - 1 passes its chunk 0's output to its own chunk 1), the
// backward split into Bi and Bw. The lists come from a list scheduler run with unit times
// (T_F = T_Bi = T_Bw = 1 per chunk, free communication) that, whenever a stage is free, runs
//   the ready Bi of the lowest micro-batch (its stage before it waits for it), else
//   the ready F of the lowest micro-batch, chunk 1 first (it leads to the loss), if the
//     activation budget allows, else
//   the oldest pending Bw (it only frees memory: it fills what would be idle time), else waits.
// The budget is 1F1B's: at most 2p chunk activations per stage (p micro-batches of a whole
// stage; an F takes one, its Bw returns it), with a chunk-0 forward admitted only when room is
// left for the chunk-1 forward of every micro-batch started on the stage (counting what the
// pending Bws will free), which keeps the scheduler from deadlocking.
//
// Bubble with unit times: every stage computes 6m units, and the last stage's first forward
// cannot start before p - 1 (the chain's first p - 1 chunk-0 forwards), so
//   makespan >= 6m + p - 1,   bubble >= (p - 1) / (6m + p - 1)   (zb_v_bubble_fraction)
// -- half of ZB-H1's (p - 1) / (3m + p - 1) in the same units, as the chunks are half-stages.
// The scheduler reaches that bound for most (p, m) with m >= p and stays within p - 1 units of
// it for all (zero_bubble_test checks p <= 8, m <= 32).
Schedule zb_v(int stages, int micro_batches);

// The lower bound above, the ZB-V bubble the bench compares with. Throws ConfigError when a size
// is below 1.
double zb_v_bubble_fraction(int stages, int micro_batches);

// The bubble of zb_h1 under the unit costs above (formula above). Throws ConfigError when a size
// is below 1.
double zb_h1_bubble_fraction(int stages, int micro_batches);

}  // namespace tessel::schedule
