#include "tessel/store/safetensors.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstring>

#include "tessel/core/error.h"
#include "tessel/store/test_util.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/testing/testing.h"

namespace tessel::store {
namespace {

using tessel::testing::TempDir;
using namespace tessel::store::test;

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(v >> (8 * i));
  return s;
}

// A file assembled by hand from a header text and data bytes, as another writer would.
std::string handmade(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

using tessel::testing::error_of;

TEST(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  TempDir dir;
  const DType types[] = {DType::f32, DType::bf16, DType::f16, DType::i32,
                         DType::i64, DType::u8,   DType::u16};
  std::vector<std::vector<char>> data;
  std::vector<SafetensorsTensor> tensors;
  int k = 0;
  for (DType t : types) {
    Shape shape{3, k + 1, 2};
    data.push_back(random_bytes(size_t(shape.numel()) * dtype_size(t), uint32_t(k)));
    tensors.push_back({"t." + std::string(dtype_name(t)), t, shape, data.back().data()});
    ++k;
  }
  tensors.push_back({"scalar", DType::f32, Shape{}, data[0].data()});
  tensors.push_back({"empty", DType::bf16, Shape{0, 4}, nullptr});
  const auto path = (dir / "a.safetensors").string();
  const uint64_t size = write_safetensors(path, tensors, {{"format", "pt"}, {"k", "v"}});
  EXPECT_EQ(size, std::filesystem::file_size(path));

  auto r = SafetensorsReader::open(path);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("k"), "v");
  ASSERT_EQ(r.tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& e = r.at(tensors[i].name);
    EXPECT_EQ(e.dtype, tensors[i].dtype);
    EXPECT_EQ(e.shape, tensors[i].shape);
    std::vector<char> back(e.nbytes);
    r.read(e.name, back.data());
    if (e.nbytes) {
      EXPECT_EQ(std::memcmp(back.data(), tensors[i].data, e.nbytes), 0) << e.name;
    }
  }
  EXPECT_EQ(r.find("nope"), nullptr);
  EXPECT_THROW(r.at("nope"), InvalidArgumentError);
}

TEST(Safetensors, LayoutFollowsHuggingFace) {
  TempDir dir;
  std::vector<char> buf(1024);
  const auto path = (dir / "a.safetensors").string();
  write_safetensors(path, {{"b", DType::u8, Shape{3}, buf.data()},
                           {"a", DType::bf16, Shape{3}, buf.data()},
                           {"c", DType::f32, Shape{2}, buf.data()},
                           {"d", DType::i64, Shape{1}, buf.data()}});
  const auto bytes = read_file(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
  EXPECT_EQ((8 + n) % 8, 0u) << "data must start 8-aligned";
  const std::string header = bytes.substr(8, n);
  const size_t end = header.find_last_not_of(' ');
  EXPECT_EQ(header[end], '}');
  EXPECT_LT(header.size() - end - 1, 8u) << "padding is at most 7 spaces";
  auto j = nlohmann::json::parse(header);
  // Decreasing element size, then name: i64 d, f32 c, bf16 a, u8 b, back to back.
  EXPECT_EQ(j["d"]["data_offsets"], nlohmann::json({0, 8}));
  EXPECT_EQ(j["c"]["data_offsets"], nlohmann::json({8, 16}));
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::json({16, 22}));
  EXPECT_EQ(j["b"]["data_offsets"], nlohmann::json({22, 25}));
  EXPECT_EQ(j["c"]["dtype"], "F32");
  EXPECT_EQ(j["a"]["dtype"], "BF16");
  EXPECT_EQ(bytes.size(), 8 + n + 25);
}

// Hugging Face's own serializer tests pin these exact bytes (header text, 8-byte padding with
// spaces, little-endian length, data right after).
TEST(Safetensors, WritesTheBytesHuggingFaceWrites) {
  TempDir dir;
  const float x[6] = {0, 1, 2, 3, 4, 5};
  const auto path = (dir / "a.safetensors").string();
  write_safetensors(path, {{"attn0", DType::f32, Shape{1, 1, 2, 3}, x}});
  const std::string header =
      R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + std::string(7, ' ');
  EXPECT_EQ(read_file(path), le64(72) + header + std::string(reinterpret_cast<const char*>(x), 24));
  write_safetensors(path, {}, {{"framework", "pt"}});
  EXPECT_EQ(read_file(path), le64(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
  write_safetensors(path, {});
  EXPECT_EQ(read_file(path), le64(8) + "{}      ");
  EXPECT_TRUE(SafetensorsReader::open(path).tensors().empty());
}

TEST(Safetensors, ReadsAFileWrittenByAnotherWriter) {
  TempDir dir;
  const float a[2] = {1.5f, -2.0f};
  const int64_t b[1] = {42};
  std::string data(reinterpret_cast<const char*>(b), 8);
  data += std::string(reinterpret_cast<const char*>(a), 8);
  // Keys in any order, extra whitespace, metadata, no padding: all valid.
  const std::string header =
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, "__metadata__": )"
      R"({"format": "pt"}, "b": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}})";
  write_file(dir / "x.safetensors", handmade(header, data));
  auto r = SafetensorsReader::open((dir / "x.safetensors").string());
  float back[2];
  r.read("a", back);
  EXPECT_EQ(back[0], 1.5f);
  EXPECT_EQ(back[1], -2.0f);
  int64_t v;
  r.read("b", &v);
  EXPECT_EQ(v, 42);
  EXPECT_EQ(r.metadata().at("format"), "pt");
}

TEST(Safetensors, ReadingABoxReadsOnlyItsBytes) {
  TempDir dir;
  const Shape shape{6, 5, 7};
  const auto data = random_bytes(size_t(shape.numel()) * 2, 3);
  const auto path = (dir / "a.safetensors").string();
  write_safetensors(path, {{"x", DType::bf16, shape, data.data()}});
  auto r = SafetensorsReader::open(path);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> lo(3), hi(3);
    for (size_t d = 0; d < 3; ++d) {
      std::uniform_int_distribution<int64_t> u(0, shape[d]);
      int64_t p = u(rng), q = u(rng);
      lo[d] = std::min(p, q);
      hi[d] = std::max(p, q);
    }
    const Box box(lo, hi);
    std::vector<char> got(size_t(box.volume()) * 2), want(got.size());
    pack_box(data.data(), shape, box, want.data(), 2);
    const uint64_t before = r.bytes_read();
    r.read_box("x", box, got.data());
    EXPECT_EQ(got, want) << box.str();
    EXPECT_EQ(r.bytes_read() - before, uint64_t(box.volume()) * 2) << box.str();
  }
  // A box of whole rows is one read; a column is one read per row.
  uint64_t calls = r.read_calls();
  std::vector<char> buf(1000);
  r.read_box("x", Box({2, 0, 0}, {4, 5, 7}), buf.data());
  EXPECT_EQ(r.read_calls() - calls, 1u);
  calls = r.read_calls();
  r.read_box("x", Box({0, 0, 3}, {6, 5, 4}), buf.data());
  EXPECT_EQ(r.read_calls() - calls, 30u);
  EXPECT_THROW(r.read_box("x", Box({0, 0, 0}, {7, 5, 7}), buf.data()), InvalidArgumentError);
}

TEST(Safetensors, WriterRejectsBadNames) {
  TempDir dir;
  float x = 0;
  const auto path = (dir / "a.safetensors").string();
  EXPECT_THROW(
      write_safetensors(path, {{"a", DType::f32, Shape{1}, &x}, {"a", DType::i32, Shape{1}, &x}}),
      InvalidArgumentError);
  EXPECT_THROW(write_safetensors(path, {{"__metadata__", DType::f32, Shape{1}, &x}}),
               InvalidArgumentError);
  EXPECT_THROW(write_safetensors(path, {{"a", DType::f32, Shape{1}, nullptr}}),
               InvalidArgumentError);
  EXPECT_FALSE(std::filesystem::exists(path));
}

class SafetensorsCorrupt : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = random_bytes(64, 1);
    write_safetensors(path(), {{"w", DType::f32, Shape{4, 2}, data_.data()},
                               {"b", DType::f32, Shape{8}, data_.data() + 32}});
    bytes_ = read_file(path());
  }
  std::string path() const { return (dir_ / "m.safetensors").string(); }
  std::string open_error(const std::string& bytes) {
    write_file(path(), bytes);
    return error_of<CorruptDataError>([&] { SafetensorsReader::open(path()); });
  }
  std::string header() const { return bytes_.substr(8, bytes_.size() - 8 - 64); }
  std::string data() const { return bytes_.substr(bytes_.size() - 64); }

  TempDir dir_;
  std::vector<char> data_;
  std::string bytes_;
};

TEST_F(SafetensorsCorrupt, TruncatedFileFailsAtOpenNamingTheFile) {
  auto msg = open_error(bytes_.substr(0, bytes_.size() - 1));
  EXPECT_NE(msg.find("m.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  msg = open_error(bytes_.substr(0, 20));
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  msg = open_error(bytes_.substr(0, 5));
  EXPECT_NE(msg.find("too short"), std::string::npos) << msg;
  msg = open_error(bytes_ + "x");
  EXPECT_NE(msg.find("accounts for only"), std::string::npos) << msg;
}

TEST_F(SafetensorsCorrupt, HeaderDamageIsDetected) {
  EXPECT_NE(open_error(le64(1ull << 40) + bytes_.substr(8)).find("100 MB"), std::string::npos);
  EXPECT_NE(open_error(handmade("[1,2,3]  ", data())).find("start with '{'"), std::string::npos);
  EXPECT_NE(open_error(handmade("{\"w\": 3", data())).find("not valid JSON"), std::string::npos);
  auto h = header();
  // Offsets that no longer match the shape, overlap, or leave a gap: each names the tensor.
  auto replace = [&](std::string from, std::string to) {
    auto s = h;
    auto at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    s.replace(at, from.size(), to);
    return handmade(s, data());
  };
  auto msg = open_error(replace("[4,2]", "[4,3]"));
  EXPECT_NE(msg.find("tensor 'w'"), std::string::npos) << msg;
  msg = open_error(replace("\"data_offsets\":[32,64]", "\"data_offsets\":[16,48]"));
  EXPECT_NE(msg.find("overlaps"), std::string::npos) << msg;
  msg = open_error(replace("\"F32\",\"shape\":[4,2]", "\"Q32\",\"shape\":[4,2]"));
  EXPECT_NE(msg.find("unknown dtype 'Q32'"), std::string::npos) << msg;
  write_file(path(), replace("\"F32\",\"shape\":[4,2],\"data_offsets\":[32,64]",
                             "\"F64\",\"shape\":[2,2],\"data_offsets\":[32,64]"));
  auto unsupported = error_of<UnsupportedError>([&] { SafetensorsReader::open(path()); });
  EXPECT_NE(unsupported.find("F64"), std::string::npos) << unsupported;
  EXPECT_NE(unsupported.find("'w'"), std::string::npos) << unsupported;
  msg = open_error(replace("\"data_offsets\":[32,64]", "\"data_offsets\":[40,72]"));
  EXPECT_NE(msg.find("gap"), std::string::npos) << msg;
}

TEST(Safetensors, MissingFileIsAnIoError) {
  TempDir dir;
  auto msg = error_of<IoError>([&] { SafetensorsReader::open((dir / "none").string()); });
  EXPECT_NE(msg.find("none"), std::string::npos);
}

}  // namespace
}  // namespace tessel::store
