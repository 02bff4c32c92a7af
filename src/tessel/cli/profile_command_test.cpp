// `tessel profile` through a CLI::App built here; its output feeds `tessel plan --profile` and
// `tessel simulate --profile`.
#include "tessel/cli/profile_command.h"

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessel/cli/cli_test_util.h"
#include "tessel/cli/plan_command.h"
#include "tessel/cli/simulate_command.h"
#include "tessel/core/error.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/cost_model.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

std::string run(const std::string& args) {
  int rc = -1;
  auto out =
      test_util::run_cli(args, {add_profile_command, add_plan_command, add_simulate_command}, &rc);
  EXPECT_EQ(rc, 0) << args;
  return out;
}

TEST(ProfileCommand, WritesAProfileThatPlanAndSimulateRead) {
  testing::TempDir dir;
  const auto path = (dir / "profile.json").string();
  const std::string out = run(
      "profile --model gpt2-tiny --seq 16 --workers 2 --micro-batches 1,2 --repeats 1 --warmup 0 "
      "--message-bytes 4096,65536 --out " +
      path);
  EXPECT_NE(out.find("tessel profile: gpt2-tiny at seq 16, 2 worker(s)"), std::string::npos) << out;
  EXPECT_NE(out.find("point-to-point:"), std::string::npos) << out;
  EXPECT_NE(out.find("2 ranks: bus"), std::string::npos) << out;

  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  const auto model = model::ModelConfig::preset("gpt2-tiny");
  EXPECT_EQ(planner::from_profile_json(doc).num_devices(), 2);
  EXPECT_EQ(planner::compute_profile_from_json(doc, model).points.size(), 2u);

  const std::string plan =
      run("plan --model gpt2-tiny --profile " + path + " --global-batch 4 --seq 16 --json");
  const auto planned = nlohmann::json::parse(plan);
  EXPECT_EQ(planned.at("cluster"), "this-machine");
  EXPECT_EQ(planned.at("precision"), "fp32");
  EXPECT_GT(planned.at("predicted").at("step_s").get<double>(), 0);

  const auto plan_file = (dir / "plan.json").string();
  std::ofstream(plan_file) << plan;
  const auto sim =
      nlohmann::json::parse(run("simulate --plan " + plan_file + " --profile " + path + " --json"));
  EXPECT_GT(sim.at("step_s").get<double>(), 0);
}

TEST(ProfileCommand, NeedsExactlyOneModelSource) {
  EXPECT_THROW(run("profile --seq 16"), ConfigError);
  EXPECT_THROW(run("profile --model gpt2-tiny --config x.yaml"), ConfigError);
  EXPECT_THROW(run("profile --model no-such-model"), ConfigError);
}

}  // namespace
}  // namespace tessel::cli
