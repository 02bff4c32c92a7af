// Runs the `tessel` executable the way a user does and checks exit codes and messages.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

using tessel::testing::run_command;
using tessel::testing::TempDir;
namespace fs = std::filesystem;

std::string bin() {
  return tessel::testing::tessel_binary().string();
}

struct Result {
  int status;
  std::string output;
};

Result tessel(const std::string& args) {
  Result r;
  r.status = run_command(bin() + " " + args, &r.output);
  return r;
}

TEST(Cli, PrepareThenTrainTinyModel) {
  TempDir dir;
  std::ofstream(dir / "a.txt") << std::string(3000, 'a') + "hello tessel, hello world. ";
  std::ofstream(dir / "b.txt") << "the quick brown fox jumps over the lazy dog. "
                               << std::string(2000, 'b');
  auto r = tessel("data prepare --input " + (dir / "a.txt").string() + " " +
                  (dir / "b.txt").string() + " --output " + (dir / "c.tok").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 documents"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("entropy"), std::string::npos) << r.output;
  std::ofstream(dir / "t.yaml") << "model: {preset: gpt2-tiny}\n"
                                << "data: {path: c.tok, seq_len: 16}\n"
                                << "training: {steps: 3, global_batch: 4, micro_batch: 2}\n"
                                << "output: {metrics: m.jsonl}\n";
  r = tessel("train " + (dir / "t.yaml").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("done: 3 steps"), std::string::npos) << r.output;
  std::ifstream metrics(dir / "m.jsonl");
  int lines = 0;
  for (std::string line; std::getline(metrics, line);)
    lines += line.find("\"loss\"") != std::string::npos;
  EXPECT_EQ(lines, 3);
}

// dir/t.yaml: two steps of gpt2-tiny on dir/c.tok (prepared here), with `extra` lines.
void write_two_step_run(const TempDir& dir, const std::string& extra = "") {
  std::ofstream(dir / "a.txt") << std::string(3000, 'a') + "hello tessel, hello world. ";
  ASSERT_EQ(tessel("data prepare --input " + (dir / "a.txt").string() + " --output " +
                   (dir / "c.tok").string())
                .status,
            0);
  std::ofstream(dir / "t.yaml") << "model: {preset: gpt2-tiny}\n"
                                << "data: {path: c.tok, seq_len: 16}\n"
                                << "training: {steps: 2, global_batch: 4, micro_batch: 2}\n"
                                << extra;
}

// The graph planner's runtime plan (`tessel plan --graph ... --out`) is what `tessel train
// --plan` trains with, in place of the config's parallel section; with it, a Perfetto trace of
// the simulated step. A file that is no runtime plan, or one for another batch, is one clear
// error.
TEST(Cli, TrainsWithTheGraphPlannersPlan) {
  TempDir dir;
  write_two_step_run(dir);
  const std::string plan = (dir / "plan.json").string(), trace = (dir / "trace.json").string();
  auto r = tessel(
      "plan --graph --model gpt2-tiny --seq 16 --tp 1 --dp 2 --stages 2 --micro-batch 2 "
      "--micro-batches 1 --balance 1 --out " +
      plan + " --trace " + trace);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("runtime layout: dp=2 tp=1 pp=2"), std::string::npos) << r.output;
  std::ifstream in(trace);
  const std::string events((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(events.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(events.find("\"F0.0\""), std::string::npos);

  r = tessel("train " + (dir / "t.yaml").string() + " --plan " + plan);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("on 4 workers (dp=2 tp=1 pp=2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done: 2 steps"), std::string::npos) << r.output;

  // The whole graph plan of a graph the runtime cannot run is not a runtime plan.
  ASSERT_EQ(
      tessel("plan --graph --model gpt2-tiny --seq 16 --tp 2 --micro-batch 2 --out " + plan).status,
      0);
  r = tessel("train " + (dir / "t.yaml").string() + " --plan " + plan);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("is not a runtime plan"), std::string::npos) << r.output;
  // A plan for another global batch.
  ASSERT_EQ(tessel("plan --graph --model gpt2-tiny --seq 16 --tp 1 --micro-batch 2 "
                   "--micro-batches 4 --out " +
                   plan)
                .status,
            0);
  r = tessel("train " + (dir / "t.yaml").string() + " --plan " + plan);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("training.global_batch 4"), std::string::npos) << r.output;
}

// Metrics that cannot be written (here to /dev/full, as to a full disk) do not stop training,
// but the run says its outputs are incomplete and does not end as a success; before, it printed
// "done" and exited 0 with nothing written.
TEST(Cli, AnIncompleteOutputIsNotASuccess) {
  TempDir dir;
  write_two_step_run(dir, "output: {metrics: /dev/full}\n");
  const auto r = tessel("train " + (dir / "t.yaml").string());
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("outputs are incomplete: /dev/full: No space left on device"),
            std::string::npos)
      << r.output;
}

// Standard output that cannot be written -- a full disk, /dev/full -- fails the command, as it
// would any Unix tool, and says why on stderr; for a training run the console's copy of the
// workers' lines is incomplete (their log files still hold them).
TEST(Cli, StandardOutputThatCannotBeWrittenIsAFailure) {
  TempDir dir;
  Result r;
  r.status = run_command("{ " + bin() + " presets 2>&3 >/dev/full; } 3>&1", &r.output);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("cannot write the standard output: No space left on device"),
            std::string::npos)
      << r.output;

  write_two_step_run(dir);
  r.status = run_command("{ TESSEL_CTL_DIR=" + (dir / "ctl").string() + " " + bin() + " train " +
                             (dir / "t.yaml").string() + " 2>&3 >/dev/full; } 3>&1",
                         &r.output);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("the console output is incomplete: No space left on device"),
            std::string::npos)
      << r.output;
}

TEST(Cli, ConfigErrorsExitTwoWithOneLine) {
  TempDir dir;
  std::ofstream(dir / "bad.yaml")
      << "model: {preset: gpt2-tiny}\ndata: {path: x.tok}\ntraining: {stepz: 1}\n";
  auto r = tessel("train " + (dir / "bad.yaml").string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("tessel: config error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("training.stepz"), std::string::npos) << r.output;
  std::ofstream(dir / "bad2.yaml") << "model: {preset: gpt2-tiny\n";
  r = tessel("train " + (dir / "bad2.yaml").string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("malformed YAML"), std::string::npos) << r.output;
}

TEST(Cli, MissingDataAndInputsAreIoErrors) {
  TempDir dir;
  std::ofstream(dir / "t.yaml") << "model: {preset: gpt2-tiny}\ndata: {path: nothere.tok}\n";
  auto r = tessel("train " + (dir / "t.yaml").string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("nothere.tok"), std::string::npos) << r.output;
  r = tessel("data prepare --input " + (dir / "missing.txt").string() + " --output " +
             (dir / "o.tok").string());
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("missing.txt"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "o.tok"));  // nothing that looks complete is left behind
}

TEST(Cli, LaunchRunsWorkersAndNamesTheOneThatDies) {
  TempDir dir;
  auto logs = (dir / "logs").string();
  auto r = tessel("launch -n 3 --log-dir " + logs + " -- /bin/sh -c 'echo hi $RANK/$WORLD_SIZE'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 2] hi 2/3"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(logs) / "rank1.log"));
  r = tessel("launch -n 2 --stop-timeout 1 --log-dir " + logs +
             " -- /bin/sh -c 'if [ $RANK = 1 ]; then kill -9 $$; else sleep 30; fi'");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("SIGKILL"), std::string::npos) << r.output;
}

TEST(Cli, UsageErrors) {
  EXPECT_NE(tessel("").status, 0);
  EXPECT_NE(tessel("frobnicate").status, 0);
  auto r = tessel("presets");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.output.find("gpt3-175b"), std::string::npos) << r.output;
}

// `data prepare` never writes over its own input, nor over a file without --force.
TEST(Cli, PrepareNeverDestroysItsInput) {
  TempDir dir;
  const auto text = (dir / "a.txt").string();
  std::ofstream(text) << "some text\n";
  auto r = tessel("data prepare --input " + text + " --output " + text + " --force");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("is the input"), std::string::npos) << r.output;
  std::ifstream in(text);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "some text\n");
  const auto tok = (dir / "a.tok").string();
  EXPECT_EQ(tessel("data prepare --input " + text + " --output " + tok).status, 0);
  r = tessel("data prepare --input " + text + " --output " + tok);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("add --force"), std::string::npos) << r.output;
  EXPECT_EQ(tessel("data prepare --input " + text + " --output " + tok + " --force").status, 0);
}

// Counts out of range or not whole are errors naming the flag: before, `--steps -5` and
// `--steps 0` were ignored and `plan --gpus 2147483647` planned for a negative device count.
TEST(Cli, CountFlagsAreReadStrictly) {
  for (const char* args :
       {"train none.yaml --steps -5", "train none.yaml --steps 0", "train none.yaml --steps 2.5",
        "train none.yaml --nproc 0", "launch -n 0 -- true", "launch -n 2abc -- true",
        "plan --model gpt2-124m --global-batch 8 --gpus 0",
        "plan --model gpt2-124m --global-batch 8 --gpus 2147483647",
        "plan --model gpt2-124m --global-batch 0",
        "plan --model gpt2-124m --global-batch 8 --seq 0",
        "plan --model gpt2-124m --global-batch 8 --seq -3"}) {
    const auto r = tessel(args);
    EXPECT_NE(r.status, 0) << args << "\n" << r.output;
    const std::string flag = std::string(args).find("--steps") != std::string::npos  ? "--steps"
                             : std::string(args).find("--gpus") != std::string::npos ? "--gpus"
                             : std::string(args).find("--seq") != std::string::npos  ? "--seq"
                             : std::string(args).find("--global-batch") != std::string::npos
                                 ? "--global-batch"
                                 : "nproc";
    EXPECT_NE(r.output.find(flag), std::string::npos) << args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace tessel::cli
