#include "tessel/data/token_dataset.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/data/rng.h"
#include "tessel/data/test_files.h"
#include "tessel/testing/testing.h"

namespace tessel::data {
namespace {

using tessel::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace tessel::data::testing;

std::vector<uint32_t> random_tokens(size_t n, uint64_t vocab, uint64_t seed) {
  Xoshiro256 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = static_cast<uint32_t>(rng.below(vocab));
  return t;
}

std::vector<int32_t> read_all(const TokenSource& src) {
  std::vector<int32_t> out(static_cast<size_t>(src.size()));
  src.read(0, src.size(), out.data());
  return out;
}

// Runs f, expects it to throw E, and returns the message.
template <typename E, typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

class TokenFileTest : public ::testing::Test {
 protected:
  TempDir dir;
  std::string path = (dir / "toks.bin").string();
};

TEST_F(TokenFileTest, RoundTripsBothWidths) {
  for (auto [width, vocab] : {std::pair{2, uint64_t{65536}}, std::pair{4, uint64_t{100000}},
                              std::pair{4, kMaxVocabSize}}) {
    const auto tokens = random_tokens(5000, vocab, width);
    write_token_file(path, tokens, vocab, width);
    auto tf = TokenFile::open(path);
    EXPECT_EQ(tf->size(), 5000);
    EXPECT_EQ(tf->vocab_size(), vocab);
    EXPECT_EQ(tf->token_width(), width);
    EXPECT_EQ(std::filesystem::file_size(path), kTokenFileHeaderBytes + 5000u * width);
    auto got = read_all(*tf);
    ASSERT_EQ(got.size(), tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(uint32_t(got[i]), tokens[i]) << i;
    // A slice in the middle.
    std::vector<int32_t> slice(10);
    tf->read(1234, 10, slice.data());
    for (int i = 0; i < 10; ++i) EXPECT_EQ(uint32_t(slice[i]), tokens[1234 + i]);
    EXPECT_THAT(tf->describe(), AllOf(HasSubstr(path), HasSubstr("5000 tokens")));
  }
}

TEST_F(TokenFileTest, HeaderIsLittleEndianAtDocumentedOffsets) {
  write_token_file(path, std::vector<uint32_t>{7, 300, 9}, 301, 2);
  const std::string b = read_bytes(path);
  ASSERT_EQ(b.size(), 64u + 6u);
  EXPECT_EQ(b.substr(0, 8), "TSLTOKEN");
  auto u8 = [&](size_t i) { return static_cast<uint8_t>(b[i]); };
  EXPECT_EQ(u8(8), 1);   // version
  EXPECT_EQ(u8(12), 2);  // width
  EXPECT_EQ(u8(16), 301 & 0xff);
  EXPECT_EQ(u8(17), 301 >> 8);
  EXPECT_EQ(u8(24), 3);           // count
  EXPECT_EQ(u8(66), 300 & 0xff);  // second token, low byte first
  EXPECT_EQ(u8(67), 300 >> 8);
  uint64_t expected_sum = 0;
  const uint32_t toks[] = {7, 300, 9};
  for (uint64_t i = 0; i < 3; ++i) expected_sum += token_checksum_term(i, toks[i]);
  EXPECT_EQ(TokenFile::open(path)->checksum(), expected_sum);
}

TEST_F(TokenFileTest, StreamingAppendsEqualOneShotWrite) {
  const auto tokens = random_tokens(200000, 257, 3);  // spans several internal chunks
  write_token_file(path, tokens, 257, 2);
  const std::string other = (dir / "streamed.bin").string();
  TokenFileWriter w(other, 257, 2);
  w.append(std::span(tokens).subspan(0, 70001));
  w.append(std::span(tokens).subspan(70001));
  w.finish();
  EXPECT_EQ(w.count(), 200000);
  EXPECT_EQ(read_bytes(path), read_bytes(other));
}

TEST_F(TokenFileTest, EmptyFileRoundTrips) {
  write_token_file(path, {}, 10, 4);
  auto tf = TokenFile::open(path);
  EXPECT_EQ(tf->size(), 0);
  tf->read(0, 0, nullptr);
}

TEST_F(TokenFileTest, WriterRejectsBadArgumentsAndLeavesNothing) {
  EXPECT_THROW(write_token_file(path, std::vector<uint32_t>{1}, 10, 3), InvalidArgumentError);
  EXPECT_THROW(write_token_file(path, std::vector<uint32_t>{1}, 70000, 2), InvalidArgumentError);
  EXPECT_THROW(write_token_file(path, std::vector<uint32_t>{1}, 0, 4), InvalidArgumentError);
  EXPECT_THROW(write_token_file(path, std::vector<uint32_t>{1}, kMaxVocabSize + 1, 4),
               InvalidArgumentError);
  auto msg = message_of<InvalidArgumentError>([&] {
    write_token_file(path, std::vector<uint32_t>{1, 2, 10}, 10, 2);
  });
  EXPECT_THAT(msg, AllOf(HasSubstr("token id 10"), HasSubstr("position 2")));
  EXPECT_TRUE(list_dir(dir.path()).empty());  // no final file, no temporary left behind
}

TEST_F(TokenFileTest, FailedRewriteKeepsThePreviousFileIntact) {
  write_token_file(path, std::vector<uint32_t>{1, 2, 3}, 10, 2);
  const std::string before = read_bytes(path);
  {
    TokenFileWriter w(path, 10, 2);
    w.append(std::vector<uint32_t>{4, 5});
    // Destroyed without finish(), as when an exception unwinds past it.
  }
  EXPECT_THROW(write_token_file(path, std::vector<uint32_t>{4, 50}, 10, 2), InvalidArgumentError);
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(list_dir(dir.path()), std::vector<std::string>{"toks.bin"});
}

TEST_F(TokenFileTest, WriteIntoMissingDirectoryIsIoError) {
  const std::string bad = (dir / "no" / "such" / "dir.bin").string();
  auto msg = message_of<IoError>([&] { write_token_file(bad, {}, 10, 2); });
  EXPECT_THAT(msg, HasSubstr(bad));
}

TEST_F(TokenFileTest, MissingFileIsIoErrorNamingPath) {
  auto msg = message_of<IoError>([&] { TokenFile::open(path); });
  EXPECT_THAT(msg, HasSubstr(path));
}

TEST_F(TokenFileTest, BadMagicIsCorrupt) {
  write_token_file(path, std::vector<uint32_t>{1, 2}, 10, 2);
  patch<char>(path, 0, 'X');
  auto msg = message_of<CorruptDataError>([&] { TokenFile::open(path); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("not a tessel token file"),
                         HasSubstr("tessel data prepare")));
}

TEST_F(TokenFileTest, UnknownVersionIsCorrupt) {
  write_token_file(path, std::vector<uint32_t>{1, 2}, 10, 2);
  patch<uint32_t>(path, 8, 2);
  auto msg = message_of<CorruptDataError>([&] { TokenFile::open(path); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("version 2")));
}

TEST_F(TokenFileTest, BadWidthIsCorrupt) {
  write_token_file(path, std::vector<uint32_t>{1, 2}, 10, 2);
  patch<uint32_t>(path, 12, 3);
  auto msg = message_of<CorruptDataError>([&] { TokenFile::open(path); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("token width 3")));
}

TEST_F(TokenFileTest, ImpossibleVocabIsCorrupt) {
  write_token_file(path, std::vector<uint32_t>{1, 2}, 10, 2);
  patch<uint64_t>(path, 16, 0);
  EXPECT_THROW(TokenFile::open(path), CorruptDataError);
  patch<uint64_t>(path, 16, 70000);  // too large for 2-byte tokens
  EXPECT_THROW(TokenFile::open(path), CorruptDataError);
}

TEST_F(TokenFileTest, NonzeroReservedBytesAreCorrupt) {
  write_token_file(path, std::vector<uint32_t>{1, 2}, 10, 2);
  patch<uint8_t>(path, 50, 1);
  EXPECT_THROW(TokenFile::open(path), CorruptDataError);
}

TEST_F(TokenFileTest, TruncatedOrOverlongFileIsCorrupt) {
  write_token_file(path, std::vector<uint32_t>{1, 2, 3, 4}, 10, 4);
  std::string bytes = read_bytes(path);
  write_bytes(path, bytes.substr(0, bytes.size() - 1));
  auto msg = message_of<CorruptDataError>([&] { TokenFile::open(path); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr("4 tokens")));
  write_bytes(path, bytes.substr(0, 20));  // not even a full header
  EXPECT_THROW(TokenFile::open(path), CorruptDataError);
  write_bytes(path, bytes + "xx");
  EXPECT_THROW(TokenFile::open(path), CorruptDataError);
  // A count so large that count * width overflows must not pass the size check.
  write_bytes(path, bytes);
  patch<uint64_t>(path, 24, (uint64_t{1} << 62) + 1);
  EXPECT_THROW(TokenFile::open(path), CorruptDataError);
}

TEST_F(TokenFileTest, TokenAboveVocabIsCaughtAtOpenAndAtRead) {
  write_token_file(path, std::vector<uint32_t>{1, 2, 3, 4, 5}, 10, 2);
  patch<uint16_t>(path, 64 + 2 * 3, 4000);  // token 3 -> 4000
  auto msg = message_of<CorruptDataError>([&] { TokenFile::open(path); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("token 3"), HasSubstr("byte offset 70"),
                         HasSubstr("id 4000"), HasSubstr("vocab size 10")));

  // Without the open-time scan, read() still refuses it, and only ranges that contain it.
  auto tf = TokenFile::open(path, /*verify=*/false);
  std::vector<int32_t> out(5);
  tf->read(0, 3, out.data());
  EXPECT_EQ(out[2], 3);
  msg = message_of<CorruptDataError>([&] { tf->read(1, 4, out.data()); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("position 3"), HasSubstr("id 4000"),
                         HasSubstr("[0, 10)")));
}

TEST_F(TokenFileTest, ChecksumCatchesChangedTokens) {
  write_token_file(path, std::vector<uint32_t>{1, 2, 3, 4, 5}, 10, 2);
  // Swap two tokens: every id stays valid and the multiset is unchanged, only positions differ.
  patch<uint16_t>(path, 64 + 0, 2);
  patch<uint16_t>(path, 64 + 2, 1);
  auto msg = message_of<CorruptDataError>([&] { TokenFile::open(path); });
  EXPECT_THAT(msg, AllOf(HasSubstr(path), HasSubstr("checksum")));
  EXPECT_NO_THROW(TokenFile::open(path, /*verify=*/false));
}

TEST_F(TokenFileTest, ReadOutsideTheStreamIsInvalidArgument) {
  write_token_file(path, std::vector<uint32_t>{1, 2, 3}, 10, 2);
  auto tf = TokenFile::open(path);
  std::vector<int32_t> out(4);
  EXPECT_THROW(tf->read(0, 4, out.data()), InvalidArgumentError);
  EXPECT_THROW(tf->read(-1, 1, out.data()), InvalidArgumentError);
  EXPECT_THROW(tf->read(2, -1, out.data()), InvalidArgumentError);
  EXPECT_NO_THROW(tf->read(3, 0, out.data()));
}

}  // namespace
}  // namespace tessel::data
