#include "tessel/data/megatron_dataset.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
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

template <typename T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Builds a .idx byte for byte from the Megatron layout, independently of write_megatron_dataset.
std::string make_index(uint8_t dtype, const std::vector<int32_t>& sizes,
                       const std::vector<int64_t>& pointers, const std::vector<int64_t>& doc_idx,
                       uint64_t version = 1) {
  std::string s("MMIDIDX\0\0", 9);
  put<uint64_t>(s, version);
  put<uint8_t>(s, dtype);
  put<uint64_t>(s, sizes.size());
  put<uint64_t>(s, doc_idx.size());
  for (auto v : sizes) put(s, v);
  for (auto v : pointers) put(s, v);
  for (auto v : doc_idx) put(s, v);
  return s;
}

std::vector<int32_t> read_all(const TokenSource& src) {
  std::vector<int32_t> out(static_cast<size_t>(src.size()));
  src.read(0, src.size(), out.data());
  return out;
}

class MegatronTest : public ::testing::Test {
 protected:
  TempDir dir;
  std::string prefix = (dir / "corpus_text_document").string();
  std::string idx = prefix + ".idx";
  std::string bin = prefix + ".bin";

  // Three documents of uint16 tokens [0..5), [], [5..9): a small valid pair to corrupt.
  void write_small() {
    write_megatron_dataset(prefix, {{10, 11, 12, 13, 14}, {}, {15, 16, 17, 18}},
                           MegatronDType::u16);
  }
};

TEST_F(MegatronTest, WriterProducesTheMegatronLayout) {
  write_small();
  EXPECT_EQ(read_bytes(idx), make_index(8, {5, 0, 4}, {0, 10, 10}, {0, 1, 2, 3}));
  std::string expected_bin;
  for (uint16_t v : {10, 11, 12, 13, 14, 15, 16, 17, 18}) put(expected_bin, v);
  EXPECT_EQ(read_bytes(bin), expected_bin);
}

TEST_F(MegatronTest, RoundTripsEveryIntegerDtype) {
  const std::vector<std::vector<int64_t>> docs = {{0, 1, 2, 3, 100}, {}, {7}, {42, 5, 5, 99}};
  for (auto dtype : {MegatronDType::u8, MegatronDType::i8, MegatronDType::i16, MegatronDType::i32,
                     MegatronDType::i64, MegatronDType::u16}) {
    SCOPED_TRACE(megatron_dtype_name(dtype));
    write_megatron_dataset(prefix, docs, dtype);
    auto ds = MegatronDataset::open(prefix);
    EXPECT_EQ(ds->dtype(), dtype);
    EXPECT_EQ(ds->num_sequences(), 4);
    EXPECT_EQ(ds->num_documents(), 4);
    EXPECT_EQ(ds->size(), 10);
    EXPECT_EQ(ds->vocab_size(), 101u);  // inferred: largest id + 1
    EXPECT_THAT(ds->describe(), AllOf(HasSubstr(prefix), HasSubstr("inferred")));
    std::vector<int32_t> expected;
    for (const auto& d : docs) expected.insert(expected.end(), d.begin(), d.end());
    EXPECT_EQ(read_all(*ds), expected);
    // Ranges that start and end inside different sequences.
    std::vector<int32_t> out(4);
    ds->read(4, 3, out.data());
    EXPECT_EQ(std::vector<int32_t>(out.begin(), out.begin() + 3),
              std::vector<int32_t>(expected.begin() + 4, expected.begin() + 7));
  }
}

TEST_F(MegatronTest, LargeIdsRoundTripInWideDtypes) {
  write_megatron_dataset(prefix, {{0, 2147483647}}, MegatronDType::i64);
  auto ds = MegatronDataset::open(prefix);
  EXPECT_EQ(ds->vocab_size(), uint64_t{1} << 31);
  EXPECT_EQ(read_all(*ds), (std::vector<int32_t>{0, 2147483647}));
  // An id that does not fit int32 can never be a valid token.
  write_megatron_dataset(prefix, {{0, 2147483648}}, MegatronDType::i64);
  auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, AllOf(HasSubstr(prefix), HasSubstr("position 1"), HasSubstr("2147483648")));
}

TEST_F(MegatronTest, GivenVocabIsCheckedAtOpenAndAtRead) {
  write_small();
  TokenSourceOptions opt;
  opt.vocab_size = 50000;
  auto ds = MegatronDataset::open(prefix, opt);
  EXPECT_EQ(ds->vocab_size(), 50000u);
  EXPECT_THAT(ds->describe(), ::testing::Not(HasSubstr("inferred")));

  opt.vocab_size = 17;  // ids 17 and 18 are out of range
  auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix, opt); });
  EXPECT_THAT(msg, AllOf(HasSubstr(prefix), HasSubstr("position 7"), HasSubstr("id 17"),
                         HasSubstr("[0, 17)")));
  opt.verify = false;
  ds = MegatronDataset::open(prefix, opt);
  std::vector<int32_t> out(9);
  ds->read(0, 7, out.data());
  EXPECT_THROW(ds->read(6, 2, out.data()), CorruptDataError);
}

TEST_F(MegatronTest, NegativeIdsAreCorrupt) {
  write_megatron_dataset(prefix, {{3, 4}, {5, -2}}, MegatronDType::i16);
  auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, AllOf(HasSubstr(prefix), HasSubstr("position 3"), HasSubstr("id -2")));
}

TEST_F(MegatronTest, ReadsSequencesStoredOutOfOrder) {
  // .bin holds sequence 2, then 0, then 1 (int32); the stream must still be 0, 1, 2, with an empty
  // sequence between, exercising the per-sequence table instead of the contiguous fast path.
  std::string b;
  const std::vector<std::vector<int32_t>> seqs = {{1, 2, 3}, {}, {4, 5}, {6, 7, 8, 9}};
  for (int32_t v : seqs[3]) put(b, v);
  for (int32_t v : seqs[0]) put(b, v);
  for (int32_t v : seqs[2]) put(b, v);
  write_bytes(bin, b);
  write_bytes(idx, make_index(4, {3, 0, 2, 4}, {16, 28, 28, 0}, {0, 2, 4}));
  auto ds = MegatronDataset::open(prefix);
  const std::vector<int32_t> expected = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  EXPECT_EQ(read_all(*ds), expected);
  for (int64_t off = 0; off <= 9; ++off) {
    for (int64_t n = 0; off + n <= 9; ++n) {
      std::vector<int32_t> out(static_cast<size_t>(n));
      ds->read(off, n, out.data());
      ASSERT_EQ(out, std::vector<int32_t>(expected.begin() + off, expected.begin() + off + n))
          << off << "+" << n;
    }
  }
}

TEST_F(MegatronTest, MissingFilesAreIoErrorsNamingThem) {
  auto msg = message_of<IoError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, HasSubstr(idx));
  write_small();
  std::filesystem::remove(bin);
  msg = message_of<IoError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, HasSubstr(bin));
}

TEST_F(MegatronTest, BadMagicOrVersionIsCorrupt) {
  write_small();
  patch<char>(idx, 0, 'X');
  auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, AllOf(HasSubstr(idx), HasSubstr("not a Megatron index")));
  write_small();
  patch<uint64_t>(idx, 9, 2);
  msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, AllOf(HasSubstr(idx), HasSubstr("version 2")));
}

TEST_F(MegatronTest, DtypeCodesAreValidated) {
  write_small();
  for (uint8_t code : {0, 9, 255}) {
    patch<uint8_t>(idx, 17, code);
    auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
    EXPECT_THAT(msg, AllOf(HasSubstr(idx), HasSubstr("dtype code")));
  }
  for (uint8_t code : {6, 7}) {  // float64, float32
    patch<uint8_t>(idx, 17, code);
    auto msg = message_of<UnsupportedError>([&] { MegatronDataset::open(prefix); });
    EXPECT_THAT(msg, HasSubstr(prefix));
  }
}

TEST_F(MegatronTest, TruncatedOrOverlongIndexIsCorrupt) {
  write_small();
  const std::string good = read_bytes(idx);
  write_bytes(idx, good.substr(0, good.size() - 1));
  auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, AllOf(HasSubstr(idx), HasSubstr("truncated")));
  write_bytes(idx, good.substr(0, 20));
  EXPECT_THROW(MegatronDataset::open(prefix), CorruptDataError);
  write_bytes(idx, good + "x");
  EXPECT_THROW(MegatronDataset::open(prefix), CorruptDataError);
  write_bytes(idx, good);
  patch<uint64_t>(idx, 18, uint64_t{1} << 61);  // sequence count whose tables would overflow
  EXPECT_THROW(MegatronDataset::open(prefix), CorruptDataError);
}

TEST_F(MegatronTest, PointersOutsideTheBinAreCorrupt) {
  write_small();                                                          // .bin has 18 bytes
  write_bytes(idx, make_index(8, {5, 0, 4}, {0, 10, 12}, {0, 1, 2, 3}));  // ends at byte 20
  auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(
      msg, AllOf(HasSubstr(idx), HasSubstr(bin), HasSubstr("sequence 2"), HasSubstr("18 bytes")));
  write_bytes(idx, make_index(8, {5, 0, 4}, {0, 10, -2}, {0, 1, 2, 3}));
  EXPECT_THROW(MegatronDataset::open(prefix), CorruptDataError);
  write_bytes(idx, make_index(8, {5, 0, 4}, {0, 1000, 10}, {0, 1, 2, 3}));  // empty but outside
  EXPECT_THROW(MegatronDataset::open(prefix), CorruptDataError);
  write_bytes(idx, make_index(8, {5, -1, 4}, {0, 10, 10}, {0, 1, 2, 3}));
  msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, HasSubstr("negative size"));
  // A truncated .bin is caught the same way.
  write_small();
  write_bytes(bin, read_bytes(bin).substr(0, 17));
  EXPECT_THROW(MegatronDataset::open(prefix), CorruptDataError);
}

TEST_F(MegatronTest, DocumentIndexIsValidated) {
  write_small();
  write_bytes(idx, make_index(8, {5, 0, 4}, {0, 10, 10}, {0, 2, 1, 3}));  // decreasing
  auto msg = message_of<CorruptDataError>([&] { MegatronDataset::open(prefix); });
  EXPECT_THAT(msg, AllOf(HasSubstr(idx), HasSubstr("document index entry 2")));
  write_bytes(idx, make_index(8, {5, 0, 4}, {0, 10, 10}, {0, 1, 4}));  // past the last sequence
  EXPECT_THROW(MegatronDataset::open(prefix), CorruptDataError);
}

TEST_F(MegatronTest, WriterRejectsValuesTheDtypeCannotHold) {
  auto msg = message_of<InvalidArgumentError>([&] {
    write_megatron_dataset(prefix, {{1, 2}, {300}}, MegatronDType::u8);
  });
  EXPECT_THAT(msg, AllOf(HasSubstr("300"), HasSubstr("uint8")));
  EXPECT_THROW(write_megatron_dataset(prefix, {{-1}}, MegatronDType::u16), InvalidArgumentError);
  EXPECT_THROW(write_megatron_dataset(prefix, {{1}}, MegatronDType::f32), InvalidArgumentError);
  EXPECT_TRUE(list_dir(dir.path()).empty());
}

TEST_F(MegatronTest, EmptyDatasetOpens) {
  write_megatron_dataset(prefix, {}, MegatronDType::u16);
  auto ds = MegatronDataset::open(prefix);
  EXPECT_EQ(ds->size(), 0);
  EXPECT_EQ(ds->num_documents(), 0);
  std::vector<int32_t> out(1);
  EXPECT_THROW(ds->read(0, 1, out.data()), InvalidArgumentError);
}

TEST_F(MegatronTest, ScanSpansManyChunks) {
  // More than one 1 Mi-token scan chunk, with the largest id in the last chunk.
  std::vector<int64_t> doc(3'000'000);
  Xoshiro256 rng(9);
  for (auto& v : doc) v = static_cast<int64_t>(rng.below(1000));
  doc.back() = 1234;
  write_megatron_dataset(prefix, {doc}, MegatronDType::u16);
  auto ds = MegatronDataset::open(prefix);
  EXPECT_EQ(ds->vocab_size(), 1235u);
  std::vector<int32_t> out(5);
  ds->read(2'999'995, 5, out.data());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out[i], doc[2'999'995 + i]);
}

}  // namespace
}  // namespace tessel::data
