#include "tessel/planner/trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>

#include "tessel/core/error.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/zero_bubble.h"
#include "tessel/testing/testing.h"

namespace tessel::planner {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

std::vector<json> events_with_phase(const json& doc, const std::string& ph) {
  std::vector<json> out;
  for (const json& e : doc.at("traceEvents"))
    if (e.at("ph") == ph) out.push_back(e);
  return out;
}

TEST(Trace, GenericEventsAndNames) {
  Trace t;
  t.process_names[3] = "rank 3";
  t.track_names[{3, 1}] = "comm";
  t.events.push_back({"allreduce", "comm", 3, 1, 10.5, 2.25, {{"bytes", 4096}}});
  t.other_data = {{"note", "hi"}};
  json doc = to_json(t);
  EXPECT_EQ(doc.at("displayTimeUnit"), "ms");
  EXPECT_EQ(doc.at("otherData").at("note"), "hi");
  std::vector<json> x = events_with_phase(doc, "X");
  ASSERT_EQ(x.size(), 1u);
  EXPECT_EQ(x[0], (json{{"name", "allreduce"},
                        {"cat", "comm"},
                        {"ph", "X"},
                        {"ts", 10.5},
                        {"dur", 2.25},
                        {"pid", 3},
                        {"tid", 1},
                        {"args", {{"bytes", 4096}}}}));
  std::vector<json> m = events_with_phase(doc, "M");
  auto has = [&](const json& want) { return std::find(m.begin(), m.end(), want) != m.end(); };
  EXPECT_TRUE(
      has(json{{"name", "process_name"}, {"ph", "M"}, {"pid", 3}, {"args", {{"name", "rank 3"}}}}));
  EXPECT_TRUE(has(json{
      {"name", "thread_name"}, {"ph", "M"}, {"pid", 3}, {"tid", 1}, {"args", {{"name", "comm"}}}}));
  // No otherData key when there is nothing to say.
  EXPECT_FALSE(to_json(Trace{}).contains("otherData"));
}

// Acceptance: the trace of a simulated schedule parses as JSON and has one complete event per
// executed compute instruction (plus one optimizer step per stage), on one track per stage.
TEST(Trace, SimulationHasOneCompleteEventPerCompute) {
  const int p = 4, m = 6;
  for (const schedule::Schedule& s : {schedule::one_f_one_b(p, m), schedule::zb_h1(p, m),
                                      schedule::interleaved_one_f_one_b(p, 8, 2)}) {
    SCOPED_TRACE(s.name);
    SimConfig c = uniform_config(
        p, s.chunks,
        {.forward = 1e-3, .backward = 2e-3, .backward_input = 1e-3, .backward_weight = 1e-3});
    c.jitter = 0.1;
    SimResult r = simulate(s, c);
    testing::TempDir dir;
    write_trace(simulation_trace(r), dir / "trace.json");
    std::ifstream in(dir / "trace.json");
    json doc = json::parse(in);  // throws on malformed JSON

    // Expected: every compute instruction of every stage, by (track, name).
    std::multiset<std::pair<int, std::string>> want, got;
    for (int stage = 0; stage < p; ++stage) {
      for (const schedule::Instruction& ins : s.per_stage[size_t(stage)])
        if (schedule::is_compute(ins.op)) want.insert({stage, schedule::to_string(ins)});
      want.insert({stage, "step"});
    }
    std::vector<json> x = events_with_phase(doc, "X");
    for (const json& e : x) {
      got.insert({e.at("tid").get<int>(), e.at("name").get<std::string>()});
      EXPECT_EQ(e.at("pid"), 0);
    }
    EXPECT_EQ(got, want);

    // Times are the timeline's, in microseconds.
    size_t k = 0;
    for (int stage = 0; stage < p; ++stage)
      for (const TimelineEntry& t : r.timeline[size_t(stage)]) {
        const json& e = x.at(k++);
        EXPECT_EQ(e.at("tid"), stage);
        EXPECT_NEAR(e.at("ts").get<double>(), t.start * 1e6, 1e-6);
        EXPECT_NEAR(e.at("dur").get<double>(), (t.end - t.start) * 1e6, 1e-6);
        if (t.op != schedule::Op::optimizer_step) {
          EXPECT_EQ(e.at("args").at("micro_batch"), t.micro_batch);
          EXPECT_EQ(e.at("args").at("chunk"), t.chunk);
          EXPECT_EQ(e.at("cat"), std::string(schedule::op_code(t.op)));
        }
      }

    // One named track per stage.
    std::set<int> tracks;
    for (const json& e : events_with_phase(doc, "M"))
      if (e.at("name") == "thread_name") {
        tracks.insert(e.at("tid").get<int>());
        EXPECT_EQ(e.at("args").at("name"), "stage " + std::to_string(e.at("tid").get<int>()));
      }
    EXPECT_EQ(tracks, (std::set<int>{0, 1, 2, 3}));
    EXPECT_NEAR(doc.at("otherData").at("bubble_fraction").get<double>(), r.bubble_fraction(),
                1e-12);
  }
}

TEST(Trace, WriteToMissingDirectoryIsIoError) {
  testing::TempDir dir;
  try {
    write_trace(Trace{}, dir / "no-such-dir" / "t.json");
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("no-such-dir/t.json"));
  }
}

}  // namespace
}  // namespace tessel::planner
