// The records workers and the coordinator exchange through the control store: round trips, their
// keys, and damaged records named clearly.
#include "tessel/elastic/reconfiguration.h"

#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic {
namespace {

using tessel::testing::error_of;

layout::Plan plan(int dp, int pp) {
  layout::Plan p;
  p.dp = dp;
  p.pp = pp;
  return p;
}

TEST(Reconfiguration, RoundTripsThroughJson) {
  Reconfiguration m;
  m.generation = 3;
  m.from = plan(2, 1);
  m.to = plan(1, 3);
  m.from_members = {kLostProcess, 4};
  m.to_members = {4, 5, 6};
  m.spawn = {5, 6};
  m.next_process_id = 7;
  m.cause = "worker 2 was killed by signal 9 (SIGKILL)";
  m.applied_request = 2;
  m.failures = 1;
  m.at_step = 41;
  m.timeline = true;
  m.decided_at = 1790000000.25;
  m.recovery = true;
  m.step = 40;
  m.cursor = 480;
  m.record = {{"steps_lost", 0}};
  const auto text = m.to_json().dump();
  EXPECT_EQ(Reconfiguration::from_json(nlohmann::json::parse(text), "r").to_json(), m.to_json());

  FailureReport r;
  r.process = 4;
  r.valid = true;
  r.generation = 2;
  r.plan = plan(2, 1);
  r.members = {1, 4};
  r.rank = 1;
  r.step = 40;
  r.cursor = 480;
  r.error = "all_reduce_sum on group 'dp.0' lost a peer";
  EXPECT_EQ(FailureReport::from_json(r.to_json(), "r").to_json(), r.to_json());
  const Progress p{2, 17, 3};
  EXPECT_EQ(Progress::from_json(p.to_json(), "p").to_json(), p.to_json());
}

TEST(Reconfiguration, KeysKeepJobsApartAndRecordsInOrder) {
  EXPECT_EQ(record_key("job", 3), "/tessel/job/decisions/records/00000003");
  EXPECT_EQ(record_generation("job", record_key("job", 12)), 12);
  EXPECT_EQ(record_generation("jo", record_key("job", 12)), -1);
  EXPECT_EQ(record_generation("job", records_prefix("job") + "0000001x"), -1);
  EXPECT_EQ(record_generation("job", progress_key("job")), -1);
  EXPECT_LT(record_key("job", 9), record_key("job", 10));  // list() order is generation order
  EXPECT_EQ(report_key("job", 2, 5), "/tessel/job/reports/failures/000002/5");
  EXPECT_EQ(report_key("job", 2, 5).rfind(reports_prefix("job", 2), 0), 0u);
  EXPECT_EQ(progress_key("job").rfind(job_prefix("job"), 0), 0u);
}

TEST(Reconfiguration, DamagedRecordsAreNamedErrors) {
  const auto e = error_of<CorruptDataError>([&] {
    Reconfiguration::from_json(nlohmann::json{{"generation", 1}}, "records/1");
  });
  EXPECT_NE(e.find("records/1 is not a valid switch description"), std::string::npos) << e;
  const auto f = error_of<CorruptDataError>(
      [&] { FailureReport::from_json(nlohmann::json::object(), "report"); });
  EXPECT_NE(f.find("report is not a valid failure report"), std::string::npos) << f;
  const auto g =
      error_of<CorruptDataError>([&] { Progress::from_json(nlohmann::json::array(), "progress"); });
  EXPECT_NE(g.find("progress is not a valid progress report"), std::string::npos) << g;
}

}  // namespace
}  // namespace tessel::elastic
