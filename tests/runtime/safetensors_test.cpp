// safetensors reader/writer: round trips for every dtype, byte-exact output against the format's
// reference layout, and a clear error for each kind of corrupt file.
#include "runtime/safetensors.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace accel {
namespace {

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/accel_safetensors_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file from a header text and a data area, with the length prefix filled in.
std::string make_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

std::string f32_bytes(std::initializer_list<float> vals) {
  std::string s;
  for (float v : vals) s.append(reinterpret_cast<const char*>(&v), 4);
  return s;
}

// Expect opening `path` to throw a SafetensorsError whose message contains every piece.
void expect_open_error(const std::string& path, std::initializer_list<std::string> pieces) {
  try {
    SafetensorsReader r(path);
    FAIL() << "expected an error opening " << path;
  } catch (const SafetensorsError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    for (const auto& p : pieces)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' in: " << msg;
  }
}

TEST_F(SafetensorsTest, DtypeNames) {
  EXPECT_STREQ(safetensors_dtype_name(DType::E4M3), "F8_E4M3");
  EXPECT_STREQ(safetensors_dtype_name(DType::E5M2), "F8_E5M2");
  EXPECT_STREQ(safetensors_dtype_name(DType::Bool), "BOOL");
  for (int i = 0; i < kNumDTypes; ++i) {
    DType t = static_cast<DType>(i);
    EXPECT_EQ(dtype_from_safetensors_name(safetensors_dtype_name(t)), t);
  }
  EXPECT_THROW(dtype_from_safetensors_name("I16"), SafetensorsError);
}

TEST_F(SafetensorsTest, RoundTripEveryDtype) {
  std::vector<std::pair<std::string, Tensor>> ts;
  const std::vector<double> vals = {0, 1, -2, 3.5, 0.25, -0.125};
  const std::vector<double> ints = {0, 1, -7, 100, 42, -1};
  const std::vector<double> bytes = {0, 1, 7, 200, 42, 255};
  const std::vector<double> bools = {0, 1, 1, 0, 1, 0};
  for (int i = 0; i < kNumDTypes; ++i) {
    DType t = static_cast<DType>(i);
    const auto& v = t == DType::Bool                       ? bools
                    : t == DType::U8                       ? bytes
                    : (t == DType::I32 || t == DType::I64) ? ints
                                                           : vals;
    ts.push_back({std::string("t_") + dtype_name(t), Tensor::from_vector(v, {2, 3}, t)});
  }
  ts.push_back({"empty", Tensor::zeros({0, 4}, DType::F32)});
  ts.push_back({"scalar", Tensor::from_vector(std::vector<double>{7.0}, {}, DType::F64)});
  const std::string path = file("all.safetensors");
  save_safetensors(path, ts, {{"format", "pt"}, {"note", "\"quoted\" \\ and \xc3\xa9"}});

  SafetensorsReader r(path);
  EXPECT_EQ(r.names().size(), ts.size());
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("note"), "\"quoted\" \\ and \xc3\xa9");
  for (const auto& [name, t] : ts) {
    ASSERT_TRUE(r.contains(name)) << name;
    const auto& info = r.info(name);
    EXPECT_TRUE(info.supported);
    EXPECT_EQ(info.dtype, t.dtype()) << name;
    EXPECT_EQ(info.shape, t.shape()) << name;
    Tensor back = r.load(name);
    EXPECT_EQ(back.dtype(), t.dtype());
    EXPECT_EQ(back.shape(), t.shape());
    EXPECT_TRUE(back.device().is_cpu());
    ASSERT_EQ(back.nbytes(), t.nbytes());
    if (t.nbytes()) {
      EXPECT_EQ(std::memcmp(back.data_ptr(), t.data_ptr(), t.nbytes()), 0) << name;
    }
    // Every tensor's data is aligned to its element size within the file.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r.raw_data(name)) % dtype_size(t.dtype()), 0u) << name;
  }
  // No temporary left behind.
  struct stat st;
  EXPECT_NE(stat((path + ".tmp").c_str(), &st), 0);
}

TEST_F(SafetensorsTest, DataOrderIsDescendingAlignmentThenName) {
  const std::string path = file("order.safetensors");
  save_safetensors(path, {{"z_u8", Tensor::zeros({3}, DType::U8)},
                          {"b_f32", Tensor::zeros({1}, DType::F32)},
                          {"a_bf16", Tensor::zeros({3}, DType::BF16)},
                          {"a_f32", Tensor::zeros({2}, DType::F32)},
                          {"i64", Tensor::zeros({1}, DType::I64)}});
  SafetensorsReader r(path);
  EXPECT_EQ(r.names(), (std::vector<std::string>{"i64", "a_f32", "b_f32", "a_bf16", "z_u8"}));
  EXPECT_EQ(r.info("a_bf16").data_begin, 8u + 8u + 4u);
}

// The byte layouts below follow the format specification and the reference implementation's
// own serialization tests (huggingface/safetensors).
TEST_F(SafetensorsTest, WriterMatchesTheFormatByteForByte) {
  {
    const std::string path = file("a.safetensors");
    save_safetensors(path, {{"attn.0", Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5},
                                                           {1, 2, 3}, DType::F32)}});
    const std::string header =
        R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
    ASSERT_EQ(header.size(), 64u);  // already a multiple of 8: no padding
    EXPECT_EQ(read_bytes(path), make_file(header, f32_bytes({0, 1, 2, 3, 4, 5})));
  }
  {
    // A 65-byte header gets 7 spaces so the data starts 8-byte aligned.
    const std::string path = file("b.safetensors");
    save_safetensors(path, {{"attn0", Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5},
                                                          {1, 1, 2, 3}, DType::F32)}});
    const std::string header =
        std::string(R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})") +
        "       ";
    ASSERT_EQ(header.size(), 72u);
    EXPECT_EQ(read_bytes(path), make_file(header, f32_bytes({0, 1, 2, 3, 4, 5})));
  }
  {
    const std::string path = file("empty.safetensors");
    save_safetensors(path, {});
    EXPECT_EQ(read_bytes(path), make_file("{}      ", ""));
    save_safetensors(path, {}, {{"framework", "pt"}});  // overwrites in place
    EXPECT_EQ(read_bytes(path),
              make_file(std::string(R"({"__metadata__":{"framework":"pt"}})") + "     ", ""));
  }
  {
    // Mixed dtypes: __metadata__ first, then data order (F32 before BF16), bf16 bits verbatim.
    const std::string path = file("mixed.safetensors");
    Tensor bf = Tensor::from_vector(std::vector<float>{1.0f, -2.0f}, {2}, DType::BF16);
    Tensor f = Tensor::from_vector(std::vector<float>{0.5f}, {1}, DType::F32);
    save_safetensors(path, {{"a", bf}, {"b", f}}, {{"format", "pt"}});
    std::string header = R"({"__metadata__":{"format":"pt"},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}})";
    header.append((8 - header.size() % 8) % 8, ' ');
    const std::string data = f32_bytes({0.5f}) + std::string("\x80\x3f\x00\xc0", 4);
    EXPECT_EQ(read_bytes(path), make_file(header, data));
  }
}

TEST_F(SafetensorsTest, ReadsAHandWrittenFile) {
  // Entries out of data order in the JSON, an extra unknown field, whitespace padding.
  const std::string header =
      R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24], "extra": 1},)"
      R"( "ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},)"
      R"( "__metadata__": {"format": "pt"}}   )";
  std::string data;
  int64_t id = -5;
  data.append(reinterpret_cast<const char*>(&id), 8);
  data += f32_bytes({1, 2, 3, 4});
  const std::string path = file("hand.safetensors");
  write_bytes(path, make_file(header, data));
  SafetensorsReader r(path);
  EXPECT_EQ(r.names(), (std::vector<std::string>{"ids", "w"}));
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.load("w").to_vector(), (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(r.load("ids").to_vector(), (std::vector<double>{-5}));
  try {
    r.info("nope");
    FAIL();
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor named 'nope'"), std::string::npos);
  }
}

TEST_F(SafetensorsTest, SavesNonContiguousTensors) {
  Tensor t = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3}, DType::F32);
  Tensor tt = t.as_strided({3, 2}, {1, 3}, 0);  // transpose view
  ASSERT_FALSE(tt.is_contiguous());
  Tensor sl = t.as_strided({2}, {1}, 4);  // a view with an offset: {5, 6}
  const std::string path = file("views.safetensors");
  save_safetensors(path, {{"t", tt}, {"s", sl}});
  SafetensorsReader r(path);
  EXPECT_EQ(r.load("t").to_vector(), (std::vector<double>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(r.load("s").to_vector(), (std::vector<double>{5, 6}));
}

TEST_F(SafetensorsTest, WriterRejectsBadNames) {
  Tensor t = Tensor::zeros({1});
  EXPECT_THROW(save_safetensors(file("x"), {{"a", t}, {"a", t}}), SafetensorsError);
  EXPECT_THROW(save_safetensors(file("x"), {{"", t}}), SafetensorsError);
  EXPECT_THROW(save_safetensors(file("x"), {{"__metadata__", t}}), SafetensorsError);
  EXPECT_THROW(save_safetensors(file("x"), {{"u", Tensor()}}), SafetensorsError);
  EXPECT_THROW(save_safetensors(dir_ + "/no/such/dir/x", {{"a", t}}), SafetensorsError);
}

TEST_F(SafetensorsTest, MissingFile) {
  expect_open_error(file("absent.safetensors"), {"cannot open"});
}

TEST_F(SafetensorsTest, CorruptFiles) {
  const std::string good_header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string good_data = f32_bytes({1, 2});
  auto check = [&](const std::string& name, const std::string& bytes,
                   std::initializer_list<std::string> pieces) {
    SCOPED_TRACE(name);
    const std::string path = file(name);
    write_bytes(path, bytes);
    expect_open_error(path, pieces);
  };
  // Sanity: the good file opens.
  write_bytes(file("good"), make_file(good_header, good_data));
  EXPECT_NO_THROW(SafetensorsReader r(file("good")));

  check("short", std::string("\x10\x00\x00", 3), {"truncated", "3 bytes"});
  check("truncated_data", make_file(good_header, good_data.substr(0, 5)),
        {"tensor 'w'", "outside the data area"});
  check("huge_length", le64(uint64_t(1) << 40) + good_header + good_data,
        {"header length", "limit"});
  check("length_past_end", le64(good_header.size() + 100) + good_header + good_data,
        {"header length", "past the end"});
  check("bad_json", make_file(R"({"w":{"dtype":"F32",)", good_data), {"not valid JSON"});
  check("not_object", make_file("[1, 2, 3]", ""), {"not a JSON object"});
  check("offsets_outside",
        make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,800]}})", good_data),
        {"tensor 'w'", "outside the data area"});
  check("offsets_reversed",
        make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", good_data),
        {"tensor 'w'", "end before they begin"});
  check("size_mismatch",
        make_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", good_data),
        {"tensor 'w'", "span 8 bytes", "needs 12 bytes"});
  check("unknown_dtype",
        make_file(R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", good_data),
        {"tensor 'w'", "unknown dtype 'F33'"});
  check("missing_field", make_file(R"({"w":{"dtype":"F32","shape":[2]}})", good_data),
        {"tensor 'w'", "missing field 'data_offsets'"});
  check("negative_dim",
        make_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", good_data),
        {"tensor 'w'", "non-negative"});
  check(
      "bad_metadata",
      make_file(R"({"__metadata__":{"k":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                good_data),
      {"__metadata__", "'k'", "must be a string"});
  check("overlap",
        make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  good_data),
        {"tensor 'b'", "overlaps tensor 'a'"});
  check("gap", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", good_data),
        {"tensor 'a'", "gap"});
  check("trailing", make_file(good_header, good_data + "xxxx"), {"cover 8 bytes", "holds 12"});
}

TEST_F(SafetensorsTest, KnownButUnsupportedDtypeFailsOnLoadOnly) {
  const std::string path = file("i16.safetensors");
  write_bytes(path, make_file(R"({"h":{"dtype":"I16","shape":[2],"data_offsets":[0,4]},)"
                              R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              std::string(4, '\0') + f32_bytes({3})));
  SafetensorsReader r(path);
  EXPECT_FALSE(r.info("h").supported);
  EXPECT_EQ(r.info("h").dtype_name, "I16");
  EXPECT_EQ(r.load("w").to_vector(), (std::vector<double>{3}));
  try {
    r.load("h");
    FAIL();
  } catch (const SafetensorsError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("tensor 'h'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("I16"), std::string::npos) << msg;
  }
}

// Found while writing tests/fuzz/fuzz_safetensors.cpp: an empty tensor whose other dims multiply
// past int64 passed the element-count check (0 elements), then overflowed the contiguous strides
// (signed overflow, UBSan) when loaded.
TEST_F(SafetensorsTest, EmptyTensorWithHugeDimsIsRejected) {
  const std::string path = file("huge_empty");
  write_bytes(path, make_file(R"({"w":{"dtype":"F32","shape":[0,1099511627776,1099511627776],)"
                              R"("data_offsets":[0,0]}})",
                              ""));
  expect_open_error(path, {"tensor 'w'", "overflows"});
  write_bytes(file("ok_empty"), make_file(R"({"w":{"dtype":"F32","shape":[0,1024,1024],)"
                                          R"("data_offsets":[0,0]}})",
                                          ""));
  EXPECT_NO_THROW(SafetensorsReader r(file("ok_empty")));
}

// Issue 26 #2: a 200 KB header nested 100,000 levels deep overflowed the stack (the entry went
// into the error message through a recursive dump).
TEST_F(SafetensorsTest, DeeplyNestedHeaderIsAnError) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string path = file("deep");
  write_bytes(path, make_file("{\"a\":" + deep + "}", ""));
  expect_open_error(path, {"header: JSON nests arrays/objects deeper than 256 levels"});
  write_bytes(
      path, make_file(R"({"w":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})", ""));
  expect_open_error(path, {"deeper than"});
  // Shallow but long: the message shows an excerpt of the entry.
  std::string many;
  for (int i = 0; i < 50000; ++i) many += "1,";
  write_bytes(path, make_file("{\"a\":[" + many + "1]}", ""));
  try {
    SafetensorsReader r(path);
    FAIL();
  } catch (const SafetensorsError& e) {
    EXPECT_LT(std::string(e.what()).size(), 300u) << e.what();
  }
}

}  // namespace
}  // namespace accel
