#include "tessel/data/batch_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/data/test_files.h"
#include "tessel/data/token_dataset.h"
#include "tessel/testing/testing.h"

namespace tessel::data {
namespace {

using ::testing::HasSubstr;

// Token k of the stream is k (mod vocab), so a window's first token names its sample.
class CountingSource : public TokenSource {
 public:
  explicit CountingSource(int64_t size, uint64_t vocab = uint64_t{1} << 31)
      : size_(size), vocab_(vocab) {}
  int64_t size() const override { return size_; }
  uint64_t vocab_size() const override { return vocab_; }
  void read(int64_t offset, int64_t count, int32_t* out) const override {
    check_read_range(*this, offset, count);
    for (int64_t i = 0; i < count; ++i)
      out[i] = static_cast<int32_t>((offset + i) % static_cast<int64_t>(vocab_));
  }
  std::string describe() const override { return "counting source"; }

 private:
  int64_t size_;
  uint64_t vocab_;
};

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch load(const BatchLoader& loader, int64_t cursor, int64_t first, int64_t count) {
  Batch b;
  b.inputs.resize(static_cast<size_t>(count * loader.seq_len()));
  b.targets.resize(b.inputs.size());
  loader.load(cursor, first, count, b.inputs.data(), b.targets.data());
  return b;
}

TEST(BatchLoader, SamplesAreShiftedWindowsAtMultiplesOfSeqLen) {
  const int64_t L = 8;
  BatchLoader loader(std::make_shared<CountingSource>(10 * L + 1), L, 1);
  EXPECT_EQ(loader.num_samples(), 10);
  std::vector<int32_t> in(L), tg(L);
  for (int64_t s = 0; s < 10; ++s) {
    loader.load_sample(s, in.data(), tg.data());
    for (int64_t j = 0; j < L; ++j) {
      EXPECT_EQ(in[j], s * L + j);
      EXPECT_EQ(tg[j], s * L + j + 1);
    }
  }
  // One token short of the last window drops it.
  EXPECT_EQ(BatchLoader(std::make_shared<CountingSource>(10 * L), L, 1).num_samples(), 9);
}

TEST(BatchLoader, SeqLenOneWorks) {
  BatchLoader loader(std::make_shared<CountingSource>(5), 1, 3);
  EXPECT_EQ(loader.num_samples(), 4);
  auto b = load(loader, 0, 0, 4);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(b.targets[k], b.inputs[k] + 1);
}

TEST(BatchLoader, EachEpochCoversTheTrainSamplesOnceAndNeverEval) {
  const int64_t L = 4;
  BatchLoader loader(std::make_shared<CountingSource>(100 * L + 1), L, 9, 0.1);
  EXPECT_EQ(loader.num_train_samples(), 90);
  EXPECT_EQ(loader.num_eval_samples(), 10);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    auto b = load(loader, epoch * 90, 0, 90);
    std::set<int64_t> samples;
    for (int64_t k = 0; k < 90; ++k) samples.insert(b.inputs[k * L] / L);
    EXPECT_EQ(samples.size(), 90u);
    EXPECT_EQ(*samples.rbegin(), 89);  // the eval samples 90..99 never appear
  }
}

TEST(BatchLoader, EvalIteratesTheHeldOutTailInOrder) {
  const int64_t L = 4;
  BatchLoader loader(std::make_shared<CountingSource>(100 * L + 1), L, 9, 0.1);
  std::vector<int32_t> in(10 * L), tg(10 * L);
  loader.load_eval(0, 10, in.data(), tg.data());
  for (int64_t k = 0; k < 10; ++k) EXPECT_EQ(in[k * L], (90 + k) * L);
  loader.load_eval(7, 3, in.data(), tg.data());
  EXPECT_EQ(in[0], 97 * L);
  EXPECT_THROW(loader.load_eval(8, 3, in.data(), tg.data()), InvalidArgumentError);
  EXPECT_THROW(loader.load_eval(-1, 1, in.data(), tg.data()), InvalidArgumentError);
}

TEST(BatchLoader, EvalFractionRoundsAndKeepsAtLeastOneSample) {
  auto src = std::make_shared<CountingSource>(10 * 2 + 1);  // 10 samples of seq_len 2
  EXPECT_EQ(BatchLoader(src, 2, 0, 0.0).num_eval_samples(), 0);
  EXPECT_EQ(BatchLoader(src, 2, 0, 0.01).num_eval_samples(), 1);
  EXPECT_EQ(BatchLoader(src, 2, 0, 0.26).num_eval_samples(), 3);
  EXPECT_EQ(BatchLoader(src, 2, 0, 0.9).num_train_samples(), 1);
  EXPECT_THROW(BatchLoader(src, 2, 0, 0.96), ConfigError);  // rounds to 10: nothing to train on
  EXPECT_THROW(BatchLoader(src, 2, 0, 1.0), InvalidArgumentError);
  EXPECT_THROW(BatchLoader(src, 2, 0, -0.1), InvalidArgumentError);
}

TEST(BatchLoader, SameSeedSameBatchesDifferentSeedDifferent) {
  auto src = std::make_shared<CountingSource>(1000 * 16 + 1);
  BatchLoader a(src, 16, 77), b(src, 16, 77), c(src, 16, 78);
  EXPECT_EQ(load(a, 0, 0, 64), load(b, 0, 0, 64));
  EXPECT_NE(load(a, 0, 0, 64), load(c, 0, 0, 64));
}

TEST(BatchLoader, ResumingFromACursorYieldsTheSameBatches) {
  auto src = std::make_shared<CountingSource>(50 * 8 + 1);
  const int64_t global_batch = 12;  // does not divide 50: batches straddle epoch boundaries
  BatchLoader continuing(src, 8, 2024);
  std::vector<Batch> steps;
  for (int64_t step = 0; step < 20; ++step)
    steps.push_back(load(continuing, step * global_batch, 0, global_batch));
  for (int64_t resume_at : {1, 4, 5, 13}) {
    BatchLoader resumed(src, 8, 2024);
    for (int64_t step = resume_at; step < 20; ++step)
      EXPECT_EQ(load(resumed, step * global_batch, 0, global_batch), steps[step])
          << "resume at " << resume_at << " step " << step;
  }
}

TEST(BatchLoader, DataParallelSlicesConcatenateToTheGlobalBatch) {
  auto src = std::make_shared<CountingSource>(300 * 4 + 1);
  BatchLoader loader(src, 4, 11, 0.05);
  const int64_t global_batch = 24;
  for (int64_t cursor : {int64_t{0}, int64_t{24 * 11}}) {  // the second crosses an epoch boundary
    const Batch whole = load(loader, cursor, 0, global_batch);
    for (int64_t dp : {1, 2, 3, 4, 8}) {
      const int64_t per_rank = global_batch / dp;
      for (int64_t micro : {int64_t{1}, per_rank}) {  // micro-batches split each rank's slice
        Batch joined;
        for (int64_t rank = 0; rank < dp; ++rank) {
          for (int64_t m = 0; m < per_rank; m += micro) {
            Batch part = load(loader, cursor, rank * per_rank + m, micro);
            joined.inputs.insert(joined.inputs.end(), part.inputs.begin(), part.inputs.end());
            joined.targets.insert(joined.targets.end(), part.targets.begin(), part.targets.end());
          }
        }
        EXPECT_EQ(joined, whole) << "dp " << dp << " micro " << micro << " cursor " << cursor;
      }
    }
  }
}

TEST(BatchLoader, LargeBatchesLoadInParallelWithTheSameResult) {
  const int64_t L = 1024;
  auto src = std::make_shared<CountingSource>(1500 * L + 1);
  BatchLoader loader(src, L, 5);
  const Batch big = load(loader, 37, 0, 1024);  // 1M tokens: at the parallel threshold
  for (int64_t k = 0; k < 1024; k += 111) {
    const Batch one = load(loader, 37, k, 1);
    EXPECT_TRUE(std::equal(one.inputs.begin(), one.inputs.end(), big.inputs.begin() + k * L));
    EXPECT_TRUE(std::equal(one.targets.begin(), one.targets.end(), big.targets.begin() + k * L));
  }
}

TEST(BatchLoader, CorruptTokenInABatchIsReported) {
  tessel::testing::TempDir dir;
  const std::string path = (dir / "t.tok").string();
  const int64_t L = 256;
  std::vector<uint32_t> tokens(static_cast<size_t>(4100 * L + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 257);
  write_token_file(path, tokens, 257, 2);
  const int64_t bad_pos = 123 * L + 17;
  testing::patch<uint16_t>(path, kTokenFileHeaderBytes + 2 * bad_pos, 999);
  BatchLoader loader(TokenFile::open(path, /*verify=*/false), L, 1);
  std::vector<int32_t> in(4100 * L), tg(4100 * L);
  try {
    loader.load(0, 0, 4100, in.data(), tg.data());  // every sample, on several threads
    FAIL() << "corrupt token not reported";
  } catch (const CorruptDataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
    EXPECT_THAT(e.what(), HasSubstr("position " + std::to_string(bad_pos)));
    EXPECT_THAT(e.what(), HasSubstr("id 999"));
  }
}

TEST(BatchLoader, RejectsUnusableSetups) {
  auto tiny = std::make_shared<CountingSource>(8);
  try {
    BatchLoader loader(tiny, 8, 0);
    FAIL() << "accepted data without a single sample";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("counting source"));
    EXPECT_THAT(e.what(), HasSubstr("9 tokens"));
  }
  EXPECT_NO_THROW(BatchLoader(tiny, 7, 0));
  EXPECT_THROW(BatchLoader(tiny, 0, 0), InvalidArgumentError);
  EXPECT_THROW(BatchLoader(nullptr, 4, 0), InvalidArgumentError);
  BatchLoader ok(tiny, 7, 0);
  std::vector<int32_t> in(7), tg(7);
  EXPECT_THROW(ok.load(-1, 0, 1, in.data(), tg.data()), InvalidArgumentError);
  EXPECT_THROW(ok.load_sample(1, in.data(), tg.data()), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::data
