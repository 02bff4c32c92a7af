// Test helpers for layouts (used by the layout and reshard tests).
#pragma once

#include <utility>
#include <vector>

#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"

namespace tessel::layout::test_util {

// A plan of the given degrees; interleaved 1F1B when v > 1, pp micro-batches (so interleaving
// divides).
inline Plan make_plan(int dp, int tp, int pp, int v = 1, int zero = 0, std::vector<int> lps = {},
                      RankOrder order = RankOrder::tp_dp_pp) {
  Plan p;
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  p.virtual_stages = v;
  p.zero_stage = zero;
  p.layers_per_stage = std::move(lps);
  p.order = order;
  p.micro_batches = pp;
  if (v > 1) p.schedule = ScheduleKind::interleaved_one_f_one_b;
  return p;
}

// LLaMA with one kv head shared by all query heads (multi-query attention): every tp > 1
// replicates the kv head.
inline model::ModelConfig llama_mqa() {
  model::ModelConfig c = model::ModelConfig::preset("llama-tiny");
  c.name = "llama-mqa";
  c.n_kv_head = 1;
  c.n_layer = 3;
  return c;
}

}  // namespace tessel::layout::test_util
