// The planner's plan for local workers, and the micro-batch size a recovery asks it to keep.
#include "tessel/planner/local_plan.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "tessel/core/error.h"

namespace tessel::planner {
namespace {

LocalPlanRequest request(const std::string& model, int workers, int prefer = 0) {
  return {model::ModelConfig::preset(model), 12, 64, workers, "test", prefer};
}

// Either the preference is honoured or the best plan stands; `kept` counts the sizes honoured
// that differ from the best plan's.
int kept_sizes(const std::string& model, int workers) {
  const layout::Plan best = plan_for_workers(request(model, workers));
  int kept = 0;
  for (int m : {1, 2, 3, 4, 6, 12}) {
    const layout::Plan p = plan_for_workers(request(model, workers, m));
    EXPECT_TRUE(p.micro_batch == m || p == best) << m << ": " << p.describe();
    // Only the micro-batching changes: the layout (and its replicas) is the best one's.
    EXPECT_EQ(
        std::tuple(p.dp, p.tp, p.pp, p.virtual_stages, p.schedule, p.zero_stage),
        std::tuple(best.dp, best.tp, best.pp, best.virtual_stages, best.schedule, best.zero_stage))
        << m << ": " << p.describe();
    EXPECT_EQ(p.world(), workers);
    EXPECT_EQ(p.global_batch(), 12);
    kept += p.micro_batch == m && m != best.micro_batch;
  }
  return kept;
}

TEST(LocalPlan, KeepsAPreferredMicroBatchSizeOnlyWhereItCostsNothing) {
  for (int workers : {1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << workers << " workers");
    // GPT-2 124M: the nominal model prices the micro-batch sizes within 0.5% of each other.
    EXPECT_GT(kept_sizes("gpt2-124m", workers), 0);
    // gpt2-tiny: a micro-batch's fixed costs dominate, every smaller size is over 2% slower.
    EXPECT_EQ(kept_sizes("gpt2-tiny", workers), 0);
  }
  EXPECT_THROW(plan_for_workers(request("gpt2-tiny", 0)), ConfigError);
}

}  // namespace
}  // namespace tessel::planner
