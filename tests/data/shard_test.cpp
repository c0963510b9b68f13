#include "runtime/data/shard.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::error_of;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

std::vector<uint32_t> ramp(size_t n, uint32_t mod) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint32_t>((i * 7919u + 3u) % mod);
  return v;
}

TEST(Shard, RoundTripUint16) {
  TempDir dir;
  const auto tokens = ramp(100000, 50257);
  write_token_shard(dir.file("a.tok"), tokens, 50257);
  EXPECT_EQ(std::filesystem::file_size(dir.file("a.tok")), 64u + 2u * tokens.size());
  EXPECT_FALSE(std::filesystem::exists(dir.file("a.tok.tmp")));
  auto s = TokenShard::open(dir.file("a.tok"));
  EXPECT_EQ(s->size(), 100000);
  EXPECT_EQ(s->vocab_size(), 50257);
  EXPECT_EQ(s->token_bytes(), 2);
  std::vector<int64_t> got(tokens.size());
  s->read(0, s->size(), got.data());
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(got[i], tokens[i]) << i;
  EXPECT_EQ(s->at(12345), tokens[12345]);
  EXPECT_EQ(s->max_token(0, s->size()), *std::max_element(tokens.begin(), tokens.end()));
}

TEST(Shard, RoundTripUint32AndHeaderLayout) {
  TempDir dir;
  const auto tokens = ramp(5000, 128256);
  write_token_shard(dir.file("b.tok"), tokens, 128256);
  const std::string bytes = read_bytes(dir.file("b.tok"));
  ASSERT_EQ(bytes.size(), 64u + 4u * tokens.size());
  EXPECT_EQ(bytes.substr(0, 8), "ACCELTOK");
  uint32_t version, width;
  uint64_t count, vocab;
  memcpy(&version, bytes.data() + 8, 4);
  memcpy(&width, bytes.data() + 12, 4);
  memcpy(&count, bytes.data() + 16, 8);
  memcpy(&vocab, bytes.data() + 24, 8);
  EXPECT_EQ(version, 1u);
  EXPECT_EQ(width, 4u);
  EXPECT_EQ(count, 5000u);
  EXPECT_EQ(vocab, 128256u);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(bytes[i], 0) << i;
  uint32_t first;
  memcpy(&first, bytes.data() + 64, 4);
  EXPECT_EQ(first, tokens[0]);

  auto s = TokenShard::open(dir.file("b.tok"));
  EXPECT_EQ(s->token_bytes(), 4);
  std::vector<uint32_t> got(10);
  s->read(4990, 10, got.data());
  for (int i = 0; i < 10; ++i) EXPECT_EQ(got[i], tokens[4990 + i]);
  EXPECT_THROW(s->read(4995, 10, got.data()), std::out_of_range);
}

TEST(Shard, WidthFollowsVocab) {
  EXPECT_EQ(shard_token_bytes(256), 2);
  EXPECT_EQ(shard_token_bytes(65536), 2);
  EXPECT_EQ(shard_token_bytes(65537), 4);
  EXPECT_EQ(shard_token_bytes(128256), 4);
}

TEST(Shard, EmptyShardIsValid) {
  TempDir dir;
  write_token_shard(dir.file("e.tok"), {}, 256);
  EXPECT_EQ(TokenShard::open(dir.file("e.tok"))->size(), 0);
}

TEST(Shard, WriterRejectsOutOfRangeTokenAndCleansUp) {
  TempDir dir;
  {
    ShardWriter w(dir.file("c.tok"), 256);
    w.append({1, 2, 3});
    std::string err = error_of([&] { w.append({255, 256}); });
    EXPECT_NE(err.find("256"), std::string::npos) << err;
    EXPECT_NE(err.find("vocab_size"), std::string::npos) << err;
  }  // never closed: nothing left behind
  EXPECT_FALSE(std::filesystem::exists(dir.file("c.tok")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("c.tok.tmp")));
  EXPECT_THROW(ShardWriter(dir.file("d.tok"), 0), std::invalid_argument);
}

TEST(Shard, WriterStreamsManyAppends) {
  TempDir dir;
  ShardWriter w(dir.file("s.tok"), 1000);
  std::vector<uint32_t> all;
  for (int k = 0; k < 50; ++k) {
    auto part = ramp(10007, 1000);
    for (auto& t : part) t = (t + k) % 1000;
    w.append(part);
    all.insert(all.end(), part.begin(), part.end());
  }
  w.close();
  auto s = TokenShard::open(dir.file("s.tok"));
  ASSERT_EQ(s->size(), static_cast<int64_t>(all.size()));
  for (size_t i = 0; i < all.size(); i += 997) ASSERT_EQ(s->at(i), all[i]);
}

// Every malformed file gives a std::runtime_error naming the file and the problem.
class BadShard : public ::testing::Test {
 protected:
  void SetUp() override {
    write_token_shard(good_, ramp(1000, 500), 500);
    bytes_ = read_bytes(good_);
  }
  std::string open_error(const std::string& bytes) {
    write_bytes(bad_, bytes);
    std::string err;
    try {
      TokenShard::open(bad_);
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
    EXPECT_NE(err.find(bad_), std::string::npos) << "the message names the file: " << err;
    return err;
  }
  TempDir dir_;
  std::string good_ = dir_.file("good.tok");
  std::string bad_ = dir_.file("bad.tok");
  std::string bytes_;
};

TEST_F(BadShard, MissingFile) {
  std::string err = error_of([&] { TokenShard::open(dir_.file("nope.tok")); });
  EXPECT_NE(err.find("nope.tok"), std::string::npos) << err;
  EXPECT_NE(err.find("cannot open"), std::string::npos) << err;
}

TEST_F(BadShard, WrongMagic) {
  std::string b = bytes_;
  b.replace(0, 8, "GPT2DATA");
  std::string err = open_error(b);
  EXPECT_NE(err.find("magic 'GPT2DATA'"), std::string::npos) << err;
  EXPECT_NE(err.find("ACCELTOK"), std::string::npos) << err;
}

TEST_F(BadShard, BadVersion) {
  std::string b = bytes_;
  uint32_t v = 7;
  memcpy(&b[8], &v, 4);
  std::string err = open_error(b);
  EXPECT_NE(err.find("version 7"), std::string::npos) << err;
}

TEST_F(BadShard, BadTokenWidth) {
  std::string b = bytes_;
  uint32_t w = 3;
  memcpy(&b[12], &w, 4);
  EXPECT_NE(open_error(b).find("token width of 3"), std::string::npos);
}

TEST_F(BadShard, ShorterThanHeader) {
  EXPECT_NE(open_error(bytes_.substr(0, 40)).find("smaller than the 64-byte header"),
            std::string::npos);
  EXPECT_NE(open_error("").find("truncated"), std::string::npos);
}

TEST_F(BadShard, Truncated) {
  std::string err = open_error(bytes_.substr(0, bytes_.size() - 3));
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  EXPECT_NE(err.find("1000 tokens"), std::string::npos) << err;
}

TEST_F(BadShard, TrailingBytes) {
  EXPECT_NE(open_error(bytes_ + "xx").find("truncated or corrupt"), std::string::npos);
}

TEST_F(BadShard, HugeCountDoesNotOverflow) {
  std::string b = bytes_;
  uint64_t c = ~uint64_t{0} / 2 + 5;
  memcpy(&b[16], &c, 8);
  EXPECT_NE(open_error(b).find("truncated or corrupt"), std::string::npos);
}

TEST_F(BadShard, TokenAtOrAboveVocab) {
  std::string b = bytes_;
  uint16_t t = 500;  // == vocab_size
  memcpy(&b[64 + 2 * 777], &t, 2);
  std::string err = open_error(b);
  EXPECT_NE(err.find("token 500 at index 777"), std::string::npos) << err;
  EXPECT_NE(err.find("vocab_size 500"), std::string::npos) << err;
  // Not scanned when validation is off (the caller takes responsibility).
  EXPECT_EQ(TokenShard::open(bad_, false)->at(777), 500u);
}

TEST_F(BadShard, InvalidVocabSize) {
  std::string b = bytes_;
  uint64_t v = 70000;  // does not fit 2-byte tokens
  memcpy(&b[24], &v, 8);
  EXPECT_NE(open_error(b).find("invalid vocab_size 70000"), std::string::npos);
  v = 0;
  memcpy(&b[24], &v, 8);
  EXPECT_NE(open_error(b).find("invalid vocab_size 0"), std::string::npos);
}

TEST_F(BadShard, Folder) {
  EXPECT_NE(error_of([&] { TokenShard::open(dir_.path().string()); }).find("not a regular file"),
            std::string::npos);
}

}  // namespace
}  // namespace accel

namespace accel {
namespace {

// Version 2: documents with trained flags; checked on open like the header.
std::string document_shard(const testing::TempDir& dir) {
  const std::string path = dir.file("d.tok");
  ShardWriter w(path, 300, true);
  const uint32_t a[] = {5, 6, 7}, b[] = {299, 1};
  const uint8_t fa[] = {0, 1, 1}, fb[] = {1, 0};
  w.append_document(a, fa, 3);
  w.append_document(b, fb, 2);
  EXPECT_THROW(w.append(a, 3), std::logic_error);  // documents only
  w.close();
  return path;
}

TEST(DocumentShard, RoundTripAndLayout) {
  testing::TempDir dir;
  const std::string path = document_shard(dir);
  EXPECT_EQ(std::filesystem::file_size(path), 64u + 5 * 2 + 5 + 3 * 8);
  auto s = TokenShard::open(path);
  ASSERT_TRUE(s->has_documents());
  EXPECT_EQ(s->size(), 5);
  EXPECT_EQ(s->documents(), 2);
  EXPECT_EQ(s->document_start(0), 0);
  EXPECT_EQ(s->document_start(1), 3);
  EXPECT_EQ(s->document_start(2), 5);
  EXPECT_EQ(s->at(3), 299u);
  std::vector<bool> trained;
  for (int64_t i = 0; i < 5; ++i) trained.push_back(s->trained(i));
  EXPECT_EQ(trained, (std::vector<bool>{false, true, true, true, false}));
  // Version 1 shards still read: no documents, every token trained.
  write_token_shard(dir.file("v1.tok"), {1, 2, 3}, 10);
  auto v1 = TokenShard::open(dir.file("v1.tok"));
  EXPECT_FALSE(v1->has_documents());
  EXPECT_TRUE(v1->trained(2));
}

TEST(DocumentShard, CorruptionIsRefusedOnOpen) {
  testing::TempDir dir;
  const std::string good = testing::read_bytes(document_shard(dir));
  auto open_error = [&](const std::string& bytes) {
    testing::write_bytes(dir.file("bad.tok"), bytes);
    return testing::error_of([&] { TokenShard::open(dir.file("bad.tok")); });
  };
  std::string b = good;
  b[64 + 10 + 1] = 2;  // a trained flag of 2
  EXPECT_NE(open_error(b).find("trained flag of token 1 is 2"), std::string::npos);
  b = good;
  b[64 + 10 + 5 + 8] = 6;  // document 0 ends past the tokens
  EXPECT_NE(open_error(b).find("document 0 ends at token 6"), std::string::npos);
  b = good;
  b[32] = 3;  // three documents: the file is too short for their starts
  EXPECT_NE(open_error(b).find("in 3 documents"), std::string::npos);
  EXPECT_NE(open_error(good.substr(0, good.size() - 1)).find("truncated"), std::string::npos);
}

}  // namespace
}  // namespace accel
