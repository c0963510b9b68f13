// JSONL reading: plain / gzip / zstd lines, format detection, documents with trained flags, and
// the errors that name file and line.
#include "runtime/data/jsonl.h"

#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <nlohmann/json.hpp>

#include "runtime/data/chat_template.h"
#include "runtime/data/shard.h"
#include "runtime/data/tokenizer.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::error_of;
using testing::TempDir;
using testing::write_bytes;

void write_gzip(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_TRUE(f);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  gzclose(f);
}

void write_zstd(const std::string& path, const std::string& bytes) {
  std::string out(ZSTD_compressBound(bytes.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), 3);
  ASSERT_FALSE(ZSTD_isError(n));
  out.resize(n);
  write_bytes(path, out);
}

std::vector<std::string> lines_of(const std::string& path) {
  LineReader r(path);
  std::vector<std::string> out;
  std::string line;
  while (r.next(&line)) {
    out.push_back(line);
    EXPECT_EQ(r.line_number(), static_cast<int64_t>(out.size()));
  }
  return out;
}

TEST(LineReader, PlainGzipAndZstdGiveTheSameLines) {
  TempDir dir;
  // CRLF, a long line (past the reader's 1 MiB pieces) and a last line without a newline.
  const std::string long_line(3 << 20, 'x');
  const std::string text = "{\"a\": 1}\r\n" + long_line + "\n\n{\"b\": 2}";
  const std::vector<std::string> want = {"{\"a\": 1}", long_line, "", "{\"b\": 2}"};
  write_bytes(dir.file("a.jsonl"), text);
  write_gzip(dir.file("a.jsonl.gz"), text);
  write_zstd(dir.file("a.jsonl.zst"), text);
  EXPECT_EQ(lines_of(dir.file("a.jsonl")), want);
  EXPECT_EQ(lines_of(dir.file("a.jsonl.gz")), want);
  EXPECT_EQ(lines_of(dir.file("a.jsonl.zst")), want);
}

TEST(LineReader, CorruptCompressedFilesAreErrorsNamingTheFile) {
  TempDir dir;
  write_bytes(dir.file("bad.jsonl.zst"), "not zstd at all");
  EXPECT_NE(error_of([&] {
              lines_of(dir.file("bad.jsonl.zst"));
            }).find("bad.jsonl.zst': is not valid zstd"),
            std::string::npos);
  // A zstd frame cut in the middle.
  write_zstd(dir.file("cut.jsonl.zst"), std::string(100000, 'y') + "\n");
  std::string bytes = testing::read_bytes(dir.file("cut.jsonl.zst"));
  write_bytes(dir.file("cut.jsonl.zst"), bytes.substr(0, bytes.size() / 2));
  EXPECT_NE(error_of([&] { lines_of(dir.file("cut.jsonl.zst")); }).find("cut.jsonl.zst"),
            std::string::npos);
  EXPECT_NE(error_of([&] { lines_of(dir.file("missing.jsonl")); }).find("cannot open"),
            std::string::npos);
}

JsonlOptions opts(DataFormat f = DataFormat::Auto) {
  JsonlOptions o;
  o.format = f;
  return o;
}

TEST(JsonlFormat, DetectedFromTheFirstLineAndSaidWhy) {
  std::string why;
  EXPECT_EQ(detect_jsonl_format(nlohmann::json::parse(R"({"messages": []})"), opts(), "f:1", &why),
            DataFormat::Messages);
  EXPECT_NE(why.find("messages (f:1 has a 'messages' field)"), std::string::npos) << why;
  EXPECT_EQ(detect_jsonl_format(nlohmann::json::parse(R"({"prompt": "a", "completion": "b"})"),
                                opts(), "f:1", &why),
            DataFormat::PromptCompletion);
  EXPECT_EQ(detect_jsonl_format(nlohmann::json::parse(R"({"text": "a"})"), opts(), "f:1", &why),
            DataFormat::Text);
  JsonlOptions body = opts();
  body.text_field = "body";
  EXPECT_EQ(detect_jsonl_format(nlohmann::json::parse(R"({"body": "a"})"), body, "f:1", &why),
            DataFormat::Text);
  const std::string e = error_of([&] {
    detect_jsonl_format(nlohmann::json::parse(R"({"question": "a"})"), opts(), "f.jsonl:1", &why);
  });
  EXPECT_NE(e.find("f.jsonl:1: cannot tell the format"), std::string::npos) << e;
  EXPECT_NE(e.find("{question}"), std::string::npos) << e;
  EXPECT_NE(e.find("data.format"), std::string::npos) << e;
  // A given format is used as it is.
  EXPECT_EQ(detect_jsonl_format(nlohmann::json::parse(R"({"x": 1})"),
                                opts(DataFormat::PromptCompletion), "f:1", &why),
            DataFormat::PromptCompletion);
}

TEST(DocumentBuilder, PromptCompletionTrainsTheCompletionOnly) {
  auto tok = make_byte_tokenizer();
  DocumentBuilder b(DataFormat::PromptCompletion, opts(), *tok);
  const TokenizedDocument d =
      b.build(nlohmann::json::parse(R"({"prompt": "Q? ", "completion": "ok"})"), "f:1");
  EXPECT_EQ(d.tokens, (std::vector<uint32_t>{'Q', '?', ' ', 'o', 'k'}));  // no end-of-text token
  EXPECT_EQ(d.trained, (std::vector<uint8_t>{0, 0, 0, 1, 1}));
}

TEST(DocumentBuilder, TextTrainsEverythingAndEndsWithTheEndOfTextToken) {
  const std::string path = std::string(ACCEL_TEST_DATA_DIR) + "/fixtures/bpe/gpt2/tokenizer.json";
  auto tok = load_bpe_tokenizer(path);
  ASSERT_TRUE(tok->end_of_text_id());
  DocumentBuilder b(DataFormat::Text, opts(), *tok);
  const TokenizedDocument d = b.build(nlohmann::json::parse(R"({"text": "the cat"})"), "f:1");
  std::vector<uint32_t> want = tok->encode("the cat");
  want.push_back(*tok->end_of_text_id());
  EXPECT_EQ(d.tokens, want);
  EXPECT_EQ(d.trained, std::vector<uint8_t>(want.size(), 1));
}

TEST(DocumentBuilder, AWordSplitBetweenPromptAndCompletionIsRefused) {
  const std::string path = std::string(ACCEL_TEST_DATA_DIR) + "/fixtures/bpe/gpt2/tokenizer.json";
  auto tok = load_bpe_tokenizer(path);
  // Find a word whose tokens differ when cut in two (a merge across the cut).
  std::string word;
  for (const char* w : {"the", "and", "that", "this", "with", "there", "their"}) {
    const std::string s = std::string(" ") + w;
    std::vector<uint32_t> parts = tok->encode(s.substr(0, 2));
    tok->encode(s.substr(2), &parts);
    if (parts != tok->encode(s)) word = s;
  }
  ASSERT_FALSE(word.empty()) << "the fixture merges none of the words";
  DocumentBuilder b(DataFormat::PromptCompletion, opts(), *tok);
  nlohmann::json line = {{"prompt", "say:" + word.substr(0, 2)}, {"completion", word.substr(2)}};
  const std::string e = error_of([&] { b.build(line, "sft.jsonl:7"); });
  EXPECT_NE(e.find("sft.jsonl:7: tokenizing the prompt and the completion separately"),
            std::string::npos)
      << e;
  // Cut at the space, the same text is fine.
  line = {{"prompt", "say:"}, {"completion", word}};
  EXPECT_EQ(error_of([&] { b.build(line, "sft.jsonl:8"); }), "");
}

TEST(DocumentBuilder, BadLinesNameTheirPlace) {
  auto tok = make_byte_tokenizer();
  DocumentBuilder pc(DataFormat::PromptCompletion, opts(), *tok);
  auto err = [&](const DocumentBuilder& b, const char* line) {
    return error_of([&] { b.build(nlohmann::json::parse(line), "d.jsonl:3"); });
  };
  EXPECT_NE(err(pc, R"({"prompt": "a"})").find("d.jsonl:3: missing field 'completion'"),
            std::string::npos);
  EXPECT_NE(err(pc, R"({"prompt": "a", "completion": 5})")
                .find("d.jsonl:3: field 'completion' must be a string, got 5"),
            std::string::npos);
  EXPECT_NE(err(pc, R"({"prompt": "a", "completion": ""})").find("'completion' is empty"),
            std::string::npos);
  EXPECT_NE(err(pc, R"({"prompt": [{"role": "user", "content": "a"}], "completion": "b"})")
                .find("conversational"),
            std::string::npos);
  DocumentBuilder text(DataFormat::Text, opts(), *tok);
  EXPECT_NE(err(text, R"({"body": "a"})").find("d.jsonl:3: missing field 'text'"),
            std::string::npos);
}

// A chat template from branch `chat` (the stub of this branch refuses every name).
std::unique_ptr<DocumentBuilder> chat_builder(const Tokenizer& tok) {
  JsonlOptions o = opts(DataFormat::Messages);
  o.chat_template = ChatTemplateChoice::Chatml;
  try {
    return std::make_unique<DocumentBuilder>(DataFormat::Messages, o, tok);
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("not in this build") != std::string::npos) return nullptr;
    throw;
  }
}

TEST(DocumentBuilder, MessagesTrainTheAssistantTurnsOnly) {
  auto tok = make_byte_tokenizer();
  auto b = chat_builder(*tok);
  if (!b) GTEST_SKIP() << "chat templates are not merged into this build yet";
  const nlohmann::json line = nlohmann::json::parse(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
          {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
          {"role": "assistant", "content": "A2"}]})");
  const TokenizedDocument d = b->build(line, "c.jsonl:1");
  const RenderedChat r = ChatTemplate::by_name("chatml").render(
      {{"system", "S"}, {"user", "U1"}, {"assistant", "A1"}, {"user", "U2"}, {"assistant", "A2"}});
  ASSERT_EQ(d.tokens.size(), r.text.size());  // bytes
  std::vector<uint8_t> want(r.text.size(), 0);
  for (const auto& [begin, end] : r.trained)
    for (size_t i = begin; i < end; ++i) want[i] = 1;
  EXPECT_EQ(d.trained, want);
  // Both answers are inside trained spans.
  std::string trained_text;
  for (size_t i = 0; i < d.tokens.size(); ++i)
    if (d.trained[i]) trained_text += static_cast<char>(d.tokens[i]);
  EXPECT_NE(trained_text.find("A1"), std::string::npos);
  EXPECT_NE(trained_text.find("A2"), std::string::npos);
  EXPECT_EQ(trained_text.find("U1"), std::string::npos);
}

TEST(DocumentBuilder, BadConversationsNameTheirPlace) {
  auto tok = make_byte_tokenizer();
  auto b = chat_builder(*tok);
  if (!b) GTEST_SKIP() << "chat templates are not merged into this build yet";
  auto err = [&](const char* line) {
    return error_of([&] { b->build(nlohmann::json::parse(line), "c.jsonl:9"); });
  };
  EXPECT_NE(err(R"({"messages": []})").find("c.jsonl:9: empty conversation"), std::string::npos);
  EXPECT_NE(err(R"({"messages": [{"role": "robot", "content": "x"}]})")
                .find("c.jsonl:9: messages[0]: role 'robot' is not one of system, user, assistant"),
            std::string::npos);
  EXPECT_NE(err(R"({"messages": [{"role": "user", "content": "x"}]})").find("no assistant turn"),
            std::string::npos);
  EXPECT_NE(err(R"({"messages": [{"role": "user"}]})")
                .find("c.jsonl:9: messages[0]: missing field 'content'"),
            std::string::npos);
  EXPECT_NE(err(R"({"messages": "hi"})").find("'messages' must be a list"), std::string::npos);
}

TEST(ReadJsonlDocuments, ErrorsNameFileAndLine) {
  TempDir dir;
  auto tok = make_byte_tokenizer();
  auto err = [&](const std::string& text) {
    const std::string f = dir.file("x.jsonl");
    write_bytes(f, text);
    std::string notice;
    return error_of([&] {
      read_jsonl_documents(
          {f}, opts(), *tok, [](const TokenizedDocument&, const std::string&, int64_t) {}, &notice);
    });
  };
  EXPECT_NE(err("{\"text\": \"a\"}\n{\"text\": \"b\"\n").find("x.jsonl:2"), std::string::npos);
  EXPECT_NE(err("{\"text\": \"a\"}\n[1, 2]\n").find("x.jsonl:2: expected a JSON object"),
            std::string::npos);
  EXPECT_NE(err("{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n").find("x.jsonl:2: empty line"),
            std::string::npos);
  EXPECT_NE(err("{\"text\": \"a\"}\n{\"txt\": \"b\"}\n").find("x.jsonl:2: missing field 'text'"),
            std::string::npos);
  EXPECT_NE(err("").find("hold no lines"), std::string::npos);
}

TEST(TokenizeJsonlFiles, WritesDocumentShardsThatNameTheirLines) {
  TempDir dir;
  auto tok = make_byte_tokenizer();
  write_bytes(dir.file("a.jsonl"),
              "{\"prompt\": \"P\", \"completion\": \"cc\"}\n{\"prompt\": \"QQ\", \"completion\": "
              "\"d\"}\n");
  write_gzip(dir.file("b.jsonl.gz"), "{\"prompt\": \"R\", \"completion\": \"eee\"}\n");
  const JsonlShardSet set = tokenize_jsonl_files({dir.file("a.jsonl"), dir.file("b.jsonl.gz")},
                                                 *tok, opts(), dir.file("out"), 6);
  EXPECT_EQ(set.format, DataFormat::PromptCompletion);
  EXPECT_EQ(set.documents, 3);
  EXPECT_EQ(set.tokens, 3 + 3 + 4);
  EXPECT_EQ(set.trained_tokens, 2 + 1 + 3);
  ASSERT_EQ(set.shards.size(), 2u);  // 6 tokens per shard at most: documents are not split
  auto s0 = TokenShard::open(set.shards[0]);
  ASSERT_TRUE(s0->has_documents());
  EXPECT_EQ(s0->documents(), 2);
  EXPECT_EQ(s0->document_start(1), 3);
  EXPECT_FALSE(s0->trained(0));
  EXPECT_TRUE(s0->trained(1));
  EXPECT_FALSE(s0->trained(4));
  EXPECT_TRUE(s0->trained(5));
  const nlohmann::json manifest =
      nlohmann::json::parse(testing::read_bytes(dir.file("out/manifest.json")));
  EXPECT_EQ(document_origin(manifest, 1), dir.file("a.jsonl") + ":2");
  EXPECT_EQ(document_origin(manifest, 2), dir.file("b.jsonl.gz") + ":1");
  EXPECT_EQ(document_origin(manifest, 3), "");
}

TEST(RefuseUnreadableDataset, ParquetAndArrowGetTheConversion) {
  TempDir dir;
  const std::string e = error_of([&] { refuse_unreadable_dataset("train.parquet", "data.x"); });
  EXPECT_NE(e.find("data.x: 'train.parquet' is a Parquet file"), std::string::npos) << e;
  EXPECT_NE(e.find("python3 -c \"import datasets; datasets.load_dataset('parquet', "
                   "data_files='train.parquet', split='train').to_json('train.jsonl')\""),
            std::string::npos)
      << e;
  std::filesystem::create_directories(dir.file("ds"));
  write_bytes(dir.file("ds/dataset_info.json"), "{}");
  const std::string a = error_of([&] { refuse_unreadable_dataset(dir.file("ds"), "data.x"); });
  EXPECT_NE(a.find("Hugging Face datasets (Arrow) folder"), std::string::npos) << a;
  EXPECT_NE(a.find("datasets.load_from_disk('" + dir.file("ds") + "').to_json('train.jsonl')"),
            std::string::npos)
      << a;
  EXPECT_EQ(error_of([&] { refuse_unreadable_dataset("train.jsonl", "data.x"); }), "");
}

}  // namespace
}  // namespace accel
