#include "tessel/runtime/checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::runtime {
namespace {

using tessel::testing::TempDir;
namespace fs = std::filesystem;

std::string save(const std::string& dir, int64_t step, std::vector<float>& a, std::vector<float>& b,
                 int keep = 2) {
  return save_checkpoint(dir, step, {{"note", "x"}},
                         {{"a", a.data(), int64_t(a.size())}, {"b", b.data(), int64_t(b.size())}},
                         keep);
}

TEST(Checkpoint, RoundTripAndLatest) {
  TempDir dir;
  std::vector<float> a = {1, 2, 3}, b = {4, 5};
  EXPECT_FALSE(latest_checkpoint(dir.path().string()));
  save(dir.path().string(), 5, a, b);
  a = {7, 8, 9};
  auto path = save(dir.path().string(), 10, a, b);
  EXPECT_EQ(*latest_checkpoint(dir.path().string()), path);
  std::vector<float> ra(3), rb(2);
  auto meta = load_checkpoint(path, {{"a", ra.data(), 3}, {"b", rb.data(), 2}});
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
  EXPECT_EQ(meta["step"], 10);
  EXPECT_EQ(meta["note"], "x");
}

TEST(Checkpoint, KeepsOnlyTheNewest) {
  TempDir dir;
  std::vector<float> a = {1}, b = {2};
  for (int s = 1; s <= 4; ++s) save(dir.path().string(), s, a, b, 2);
  int n = 0;
  for (auto& e : fs::directory_iterator(dir.path())) n += e.path().extension() == ".ckpt";
  EXPECT_EQ(n, 2);
}

TEST(Checkpoint, FlippedByteAndTruncationAreDetected) {
  TempDir dir;
  std::vector<float> a(100, 1.5f), b(10, 2.5f);
  auto path = save(dir.path().string(), 1, a, b);
  std::vector<float> ra(100), rb(10);
  std::vector<CheckpointSection> want = {{"a", ra.data(), 100}, {"b", rb.data(), 10}};
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-50, std::ios::end);
    f.put('\x7f');
  }
  EXPECT_THROW(load_checkpoint(path, want), CorruptDataError);
  fs::resize_file(path, fs::file_size(path) - 13);
  try {
    load_checkpoint(path, want);
    FAIL() << "truncated checkpoint loaded";
  } catch (const CorruptDataError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, MismatchedSectionsAreNamed) {
  TempDir dir;
  std::vector<float> a(4), b(2);
  auto path = save(dir.path().string(), 1, a, b);
  std::vector<float> big(5);
  try {
    load_checkpoint(path, {{"a", big.data(), 5}});
    FAIL();
  } catch (const CorruptDataError& e) {
    EXPECT_NE(std::string(e.what()).find("'a'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_checkpoint(path, {{"missing", big.data(), 5}}), CorruptDataError);
}

TEST(Checkpoint, CrashDuringSaveLeavesThePreviousCheckpointIntact) {
  TempDir dir;
  std::vector<float> a = {1, 2}, b = {3};
  auto good = save(dir.path().string(), 1, a, b);
  // A child process starts writing a large checkpoint into the same directory and is killed
  // with SIGKILL as soon as its temporary file appears.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<float> big(size_t(1) << 28, 1.0f);  // 1 GiB: takes long enough to be caught
    save_checkpoint(dir.path().string(), 2, {}, {{"a", big.data(), int64_t(big.size())}}, 2);
    _exit(0);
  }
  bool seen_tmp = false;
  for (int i = 0; i < 20000 && !seen_tmp; ++i) {
    for (auto& e : fs::directory_iterator(dir.path()))
      seen_tmp |= e.path().filename().string().find(".tmp") != std::string::npos;
    if (!seen_tmp) usleep(500);
  }
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(seen_tmp) << "the child never started writing";
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child finished before it could be killed";
  EXPECT_EQ(*latest_checkpoint(dir.path().string()), good);
  EXPECT_FALSE(fs::exists(dir.path() / "step_00000002.ckpt"));
  std::vector<float> ra(2), rb(1);
  load_checkpoint(good, {{"a", ra.data(), 2}, {"b", rb.data(), 1}});
  EXPECT_EQ(ra, a);
}

}  // namespace
}  // namespace tessel::runtime
