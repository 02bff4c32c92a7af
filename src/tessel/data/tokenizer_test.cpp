#include "tessel/data/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/data/test_files.h"
#include "tessel/data/token_dataset.h"
#include "tessel/testing/testing.h"

namespace tessel::data {
namespace {

using tessel::testing::TempDir;
using ::testing::HasSubstr;
using namespace tessel::data::testing;

TEST(ByteTokenizer, EncodesBytesAndRoundTripsAnyByteString) {
  std::string text = "h\xc3\xa9llo";  // UTF-8: bytes, not code points
  text.push_back('\0');
  text.push_back('\xff');
  const auto tokens = ByteTokenizer::encode(text);
  EXPECT_EQ(tokens, (std::vector<uint32_t>{'h', 0xc3, 0xa9, 'l', 'l', 'o', 0, 255}));
  EXPECT_EQ(ByteTokenizer::decode(tokens), text);
  const std::vector<int32_t> as_int(tokens.begin(), tokens.end());
  EXPECT_EQ(ByteTokenizer::decode(as_int), text);
}

TEST(ByteTokenizer, DecodesEotAndRejectsUnknownIds) {
  EXPECT_EQ(ByteTokenizer::decode(std::vector<uint32_t>{'a', 256, 'b'}), "a<|endoftext|>b");
  try {
    ByteTokenizer::decode(std::vector<uint32_t>{'a', 'b', 257});
    FAIL() << "decode accepted id 257";
  } catch (const InvalidArgumentError& e) {
    EXPECT_THAT(e.what(), HasSubstr("token id 257 at position 2"));
  }
  EXPECT_THROW(ByteTokenizer::decode(std::vector<int32_t>{-1}), InvalidArgumentError);
}

TEST(Entropy, MatchesClosedForms) {
  EXPECT_DOUBLE_EQ(entropy_bits(std::vector<int64_t>{}), 0.0);
  EXPECT_DOUBLE_EQ(entropy_bits(std::vector<int64_t>{5}), 0.0);
  EXPECT_DOUBLE_EQ(entropy_bits(std::vector<int64_t>{3, 3}), 1.0);
  EXPECT_DOUBLE_EQ(entropy_bits(std::vector<int64_t>{1, 1, 1, 1, 0, 0}), 2.0);
  // p = (1/2, 1/4, 1/4): 0.5*1 + 2 * 0.25*2 = 1.5 bits.
  EXPECT_DOUBLE_EQ(entropy_bits(std::vector<int64_t>{2, 1, 1}), 1.5);
}

class PrepareTest : public ::testing::Test {
 protected:
  TempDir dir;
  std::string out = (dir / "out.tok").string();
  std::string file(const std::string& name, const std::string& text) {
    auto p = (dir / name).string();
    write_bytes(p, text);
    return p;
  }
};

TEST_F(PrepareTest, OneDocumentOfTwoEquallyLikelyBytesIsOneBit) {
  auto stats = prepare_dataset({file("a.txt", "abab")}, out);
  EXPECT_EQ(stats.documents, 1);
  EXPECT_EQ(stats.bytes, 4);
  EXPECT_EQ(stats.tokens, 4);
  EXPECT_DOUBLE_EQ(stats.entropy_bits, 1.0);
  EXPECT_DOUBLE_EQ(stats.entropy_nats, std::log(2.0));
  auto tf = TokenFile::open(out);
  EXPECT_EQ(tf->token_width(), 2);
  EXPECT_EQ(tf->vocab_size(), 257u);
  std::vector<int32_t> t(4);
  tf->read(0, 4, t.data());
  EXPECT_EQ(t, (std::vector<int32_t>{'a', 'b', 'a', 'b'}));
}

TEST_F(PrepareTest, DocumentsAreJoinedWithEot) {
  // Bytes over both documents: a x4, b x2, c x2 -> p = (1/2, 1/4, 1/4) = 1.5 bits. The empty
  // document still counts and still gets its separator.
  auto stats =
      prepare_dataset({file("1.txt", "aab"), file("2.txt", ""), file("3.txt", "acabc")}, out);
  EXPECT_EQ(stats.documents, 3);
  EXPECT_EQ(stats.bytes, 8);
  EXPECT_EQ(stats.tokens, 10);
  EXPECT_DOUBLE_EQ(stats.entropy_bits, 1.5);
  EXPECT_DOUBLE_EQ(stats.entropy_nats, 1.5 * std::log(2.0));
  auto tf = TokenFile::open(out);
  std::vector<int32_t> t(10);
  tf->read(0, 10, t.data());
  EXPECT_EQ(ByteTokenizer::decode(t), "aab<|endoftext|><|endoftext|>acabc");
  EXPECT_EQ(t[3], 256);
  EXPECT_EQ(t[4], 256);
}

TEST_F(PrepareTest, LargeDocumentStreamsThroughSeveralBuffers) {
  std::string big(3 * (1 << 20) + 17, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i % 256);
  auto stats = prepare_dataset({file("big.txt", big), file("small.txt", "z")}, out);
  EXPECT_EQ(stats.tokens, static_cast<int64_t>(big.size()) + 2);
  auto tf = TokenFile::open(out);
  std::vector<int32_t> tail(3);
  tf->read(tf->size() - 3, 3, tail.data());
  EXPECT_EQ(tail, (std::vector<int32_t>{(int32_t(big.size()) - 1) % 256, 256, 'z'}));
  // Nearly uniform over 256 byte values: just under 8 bits.
  EXPECT_GT(stats.entropy_bits, 7.99);
  EXPECT_LE(stats.entropy_bits, 8.0);
}

TEST_F(PrepareTest, MissingInputIsIoErrorAndWritesNothing) {
  const std::string missing = (dir / "nope.txt").string();
  try {
    prepare_dataset({file("a.txt", "x"), missing}, out);
    FAIL() << "missing input accepted";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr(missing));
  }
  EXPECT_FALSE(std::filesystem::exists(out));
}

TEST_F(PrepareTest, UnreadableInputIsIoErrorAndWritesNothing) {
  const std::string subdir = (dir / "subdir").string();
  std::filesystem::create_directory(subdir);
  try {
    prepare_dataset({subdir}, out);
    FAIL() << "directory accepted as a text file";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr(subdir));
  }
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_EQ(list_dir(dir.path()), std::vector<std::string>{"subdir"});
}

TEST_F(PrepareTest, NoInputsIsInvalid) {
  EXPECT_THROW(prepare_dataset({}, out), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::data
