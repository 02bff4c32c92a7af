#include "tessel/data/token_source.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "tessel/core/error.h"
#include "tessel/data/megatron_dataset.h"
#include "tessel/data/test_files.h"
#include "tessel/data/token_dataset.h"
#include "tessel/testing/testing.h"

namespace tessel::data {
namespace {

using tessel::testing::TempDir;
using ::testing::HasSubstr;

std::vector<int32_t> read_all(const TokenSource& src) {
  std::vector<int32_t> out(static_cast<size_t>(src.size()));
  src.read(0, src.size(), out.data());
  return out;
}

TEST(OpenTokenSource, ChoosesTheFormatFromTheFile) {
  TempDir dir;
  const std::vector<int32_t> expected = {5, 6, 7, 8};
  // A tessel file is recognised by its magic, whatever its extension (even .bin).
  for (const char* name : {"a.tok", "b", "c.bin"}) {
    const auto path = (dir / name).string();
    write_token_file(path, std::vector<uint32_t>{5, 6, 7, 8}, 9, 2);
    auto src = open_token_source(path);
    EXPECT_NE(dynamic_cast<TokenFile*>(src.get()), nullptr) << name;
    EXPECT_EQ(read_all(*src), expected);
    EXPECT_EQ(src->vocab_size(), 9u);
  }
  // A Megatron pair by prefix, by .idx and by .bin.
  const auto prefix = (dir / "mega").string();
  write_megatron_dataset(prefix, {{5, 6}, {7, 8}}, MegatronDType::i32);
  for (const auto& path : {prefix, prefix + ".idx", prefix + ".bin"}) {
    auto src = open_token_source(path);
    ASSERT_NE(dynamic_cast<MegatronDataset*>(src.get()), nullptr) << path;
    EXPECT_EQ(read_all(*src), expected);
    EXPECT_EQ(src->vocab_size(), 9u);
  }
  TokenSourceOptions opt;
  opt.vocab_size = 300;
  EXPECT_EQ(open_token_source(prefix, opt)->vocab_size(), 300u);
}

TEST(OpenTokenSource, ReportsMissingAndUnknownFiles) {
  TempDir dir;
  const auto missing = (dir / "nothing").string();
  try {
    open_token_source(missing);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr(missing));
  }
  const auto text = (dir / "notes.txt").string();
  testing::write_bytes(text, "just some text");
  try {
    open_token_source(text);
    FAIL();
  } catch (const CorruptDataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(text));
    EXPECT_THAT(e.what(), HasSubstr("tessel data prepare"));
  }
  // A .idx that is not a Megatron index is reported as such.
  const auto fake = (dir / "fake").string();
  testing::write_bytes(fake + ".idx", "garbage!garbage!garbage!garbage!garbage!");
  testing::write_bytes(fake + ".bin", "");
  EXPECT_THROW(open_token_source(fake + ".idx"), CorruptDataError);
  // Only half of a Megatron pair.
  const auto half = (dir / "half").string();
  testing::write_bytes(half + ".bin", "");
  try {
    open_token_source(half);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr(half + ".idx"));
  }
}

}  // namespace
}  // namespace tessel::data
