#include "tessel/cli/run_report.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

using tessel::testing::error_of;

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + needle.size()))
    ++n;
  return n;
}

bool has(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// 20 steps of 1,024 tokens (rate x step time) on 4 workers, then 2 from step 9, then 3 from
// step 15; evaluation at steps 10 and 20.
std::vector<StepRecord> twenty_steps() {
  std::vector<StepRecord> steps;
  for (int64_t s = 1; s <= 20; ++s) {
    StepRecord r;
    r.step = s;
    r.loss = 5.0 - 0.2 * double(s);
    r.step_s = 0.05;
    r.tokens_per_s = 1024 / 0.05;
    r.time = 1000.0 + 0.05 * double(s);
    r.workers = s <= 8 ? 4 : s <= 14 ? 2 : 3;
    if (s % 10 == 0) r.eval_loss = 5.1 - 0.2 * double(s);
    steps.push_back(r);
  }
  return steps;
}

RunEvent reconfigure_at_8() {
  RunEvent e;
  e.step = 8;
  e.kind = "reconfigure";
  e.cause = "timeline (workers)";
  e.old_workers = 4;
  e.new_workers = 2;
  e.old_plan = "dp=4 tp=1 pp=1 v=1 mb=8x1 1f1b zero0";
  e.new_plan = "dp=2 tp=1 pp=1 v=1 mb=16x1 1f1b zero0";
  e.total_pause_s = 0.28623882;
  e.detection_s = 0;
  e.bytes_moved = 30034944;
  e.steps_lost = 0;
  e.restored_from = "survivors";
  return e;
}

RunEvent failure_at_14() {
  RunEvent e;
  e.step = 14;
  e.kind = "recover";
  e.cause = "worker 5 was killed by signal 9 (SIGKILL)";
  e.old_workers = 2;
  e.new_workers = 3;
  e.old_plan = "dp=2 tp=1 pp=1 v=1 mb=16x1 1f1b zero0";
  e.new_plan = "dp=1 tp=1 pp=3 v=1 mb=1x32 1f1b zero0 units=3,2,1";
  e.total_pause_s = 0.170906543;
  e.detection_s = 0.040719912;
  e.bytes_moved = 592896;
  e.steps_lost = 1;
  e.restored_from = "survivors";
  return e;
}

RunRecords demo_run() {
  RunRecords run;
  run.title = "tessel run: runs/demo";
  run.metrics_source = "runs/demo/metrics.jsonl";
  run.events_source = "runs/demo/events.jsonl";
  run.steps = twenty_steps();
  run.events = {reconfigure_at_8(), failure_at_14()};
  return run;
}

TEST(RunReport, OneSvgPerChart) {
  const std::string html = render_run_report(demo_run());
  // Loss, tokens/s, workers, pause bars, bytes bars.
  EXPECT_EQ(count(html, "<svg"), 5u);
  EXPECT_EQ(count(html, "</svg>"), 5u);
  EXPECT_TRUE(has(html, "aria-label=\"training loss by step\""));
  EXPECT_TRUE(has(html, "aria-label=\"pause per event in seconds\""));
  // The eval points, each with its value on hover.
  EXPECT_EQ(count(html, "<circle"), 2u);
  EXPECT_TRUE(has(html, "<title>step 10: eval loss 3.1000</title>"));
  // Axes: the step ticks (0..20 every 2) and the axis titles.
  EXPECT_TRUE(has(html, ">20</text>"));
  EXPECT_TRUE(has(html, ">loss (nats/token)</text>"));

  RunRecords quiet = demo_run();
  quiet.events.clear();
  quiet.events_source.clear();
  const std::string plain = render_run_report(quiet);
  EXPECT_EQ(count(plain, "<svg"), 3u);  // no events: no bar charts
  EXPECT_TRUE(has(plain, "No events"));
  EXPECT_FALSE(has(plain, "class=\"marker"));
}

TEST(RunReport, EveryStepChartMarksEveryEvent) {
  const std::string html = render_run_report(demo_run());
  // One marker per event on each of the three step charts.
  EXPECT_EQ(count(html, "<g class=\"marker reconfigure\">"), 3u);
  EXPECT_EQ(count(html, "<g class=\"marker failure\">"), 3u);
  EXPECT_TRUE(has(html,
                  "<title>#1 at step 8: reconfigure (timeline (workers)); workers 4 -&gt; 2; plan "
                  "dp=2 tp=1 pp=1 v=1 mb=16x1 1f1b zero0; pause 0.286 s; 30.0 MB moved</title>"))
      << html;
  EXPECT_TRUE(has(html, "#2 at step 14: recover (worker 5 was killed by signal 9 (SIGKILL))"));
  EXPECT_TRUE(has(html, "; steps lost: 1</title>"));
  // The table: one row per event, the failure's marked.
  EXPECT_EQ(count(html, "<tr class=\"reconfigure\">"), 1u);
  EXPECT_EQ(count(html, "<tr class=\"failure\">"), 1u);
}

TEST(RunReport, PlansLabelTheirSegments) {
  const std::string html = render_run_report(demo_run());
  // Steps 1-8 ran the first event's old plan, 9-14 its new one, 15-20 the failure's.
  EXPECT_TRUE(has(html, "<title>steps 1-8: 4 workers, dp=4 tp=1 pp=1 v=1 mb=8x1 1f1b zero0"));
  EXPECT_TRUE(has(html, "<title>steps 9-14: 2 workers, dp=2 tp=1 pp=1 v=1 mb=16x1 1f1b zero0"));
  EXPECT_TRUE(has(html, "<title>steps 15-20: 3 workers, dp=1 tp=1 pp=3"));
  EXPECT_TRUE(has(html, "<td class=\"num\">9&#8211;14</td><td class=\"num\">2</td>"));
}

TEST(RunReport, EscapesEveryTextFromTheFiles) {
  RunRecords run = demo_run();
  run.title = "run <b>&</b>";
  run.events[0].new_plan = "dp=2 <script>alert('x')</script>";
  run.events[1].cause = "worker \"7\" <died>";
  const std::string html = render_run_report(run);
  EXPECT_FALSE(has(html, "<script"));
  EXPECT_FALSE(has(html, "<died>"));
  EXPECT_FALSE(has(html, "<b>"));
  EXPECT_TRUE(has(html, "dp=2 &lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"));
  EXPECT_TRUE(has(html, "worker &quot;7&quot; &lt;died&gt;"));
  EXPECT_TRUE(has(html, "<h1>run &lt;b&gt;&amp;&lt;/b&gt;</h1>"));
  EXPECT_EQ(html_escape("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&#39;");
}

TEST(RunReport, FormatsTheNumbers) {
  const std::string html = render_run_report(demo_run());
  EXPECT_TRUE(has(html, "<dd>20,480 <small>(1,024 a step)</small></dd>")) << html;
  EXPECT_TRUE(has(html, "<dd>1.0000 <small>at step 20</small></dd>"));  // 5 - 0.2 * 20
  EXPECT_TRUE(has(html, "<dd>1.1000 <small>at step 20</small></dd>"));  // eval: 5.1 - 4
  // Steps 1..20 of 0.05 s each: from 1000.05 - 0.05 to 1001.
  EXPECT_TRUE(has(html, "<dd>1.0 s</dd>"));
  EXPECT_TRUE(has(html, "<dd>20.5k</dd>"));  // 1024 / 0.05 tokens/s
  EXPECT_TRUE(has(html, "<dd>2&#8211;4</dd>"));
  EXPECT_TRUE(has(html, "<dd>1 reconfiguration, 1 failure</dd>"));
  EXPECT_TRUE(has(html, "<dd>0.457 s</dd>"));  // 0.28623882 + 0.170906543
  // The events table: pause, bytes, steps lost and detection of the failure.
  EXPECT_TRUE(has(html,
                  "<td class=\"num\">0.171</td><td class=\"num\">593 kB</td>"
                  "<td class=\"num\">1</td><td class=\"num\">0.041</td>"))
      << html;
  // The bytes chart's axis is in the unit of its largest bar.
  EXPECT_TRUE(has(html, ">moved (MB)</text>"));
  // Tokens/s ticks in thousands.
  EXPECT_TRUE(has(html, ">20k</text>"));
}

TEST(RunReport, TheLastLineOfAStepCounts) {
  RunRecords run = demo_run();
  StepRecord again = run.steps.back();  // step 20 again (a resumed run appending, say)
  again.loss = 0.5;
  run.steps.push_back(again);
  const std::string html = render_run_report(run);
  EXPECT_TRUE(has(html, "1 metrics line for steps already recorded"));
  EXPECT_TRUE(has(html, "<dd>20 (1&#8211;20)</dd>"));
  EXPECT_TRUE(has(html, "<dd>0.5000 <small>at step 20</small></dd>"));
}

TEST(RunReport, ALongRunStaysSmall) {
  RunRecords run = demo_run();
  run.steps.clear();
  for (int64_t s = 1; s <= 200000; ++s) {
    StepRecord r;
    r.step = s;
    r.loss = 3 + std::sin(double(s));
    r.tokens_per_s = 1000 + double(s % 7);
    r.workers = 4;
    run.steps.push_back(r);
  }
  run.events[0].step = 100000;
  run.events[1].step = 150000;
  const std::string html = render_run_report(run);
  // Per pixel column at most 4 points of about 12 bytes, for two series over ~1000 columns.
  EXPECT_LT(html.size(), 200'000u);
  EXPECT_EQ(count(html, "<g class=\"marker failure\">"), 3u);
  EXPECT_TRUE(has(html, ">200k</text>"));  // the last step tick
}

TEST(RunReport, ParsesTheFilesARunWrites) {
  const std::string metrics =
      "{\"cursor\":32,\"elapsed_s\":0.12,\"grad_norm\":5.6,\"loss\":5.54,\"lr\":0.0001,"
      "\"step\":1,\"step_s\":0.11,\"time\":1795715787.5,\"tokens_per_s\":17604.5,\"workers\":4}\n"
      "\n"
      "{\"step\":2,\"loss\":5.3,\"eval_loss\":5.4,\"tokens_per_s\":null}\r\n";
  const auto steps = parse_metrics_lines(metrics, "m.jsonl");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].workers, 4);
  EXPECT_EQ(steps[0].tokens_per_s, 17604.5);
  EXPECT_EQ(steps[1].eval_loss, 5.4);
  EXPECT_FALSE(steps[1].tokens_per_s.has_value());  // null: a rate JSON cannot hold
  const std::string events =
      "{\"event\":\"recover\",\"step\":351,\"cause\":\"worker 5 was killed\",\"old_workers\":4,"
      "\"new_workers\":3,\"new_plan\":\"dp=3\",\"total_pause_s\":0.17,\"bytes_moved\":0,"
      "\"steps_lost\":0,\"detection_s\":0.04,\"restored_from\":\"survivors\"}\n";
  const auto parsed = parse_event_lines(events, "e.jsonl");
  ASSERT_EQ(parsed.size(), 1u);
  EXPECT_TRUE(parsed[0].is_failure());
  EXPECT_EQ(parsed[0].new_workers, 3);
  EXPECT_EQ(parsed[0].detection_s, 0.04);
  EXPECT_TRUE(parse_event_lines("", "e.jsonl").empty());
}

TEST(RunReport, BadLinesAreNamedByFileAndLine) {
  auto metrics_error = [](const std::string& text) {
    return error_of<CorruptDataError>([&] { parse_metrics_lines(text, "runs/x/metrics.jsonl"); });
  };
  const std::string good = "{\"step\":1,\"loss\":2}\n";
  EXPECT_TRUE(has(metrics_error(good + good + "{\"step\":3,\"loss\":\n"),
                  "runs/x/metrics.jsonl:3: not a JSON line"));
  EXPECT_TRUE(has(metrics_error(good + "{\"step\":2,\"lo"), "without its newline"));
  EXPECT_TRUE(has(metrics_error(good + "[1,2]\n"), "runs/x/metrics.jsonl:2: a JSON array"));
  EXPECT_TRUE(has(metrics_error(good + "{\"step\":2}\n"),
                  "runs/x/metrics.jsonl:2: the record has no \"loss\""));
  EXPECT_TRUE(has(metrics_error("{\"loss\":2}\n"),
                  "runs/x/metrics.jsonl:1: the record has no "
                  "\"step\""));
  EXPECT_TRUE(has(metrics_error(""), "runs/x/metrics.jsonl holds no step records (it is empty)"));
  EXPECT_TRUE(has(metrics_error("\n\n"), "holds no step records"));
  EXPECT_TRUE(has(error_of<CorruptDataError>(
                      [] { parse_event_lines("{\"step\":1}\n{\"step\":-3}\n", "e.jsonl"); }),
                  "e.jsonl:2: the record has no \"step\""));
  EXPECT_TRUE(has(error_of<InvalidArgumentError>([] { render_run_report(RunRecords{}); }),
                  "no step records"));
}

}  // namespace
}  // namespace tessel::cli
