// `tessel train` killed (SIGKILL: the OOM killer, a crash, kill -9) while its job trains with the
// embedded control store, which died with it:
//  * the workers save the state at their next step boundary -- a step no checkpoint.every would
//    have saved -- and leave; the same command resumes there and ends where an uninterrupted run
//    ends, every step equal to one single-process step;
//  * without checkpoint.dir they leave and say that nothing was saved;
//  * a process started for a switch leaves too, holding nothing; so does every process when the
//    launcher dies in the middle of a switch;
//  * a worker that cannot save -- a peer died with the launcher, or one stopped answering so that
//    the others block in a collective -- still ends: the watchdog ends it elastic.stop_grace_s
//    after the launcher's death.
// In every case no process of the job is left once that grace (and a margin) has passed: they are
// found by the launcher's pid in their environment (TESSEL_LAUNCHER_PID), since once orphaned they
// are nobody's children the test could list.
#include <gtest/gtest.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include "tessel/elastic/failure_test_util.h"

namespace tessel::elastic {
namespace {

using namespace tessel::elastic::testing;
using tessel::testing::TempDir;

constexpr int kGraceS = 6;  // elastic.stop_grace_s of these jobs

// Bash helpers for train_with_killer's script ($L: the launcher's pid):
//   job                       the pids of the job's processes (its workers, wherever they are);
//   wait_lines N              until N steps are logged (bounded);
//   kill_launcher_and_wait [PID...]  SIGKILL to the launcher (and to the PIDs, in the same
//                             instant), then waits (bounded: the grace and a margin) for every
//                             process of the job to end; prints "no orphans", or "orphans: PIDS"
//                             and kills them.
std::string helpers() {
  return fmt::format(
      "job() {{ grep -lzx \"TESSEL_LAUNCHER_PID=$L\" /proc/[0-9]*/environ 2>/dev/null | cut -d/ "
      "-f3; }}\n"
      "wait_lines() {{ for i in $(seq 3000); do [ $(lines) -ge $1 ] && break; kill -0 $L || "
      "break; sleep 0.01; done; }}\n"
      "kill_launcher_and_wait() {{\n"
      "  echo workers $(job)\n"
      "  kill -9 $L $@ && echo killed the launcher after $(lines) steps\n"
      "  for i in $(seq {}); do [ -z \"$(job)\" ] && break; sleep 0.1; done\n"
      "  left=$(job)\n"
      "  if [ -n \"$left\" ]; then echo orphans: $left; kill -9 $left; else echo no orphans; fi\n"
      "}}\n",
      (kGraceS + 10) * 10);
}

// `elastic` and `more`: further keys of the elastic section, further sections.
std::string job_config(int64_t steps, int workers, const std::string& more,
                       const std::string& elastic = "") {
  return Job{steps}.training() +
         fmt::format("parallel: {{dp: {}}}\nelastic: {{stop_grace_s: {}{}}}\n", workers, kGraceS,
                     elastic) +
         more;
}

// Runs the job with `killer` after the helpers; asserts that the launcher was killed and that no
// process of the job outlived it. Returns the launcher's console (train.out); the script's output
// in *script_out.
std::string kill_the_launcher(const TempDir& dir, const std::string& cfg, const std::string& killer,
                              std::string* script_out = nullptr) {
  std::string out;
  const int rc = train_with_killer(dir, cfg, helpers() + killer, &out);
  const std::string log = read_text(dir / "train.out");
  EXPECT_EQ(rc, 0) << out << log;
  EXPECT_NE(out.find("killed the launcher"), std::string::npos) << out << log;
  EXPECT_NE(out.find("no orphans"), std::string::npos) << out << log;
  EXPECT_NE(out.find("train exit 137"), std::string::npos) << out << log;
  if (script_out != nullptr) *script_out = out;
  return log;
}

// The launcher killed once 11 steps are logged, with a checkpoint every 10: the workers save the
// step they reach (after 10, the newest periodic one) and leave; the checkpoint is intact and the
// same command resumes from it. The uninterrupted run, saved after every step, matches one
// single-process step at every step, and the interrupted run and its resumption log exactly its
// losses -- the state is saved bit for bit and the same plan computes the same steps -- so every
// step of the whole history does.
void kill_save_and_resume(int workers) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const int64_t steps = 30;
  const auto whole = config::testing::write_config(
      dir, corpus,
      job_config(steps, workers,
                 runtime::testing::every_step_checkpoints(steps, "ck_whole") +
                     "output: {metrics: whole.jsonl}\n"),
      "whole.yaml");
  std::string out;
  ASSERT_EQ(train_with_killer(dir, whole, "", &out), 0) << out;
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << read_text(dir / "train.out");
  const auto uninterrupted = runtime::testing::read_step_losses(dir / "whole.jsonl");
  const auto checked = runtime::testing::expect_steps_match_one_process(
      config::testing::write_config(dir, corpus, Job{steps}.training(), "single.yaml"),
      dir / "ck_whole", uninterrupted, 1, steps);
  EXPECT_EQ(checked.steps, steps);
  EXPECT_EQ(checked.unlogged, 0);

  const auto cfg = config::testing::write_config(
      dir, corpus,
      job_config(steps, workers,
                 "checkpoint: {dir: ck, every: 10}\noutput: {metrics: metrics.jsonl}\n"));
  std::string log = kill_the_launcher(dir, cfg, "wait_lines 11\nkill_launcher_and_wait\n");
  // "the coordinator (tessel train, pid N) is gone: saved step S to PATH; run the same command
  // to resume" (parsed by hand: GCC 12 warns inside <regex> under the sanitizers).
  const std::string said = " is gone: saved step ";
  const auto gone = log.find("the coordinator (tessel train, pid ");
  ASSERT_NE(gone, std::string::npos) << log;
  const auto step_at = log.find(said, gone);
  ASSERT_NE(step_at, std::string::npos) << log;
  const auto to_at = log.find(" to ", step_at + said.size());
  const auto end_at = log.find("; run the same command to resume", to_at);
  ASSERT_TRUE(to_at != std::string::npos && end_at != std::string::npos) << log;
  const std::string saved_step = log.substr(step_at + said.size(), to_at - step_at - said.size());
  const std::string saved_path = log.substr(to_at + 4, end_at - to_at - 4);
  const int64_t stopped_at = std::stoll(saved_step);
  EXPECT_GT(stopped_at, 10) << log;  // later than the newest periodic checkpoint at the kill
  EXPECT_LT(stopped_at, steps) << log;
  const std::string at = (dir / "ck" / checkpoint::checkpoint_step_name(stopped_at)).string();
  EXPECT_EQ(saved_path, at);
  // Intact: every piece's checksum verifies (a damaged one would be set aside and not named).
  EXPECT_EQ(checkpoint::newest_intact_checkpoint((dir / "ck").string()), at) << log;
  EXPECT_EQ(store::CheckpointReader(at).meta().at("step").get<int64_t>(), stopped_at);

  // The same command resumes at the saved step and finishes.
  ASSERT_EQ(train_with_killer(dir, cfg, "", &out), 0) << out;
  log = read_text(dir / "train.out");
  ASSERT_NE(out.find("train exit 0"), std::string::npos) << out << log;
  EXPECT_NE(log.find(fmt::format("at step {}", stopped_at)), std::string::npos) << log;
  const auto logged = runtime::testing::read_step_losses(dir / "metrics.jsonl");
  ASSERT_EQ(logged.size(), uninterrupted.size()) << log;
  for (const auto& [step, loss] : uninterrupted) {
    ASSERT_TRUE(logged.contains(step)) << step;
    EXPECT_EQ(logged.at(step), loss) << "step " << step;
  }
  EXPECT_EQ(checkpoint::latest_sharded_checkpoint((dir / "ck").string()),
            (dir / "ck" / checkpoint::checkpoint_step_name(steps)).string());
}

TEST(CoordinatorLoss, TwoWorkersSaveWhenTheLauncherIsKilledAndTheSameCommandResumes) {
  kill_save_and_resume(2);
}
TEST(CoordinatorLoss, ThreeWorkersSaveWhenTheLauncherIsKilledAndTheSameCommandResumes) {
  kill_save_and_resume(3);
}

TEST(CoordinatorLoss, WithoutACheckpointDirTheWorkersSayNothingWasSaved) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus, job_config(200, 2, "output: {metrics: metrics.jsonl}\n"));
  const std::string log = kill_the_launcher(dir, cfg, "wait_lines 5\nkill_launcher_and_wait\n");
  EXPECT_NE(log.find("is gone: nothing saved after step"), std::string::npos) << log;
  EXPECT_NE(log.find("there is no checkpoint.dir"), std::string::npos) << log;
  EXPECT_EQ(log.find("saved step"), std::string::npos) << log;
}

// A scale-up prepared over many steps: its new process is started and waits for the go when the
// launcher dies. It holds nothing and leaves; the world in force saves and leaves.
TEST(CoordinatorLoss, AProcessWaitingToJoinASwitchLeavesAndTheWorldSaves) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job_config(200, 2,
                 "checkpoint: {dir: ck, every: 1000}\noutput: {metrics: metrics.jsonl}\n"
                 "timeline:\n  - {at_step: 160, workers: 3}\n",
                 ", prepare_steps: 150"));
  // The joiner exists from the announcement (step 9) on; the launcher is killed once the joiner
  // says it waits. Earlier it may still be loading, before its watch on the launcher exists, and
  // the launcher's death signal ends it silently (parent_watch.h) -- as the CI once saw.
  const std::string log = kill_the_launcher(
      dir, cfg,
      "for i in $(seq 3000); do grep -q 'waiting for the world to switch' train.out && break; "
      "kill -0 $L || break; sleep 0.01; done\n"
      "kill_launcher_and_wait\n");
  EXPECT_NE(log.find("this process was started for began: it holds no state; leaving"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("is gone: saved step"), std::string::npos) << log;
}

// A switch that needs its new process at once (nothing prepared): the launcher dies as soon as
// that process exists, so around the switch -- its rendezvous or transfer, or just before or
// after. Whatever each process was doing, none is left.
TEST(CoordinatorLoss, NoProcessIsLeftWhenTheLauncherDiesDuringASwitch) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job_config(200, 2,
                 "checkpoint: {dir: ck, every: 1000}\noutput: {metrics: metrics.jsonl}\n"
                 "timeline:\n  - {at_step: 10, workers: 3}\n",
                 ", prepare_steps: 0"));
  kill_the_launcher(dir, cfg,
                    "for i in $(seq 3000); do [ $(job | wc -l) -ge 3 ] && break; sleep 0.01; done\n"
                    "kill_launcher_and_wait\n");
}

// While it lives, this process adopts the orphans of the processes it started (a child
// subreaper) and reaps them at the end. A worker orphaned by its launcher's death then still has
// a parent in its session: its process group is not orphaned, so the kernel does not continue a
// stopped member with SIGHUP and SIGCONT (POSIX job control) -- it stays stopped.
class AdoptOrphans {
 public:
  AdoptOrphans() { ::prctl(PR_SET_CHILD_SUBREAPER, 1); }
  ~AdoptOrphans() {
    ::prctl(PR_SET_CHILD_SUBREAPER, 0);
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
  }
  AdoptOrphans(const AdoptOrphans&) = delete;
  AdoptOrphans& operator=(const AdoptOrphans&) = delete;
};

// One worker stopped (SIGSTOP), then the launcher killed: the other two block in the step's
// collective with it (parallel.timeout_s is far longer than the grace) and their watchdog ends
// them elastic.stop_grace_s later. The stopped one, continued, finds its launcher and its peers
// gone and leaves too.
TEST(CoordinatorLoss, WorkersBlockedOnAStoppedPeerAreEndedByTheWatchdog) {
  AdoptOrphans adopt;
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      Job{400}.training() +
          fmt::format("parallel: {{dp: 3, timeout_s: 120}}\nelastic: {{stop_grace_s: {}, "
                      "heartbeat_timeout_s: 600}}\noutput: {{metrics: metrics.jsonl}}\n",
                      kGraceS));
  std::string out;
  const std::string log =
      kill_the_launcher(dir, cfg,
                        "wait_lines 5\n"
                        "stopped=$(pgrep -P $L | head -1)\n"
                        "kill -STOP $stopped && echo stopped $stopped\n"
                        "sleep 0.2\n"
                        "kill -9 $L && echo killed the launcher\n"
                        // Everyone but the stopped process ends by the watchdog.
                        "for i in $(seq " +
                            std::to_string((kGraceS + 10) * 10) +
                            "); do [ \"$(job)\" = \"$stopped\" ] && break; sleep 0.1; done\n"
                            "[ \"$(job)\" = \"$stopped\" ] && echo only the stopped one was left\n"
                            "kill -CONT $stopped\n"
                            "kill_launcher_and_wait\n",
                        &out);
  EXPECT_NE(out.find("only the stopped one was left"), std::string::npos) << out << log;
  EXPECT_NE(log.find("did not save and leave within elastic.stop_grace_s"), std::string::npos)
      << log;
  EXPECT_NE(log.find("is gone and"), std::string::npos) << log;  // the stopped one, continued
}

// The launcher and one worker killed together: the survivors' collectives fail at once, nobody
// can save a consistent state, and they leave saying so, naming what a restart resumes from.
TEST(CoordinatorLoss, WorkersWhosePeerDiedWithTheLauncherLeaveWithoutSaving) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      job_config(400, 3, "checkpoint: {dir: ck, every: 3}\noutput: {metrics: metrics.jsonl}\n"));
  const std::string log = kill_the_launcher(dir, cfg,
                                            "wait_lines 5\n"
                                            "kill_launcher_and_wait $(pgrep -P $L | head -1)\n");
  EXPECT_NE(log.find("is not saved; run the same command to resume from"), std::string::npos)
      << log;
  EXPECT_EQ(log.find("saved step"), std::string::npos) << log;
}

}  // namespace
}  // namespace tessel::elastic
