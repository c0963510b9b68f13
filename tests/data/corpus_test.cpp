#include "runtime/data/corpus.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/data/loader.h"
#include "runtime/data/pretokenize.h"
#include "runtime/data/shard.h"
#include "runtime/data/tokenizer.h"
#include "runtime/data/unicode.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::error_of;
using testing::TempDir;
using testing::write_bytes;

std::vector<uint32_t> all_tokens(const std::vector<std::string>& shards) {
  std::vector<uint32_t> out;
  for (const auto& path : shards) {
    auto s = TokenShard::open(path);
    std::vector<uint32_t> t(static_cast<size_t>(s->size()));
    s->read(0, s->size(), t.data());
    out.insert(out.end(), t.begin(), t.end());
  }
  return out;
}

std::string some_text(int lines) {
  std::string s;
  for (int i = 0; i < lines; ++i) {
    s += "Line " + std::to_string(i) + ": the quick brown fox, café №" + std::to_string(i * 7) +
         "\n";
  }
  return s;
}

TEST(Corpus, ByteShardsWithEvalSplitAndRolling) {
  TempDir dir;
  const std::string a = some_text(50), b = some_text(30);
  write_bytes(dir.file("a.txt"), a);
  write_bytes(dir.file("b.txt"), b);
  auto tok = make_byte_tokenizer();
  TextShardOptions o;
  o.out_dir = dir.file("out");
  o.shard_tokens = 300;
  o.eval_fraction = 0.25;
  ShardSet set = tokenize_text_files({dir.file("a.txt"), dir.file("b.txt")}, *tok, o);
  const int64_t total = static_cast<int64_t>(a.size() + b.size());  // no end-of-text for bytes
  EXPECT_EQ(set.train_tokens + set.eval_tokens, total);
  EXPECT_EQ(set.eval_tokens, static_cast<int64_t>(total * 0.25));
  EXPECT_EQ(set.vocab_size, 256);
  ASSERT_EQ(set.file_tokens.size(), 2u);
  EXPECT_EQ(set.file_tokens[0].second, static_cast<int64_t>(a.size()));
  EXPECT_GT(set.train_shards.size(), 1u);
  EXPECT_GT(set.eval_shards.size(), 1u);
  for (const auto& p : set.train_shards) EXPECT_LE(TokenShard::open(p)->size(), 300);
  auto train = all_tokens(set.train_shards), eval = all_tokens(set.eval_shards);
  EXPECT_EQ(static_cast<int64_t>(train.size()), set.train_tokens);
  std::string joined(train.begin(), train.end());
  joined.append(eval.begin(), eval.end());
  EXPECT_EQ(joined, a + b);
  // Exactly the files listed, nothing left from the split.
  size_t tok_files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(o.out_dir)) {
    tok_files += e.path().extension() == ".tok";
    EXPECT_NE(e.path().extension(), ".tmp");
  }
  EXPECT_EQ(set.train_shards[0], o.out_dir + "/train/train-00000.tok");
  EXPECT_EQ(set.eval_shards[0], o.out_dir + "/eval/eval-00000.tok");
  EXPECT_EQ(tok_files, set.train_shards.size() + set.eval_shards.size());
  std::ifstream in(o.out_dir + "/manifest.json");
  auto manifest = nlohmann::json::parse(in);
  EXPECT_EQ(manifest["train_tokens"], set.train_tokens);
  EXPECT_EQ(manifest["eval_shards"].size(), set.eval_shards.size());
  EXPECT_EQ(manifest["train_shards"][0], "train/train-00000.tok");
  EXPECT_EQ(manifest["tokenizer"], "byte-level (vocab 256)");

  // A second run into the same folder replaces the shards.
  o.eval_fraction = 0.0;
  o.shard_tokens = 1 << 20;
  set = tokenize_text_files({dir.file("b.txt")}, *tok, o);
  EXPECT_EQ(set.train_shards.size(), 1u);
  EXPECT_TRUE(set.eval_shards.empty());
  tok_files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(o.out_dir)) {
    tok_files += e.path().extension() == ".tok";
  }
  EXPECT_EQ(tok_files, 1u);
}

// A BPE with <|endoftext|> gets it after every file; big files are read in pieces, and the ids
// equal those of encoding the whole text at once, for both pre-tokenizer patterns.
TEST(Corpus, BpePiecesEqualWholeTextAndEndOfText) {
  TempDir dir;
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    utf8_append(&s, byte_to_unicode(static_cast<uint8_t>(b)));
    vocab[s] = b;
  }
  vocab["Ġt"] = 256;
  vocab["he"] = 257;
  vocab["Ġthe"] = 258;
  vocab["ĊĊ"] = 259;
  nlohmann::json gpt2 = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  nlohmann::json llama3 = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", kLlama3SplitRegex}}}, {"behavior", "Isolated"}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  // Lines that end in a space, a non-ASCII space, punctuation, blank lines, digits after newlines.
  const char* lines[] = {"the cat\n\n", "  and the\n", "the end \n", "x\u3000\n", "12 cats.\n",
                         "\n",          "(the)\n",     "naïve\n",    "\t\n"};
  std::string big;
  for (int i = 0; i < 4000; ++i) big += lines[(i * 7 + i / 9) % 9];
  write_bytes(dir.file("big.txt"), big);  // read in many 4 KB pieces
  write_bytes(dir.file("small.txt"), "the end");
  for (const auto& pre : {gpt2, llama3}) {
    nlohmann::json j = {
        {"added_tokens", {{{"id", 260}, {"content", "<|endoftext|>"}, {"special", true}}}},
        {"pre_tokenizer", pre},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"Ġ t", "h e", "Ġt he", "Ċ Ċ"}}}}};
    write_bytes(dir.file("tokenizer.json"), j.dump());
    auto tok = make_tokenizer(dir.file("tokenizer.json"));
    TextShardOptions o;
    o.out_dir = dir.file("out");
    o.read_piece_bytes = 4 << 10;
    ShardSet set = tokenize_text_files({dir.file("big.txt"), dir.file("small.txt")}, *tok, o);
    std::vector<uint32_t> expected = tok->encode(big);
    expected.push_back(260);
    for (uint32_t id : tok->encode("the end")) expected.push_back(id);
    expected.push_back(260);
    EXPECT_EQ(all_tokens(set.train_shards), expected) << pre.dump();
    EXPECT_EQ(TokenShard::open(set.train_shards[0])->token_bytes(), 2);
  }
}

TEST(Corpus, EnsureShardsIsCachedAndNoticesChanges) {
  TempDir dir;
  write_bytes(dir.file("a.txt"), some_text(40));
  write_bytes(dir.file("b.txt"), some_text(20));
  const std::string cache = dir.file("cache");
  auto first = ensure_text_corpus_shards({dir.file("*.txt")}, "byte", cache);
  EXPECT_TRUE(first.built);
  EXPECT_EQ(first.vocab_size, 256);
  EXPECT_EQ(first.tokens, static_cast<int64_t>(some_text(40).size() + some_text(20).size()));
  auto again = ensure_text_corpus_shards({dir.file("*.txt")}, "byte", cache);
  EXPECT_FALSE(again.built);
  EXPECT_EQ(again.shards, first.shards);

  // Changing a file (size and time) means a new cache entry.
  write_bytes(dir.file("b.txt"), some_text(21));
  auto changed = ensure_text_corpus_shards({dir.file("*.txt")}, "byte", cache);
  EXPECT_TRUE(changed.built);
  EXPECT_NE(changed.dir, first.dir);
  // No temporary folders left behind.
  for (const auto& e : std::filesystem::directory_iterator(cache)) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  }

  EXPECT_NE(error_of([&] {
              ensure_text_corpus_shards({dir.file("none.txt")}, "byte", cache);
            }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ensure_text_corpus_shards({dir.path().string()}, "byte", cache);
            }).find("is a folder"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ensure_text_corpus_shards({dir.file("a.txt")}, "gpt9", cache);
            }).find("tokenizer 'gpt9'"),
            std::string::npos);
}

TEST(Corpus, TextSourceTrainsFromTextFiles) {
  TempDir dir;
  const std::string text = some_text(100);
  write_bytes(dir.file("t.txt"), text);
  DataOptions o;
  o.source = DataSource::Text;
  o.text_files = {dir.file("t.txt")};
  o.tokenizer = "byte";
  o.cache_dir = dir.file("cache");
  o.seq_len = 32;
  o.micro_batch_size = 2;
  o.vocab_size = 256;
  o.eval_fraction = 0.1;
  auto d = make_data_sources(o);
  ASSERT_TRUE(d.eval);
  const int64_t samples = (static_cast<int64_t>(text.size()) - 1) / 32;
  EXPECT_EQ(d.train->position().num_samples + d.eval->position().num_samples, samples);
  Batch b = d.train->next();
  const int64_t* in = b.input_ids.data<int64_t>();
  const std::string window(in, in + 32);
  EXPECT_NE(text.find(window), std::string::npos) << "samples are windows of the text";
  o.cache_dir.clear();
  EXPECT_THROW(make_data_sources(o), std::invalid_argument);
}

TEST(Corpus, BadOptions) {
  TempDir dir;
  auto tok = make_byte_tokenizer();
  write_bytes(dir.file("a.txt"), "ab");
  TextShardOptions o;
  o.out_dir = dir.file("out");
  o.eval_fraction = 0.1;  // 2 tokens: nothing to hold out
  EXPECT_NE(error_of([&] { tokenize_text_files({dir.file("a.txt")}, *tok, o); }).find("too few"),
            std::string::npos);
  o.eval_fraction = 0;
  o.shard_tokens = 0;
  EXPECT_THROW(tokenize_text_files({dir.file("a.txt")}, *tok, o), std::invalid_argument);
  o.shard_tokens = 10;
  EXPECT_NE(error_of([&] { tokenize_text_files({dir.file("zz.txt")}, *tok, o); }).find("zz.txt"),
            std::string::npos);
}

// Issue 26: an empty text file was reported as "data.text_files (): ... 0 tokens".
TEST(Corpus, AnEmptyTextFileIsNamed) {
  TempDir dir;
  write_bytes(dir.file("empty.txt"), "");
  DataOptions o;
  o.source = DataSource::Text;
  o.text_files = {dir.file("empty.txt")};
  o.cache_dir = dir.file("cache");
  o.seq_len = 32;
  o.micro_batch_size = 2;
  std::string err = error_of([&] { make_data_sources(o); });
  EXPECT_NE(err.find("data.text_files (" + dir.file("empty.txt") + "): the corpus is smaller"),
            std::string::npos)
      << err;
  auto tok = make_byte_tokenizer();
  TextShardOptions t;
  t.out_dir = dir.file("out");
  t.eval_fraction = 0.1;
  err = error_of([&] { tokenize_text_files({dir.file("empty.txt")}, *tok, t); });
  EXPECT_NE(err.find("the text (" + dir.file("empty.txt") + ") holds 0 tokens"), std::string::npos)
      << err;
}

}  // namespace
}  // namespace accel
