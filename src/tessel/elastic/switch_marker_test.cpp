// The files workers and the coordinator exchange: round trips, and damaged files named clearly.
#include "tessel/elastic/switch_marker.h"

#include <gtest/gtest.h>

#include <fstream>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::elastic {
namespace {

using tessel::testing::error_of;
using tessel::testing::TempDir;

layout::Plan plan(int dp, int pp) {
  layout::Plan p;
  p.dp = dp;
  p.pp = pp;
  return p;
}

TEST(SwitchMarker, RoundTripsThroughItsFile) {
  TempDir dir;
  SwitchMarker m;
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
  m.recovery = true;
  m.step = 40;
  m.cursor = 480;
  m.record = {{"steps_lost", 0}};
  const auto path = switch_marker_path(dir.path().string(), "job", 3);
  EXPECT_EQ(path, (dir / "job.switch-3.json").string());
  write_json_file(path, m.to_json());
  const auto back = SwitchMarker::from_json(read_json_file(path), path);
  EXPECT_EQ(back.to_json(), m.to_json());

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
  const auto rp = failure_report_path(dir.path().string(), "job", 1, 4);
  write_json_file(rp, r.to_json());
  EXPECT_EQ(FailureReport::from_json(read_json_file(rp), rp).to_json(), r.to_json());
}

TEST(SwitchMarker, DamagedFilesAreNamedErrors) {
  TempDir dir;
  const auto path = (dir / "job.switch-1.json").string();
  // Missing, not JSON, and JSON without the fields: each names the file.
  EXPECT_NE(error_of<IoError>([&] { read_json_file(path); }).find(path), std::string::npos);
  std::ofstream(path) << "{\"generation\": 1,";
  EXPECT_NE(error_of<CorruptDataError>([&] { read_json_file(path); }).find("not valid JSON"),
            std::string::npos);
  std::ofstream(path) << "{\"generation\": 1}";
  const auto e =
      error_of<CorruptDataError>([&] { SwitchMarker::from_json(read_json_file(path), path); });
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("not a valid switch description"), std::string::npos) << e;
  const auto f = error_of<CorruptDataError>(
      [&] { FailureReport::from_json(nlohmann::json::object(), "report.json"); });
  EXPECT_NE(f.find("report.json is not a valid failure report"), std::string::npos) << f;
}

}  // namespace
}  // namespace tessel::elastic
