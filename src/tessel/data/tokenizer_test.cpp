#include "tessel/data/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/data/bpe_test_data.h"
#include "tessel/data/bpe_tokenizer.h"
#include "tessel/data/test_files.h"
#include "tessel/data/token_dataset.h"
#include "tessel/testing/testing.h"

namespace tessel::data {
namespace {

using tessel::testing::error_of;
using tessel::testing::TempDir;
using ::testing::HasSubstr;
using namespace tessel::data::testing;

TEST(ByteTokenizer, EncodesBytesAndRoundTripsAnyByteString) {
  std::string text = "h\xc3\xa9llo";  // UTF-8: bytes, not code points
  text.push_back('\0');
  text.push_back('\xff');
  const ByteTokenizer bytes;
  const auto tokens = bytes.encode(text);
  EXPECT_EQ(tokens, (std::vector<uint32_t>{'h', 0xc3, 0xa9, 'l', 'l', 'o', 0, 255}));
  EXPECT_EQ(bytes.decode(tokens), text);
  const std::vector<int32_t> as_int(tokens.begin(), tokens.end());
  EXPECT_EQ(bytes.decode(as_int), text);
}

TEST(ByteTokenizer, DecodesEotAndRejectsUnknownIds) {
  const ByteTokenizer bytes;
  EXPECT_EQ(bytes.decode(std::vector<uint32_t>{'a', 256, 'b'}), "a<|endoftext|>b");
  try {
    bytes.decode(std::vector<uint32_t>{'a', 'b', 257});
    FAIL() << "decode accepted id 257";
  } catch (const InvalidArgumentError& e) {
    EXPECT_THAT(e.what(), HasSubstr("token id 257 at position 2"));
  }
  EXPECT_THROW(bytes.decode(std::vector<int32_t>{-1}), InvalidArgumentError);
}

TEST(ByteTokenizer, IsTheDefaultTokenizer) {
  const auto t = load_tokenizer("");
  ASSERT_NE(dynamic_cast<const ByteTokenizer*>(t.get()), nullptr);
  EXPECT_EQ(t->vocab_size(), 257u);
  EXPECT_EQ(t->eot(), 256u);
  EXPECT_EQ(t->bos(), std::nullopt);
  EXPECT_EQ(t->encode("ab"), (std::vector<uint32_t>{'a', 'b'}));
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
  EXPECT_EQ(ByteTokenizer().decode(t), "aab<|endoftext|><|endoftext|>acabc");
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

// Ids above 65535 (byte b -> 65536 + b), BOS and EOT after them: the file needs 4-byte tokens.
class WideTokenizer : public Tokenizer {
 public:
  std::vector<uint32_t> encode(std::string_view text) const override {
    std::vector<uint32_t> ids;
    for (char c : text) ids.push_back(65536 + static_cast<unsigned char>(c));
    return ids;
  }
  std::string decode(std::span<const uint32_t>) const override { return ""; }
  uint64_t vocab_size() const override { return 70000; }
  std::optional<uint32_t> eot() const override { return 65536 + 256; }
  std::optional<uint32_t> bos() const override { return 65536 + 257; }
  std::string describe() const override { return "wide"; }
};

TEST_F(PrepareTest, VocabAbove65536WritesUint32Tokens) {
  auto stats = prepare_dataset({file("1.txt", "ab"), file("2.txt", "a")}, out, WideTokenizer());
  EXPECT_EQ(stats.vocab_size, 70000u);
  EXPECT_EQ(stats.token_width, 4);
  EXPECT_EQ(stats.tokens, 6);
  // Content ids a, b, a (BOS and EOT excluded): p = (2/3, 1/3) -> log2(3) - 2/3 bits; both sides
  // are a few double operations on values near 1, so they agree to within 1e-12.
  EXPECT_NEAR(stats.entropy_bits, std::log2(3.0) - 2.0 / 3.0, 1e-12);
  auto tf = TokenFile::open(out);
  EXPECT_EQ(tf->token_width(), 4);
  EXPECT_EQ(tf->vocab_size(), 70000u);
  std::vector<int32_t> t(6);
  tf->read(0, 6, t.data());
  const int32_t a = 65536 + 'a', b = 65536 + 'b', bos = 65536 + 257, eot = 65536 + 256;
  EXPECT_EQ(t, (std::vector<int32_t>{bos, a, b, eot, bos, a}));
}

TEST_F(PrepareTest, BytesThroughTheTokenizerInterfaceAreTheDefault) {
  // The same documents through both entry points give the same file, byte for byte.
  const std::vector<std::string> docs = {file("1.txt", "hello\n"), file("2.txt", "w\xc3\xb6rld")};
  prepare_dataset(docs, out);
  const auto other = (dir / "other.tok").string();
  prepare_dataset(docs, other, *load_tokenizer(""));
  EXPECT_EQ(read_bytes(out), read_bytes(other));
}

TEST(LoadTokenizer, ChoosesByNameAndSaysWhatIsWrong) {
  TempDir dir;
  write_bytes(dir / "tokenizer.json", testing::gpt2_json());
  // A directory: its tokenizer.json.
  auto t = load_tokenizer(dir.path().string());
  ASSERT_NE(dynamic_cast<const BpeTokenizer*>(t.get()), nullptr);
  EXPECT_EQ(t->vocab_size(), 272u);
  // Any *.json name.
  write_bytes(dir / "gpt2-tok.json", testing::gpt2_json());
  EXPECT_NE(
      dynamic_cast<const BpeTokenizer*>(load_tokenizer((dir / "gpt2-tok.json").string()).get()),
      nullptr);
  // Missing files, an empty directory, a file of another kind.
  for (const char* name : {"none.json", "none.model", "none"}) {
    const auto path = (dir / name).string();
    EXPECT_THAT(error_of<IoError>([&] { load_tokenizer(path); }), HasSubstr(path));
  }
  std::filesystem::create_directory(dir / "empty");
  EXPECT_THAT(error_of<IoError>([&] { load_tokenizer((dir / "empty").string()); }),
              HasSubstr("has neither tokenizer.json nor tokenizer.model"));
  write_bytes(dir / "vocab.txt", "a\nb\n");
  EXPECT_THAT(error_of<ConfigError>([&] { load_tokenizer((dir / "vocab.txt").string()); }),
              HasSubstr("cannot tell what kind of tokenizer"));
}

}  // namespace
}  // namespace tessel::data
