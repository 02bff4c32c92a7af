// Pipeline schedules by name: the one place that turns a schedule's name into its instruction
// lists and its analytic bubble. The runtime builds its plan's schedule here (by
// layout::schedule_name) and the planner's simulator the schedule it is asked for, so both run
// the same lists.
//
//   name               lists                                  chunks   analytic bubble
//   gpipe              gpipe(p, m)                            1        bubble_fraction(p, m)
//   1f1b               one_f_one_b(p, m)                      1        bubble_fraction(p, m)
//   interleaved-1f1b   interleaved_one_f_one_b(p, m, v)       v        bubble_fraction(p, m, v)
//   zb-h1              zb_h1(p, m)                            1        zb_h1_bubble_fraction(p, m)
//   zb-v               zb_v(p, m), V-shaped placement         2        zb_v_bubble_fraction(p, m)
//
// (generators.h, zero_bubble.h and bubble.h describe them; the runtime does not run the
// zero-bubble ones yet: their split backward needs the model's Bi/Bw.)
#pragma once

#include <span>
#include <string_view>

#include "tessel/schedule/instruction.h"

namespace tessel::schedule {

// The names above, in that order.
std::span<const std::string_view> schedule_names();

// Whether `name` is one of schedule_names().
bool is_schedule_name(std::string_view name);

// The instruction lists of schedule `name` on `stages` pipeline ranks over `micro_batches`,
// each rank holding `virtual_stages` model chunks. Throws ConfigError for an unknown name (listing
// the known ones), virtual_stages below 1, virtual_stages > 1 for a schedule of one chunk per rank,
// and what the generator throws (sizes below 1, interleaved 1F1B's micro-batch multiple).
Schedule make_schedule(std::string_view name, int stages, int micro_batches,
                       int virtual_stages = 1);

// The analytic bubble of schedule `name` with equal stages and free links (table above). Throws
// ConfigError as make_schedule does for the name and virtual stages, and for sizes below 1.
double analytic_bubble(std::string_view name, int stages, int micro_batches,
                       int virtual_stages = 1);

}  // namespace tessel::schedule
