// Rough edges a newcomer hits (issue 23): the effective config after model.init_from, shards
// trained with another tokenizer than the one they record, --resume auto on a finished run, and
// the files that make checkpoints and consolidated folders self-describing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

const char* kConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 1024, max_position_embeddings: 64}
training: {seed: 7, max_steps: 2, micro_batch_size: 2, seq_len: 16, log_every: 1, progress: none,
           device: cpu}
data: {source: synthetic}
checkpoint: {every_steps: 0, at_end: true, keep_last: 0}
)";

const std::string kBpe = std::string(ACCEL_SOURCE_DIR) + "/tests/data/fixtures/bpe/gpt2";

class RoughEdges : public accel::tool_test::ConfigFolderTest {
 protected:
  RoughEdges() : ConfigFolderTest("accel_rough_edges", kConfig) {}
  // Token shards of some text made by accel-data with the BPE fixture, under dir_/shards.
  void make_bpe_shards() {
    std::ofstream text(dir_ / "text.txt");
    for (int i = 0; i < 300; ++i) text << "The quick brown fox " << i << " jumps over the dog.\n";
    text.close();
    Result r = accel::tool_test::run_command(
        std::string(ACCEL_BIN_DIR) + "/accel-data --tokenizer " + kBpe + "/tokenizer.json --out " +
        (dir_ / "shards").string() + " " + (dir_ / "text.txt").string());
    ASSERT_EQ(r.code, 0) << r.output;
  }
  std::string shards_args(const std::string& tokenizer) {
    return "--set data.source=shards --set data.train_path=" + (dir_ / "shards/train").string() +
           " --set data.tokenizer=" + tokenizer;
  }
  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
};

TEST_F(RoughEdges, InitFromShowsTheLoadedShapeAndSaysWhatItRead) {
  Result r = train("base");
  ASSERT_EQ(r.code, 0) << r.output;
  const fs::path from = dir_ / "base/checkpoints/step_2";
  // The YAML's shape differs from the folder's: the folder's wins and is what config.yaml shows.
  r = train("tuned", "--set model.init_from=" + from.string() +
                         " --set model.hidden_size=64 --set model.num_hidden_layers=3");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("model.init_from: read 21 tensors (0."), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("M parameters) from " + from.string()), std::string::npos) << r.output;
  const std::string yaml = read(dir_ / "tuned/config.yaml");
  EXPECT_NE(yaml.find("  hidden_size: 32\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  num_hidden_layers: 2\n"), std::string::npos) << yaml;
  EXPECT_EQ(yaml.find("  hidden_size: 64\n"), std::string::npos) << yaml;
}

TEST_F(RoughEdges, ResumeOfAFinishedRunSaysThereIsNothingToTrain) {
  Result r = train("base");
  ASSERT_EQ(r.code, 0) << r.output;
  r = train("base", "--resume auto");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint step 2 is already training.max_steps (2); nothing to train"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("loss nan"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "base/checkpoints/step_2.tmp"));
}

TEST_F(RoughEdges, ShardsOfAnotherTokenizerAreRefusedNamingBoth) {
  make_bpe_shards();
  Result r = train("byte", shards_args("byte"));
  EXPECT_EQ(r.code, 1) << r.output;
  for (const char* s : {"was made with BPE", "manifest.json", "data.tokenizer is 'byte'",
                        "byte-level", "set data.tokenizer"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  r = train("bpe", shards_args(kBpe + "/tokenizer.json"));
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST_F(RoughEdges, CheckpointsAndConsolidatedFoldersCarryTokenizerAndGenerationConfig) {
  make_bpe_shards();
  // tokenizer_config.json beside the tokenizer.json is copied too.
  fs::create_directories(dir_ / "tok");
  fs::copy_file(kBpe + "/tokenizer.json", dir_ / "tok/tokenizer.json");
  std::ofstream(dir_ / "tok/tokenizer_config.json")
      << R"({"eos_token": "<|endoftext|>", "bos_token": {"content": "<|endoftext|>"}})";
  Result r = train("bpe", shards_args((dir_ / "tok").string()));
  ASSERT_EQ(r.code, 0) << r.output;
  const fs::path ckpt = dir_ / "bpe/checkpoints/step_2";
  const fs::path consolidated = dir_ / "hf";
  r = accel::tool_test::run_command(std::string(ACCEL_BIN_DIR) + "/accel-checkpoint consolidate " +
                                    ckpt.string() + " " + consolidated.string());
  ASSERT_EQ(r.code, 0) << r.output;
  for (const fs::path& d : {ckpt, consolidated}) {
    EXPECT_EQ(read(d / "tokenizer.json"), read(kBpe + "/tokenizer.json")) << d;
    EXPECT_TRUE(fs::exists(d / "tokenizer_config.json")) << d;
    const auto g = nlohmann::json::parse(read(d / "generation_config.json"));
    EXPECT_EQ(g.value("eos_token_id", -1), 0) << g.dump();
    EXPECT_EQ(g.value("bos_token_id", -1), 0) << g.dump();
  }

  // The byte tokenizer has no tokenizer.json and no bos/eos: generation_config.json only, and
  // consolidate says what to pass accel-generate.
  r = train("byte");
  ASSERT_EQ(r.code, 0) << r.output;
  const fs::path byte_ckpt = dir_ / "byte/checkpoints/step_2";
  EXPECT_TRUE(fs::exists(byte_ckpt / "generation_config.json"));
  EXPECT_FALSE(fs::exists(byte_ckpt / "tokenizer.json"));
  r = accel::tool_test::run_command(std::string(ACCEL_BIN_DIR) + "/accel-checkpoint consolidate " +
                                    byte_ckpt.string() + " " + (dir_ / "hf_byte").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "hf_byte/generation_config.json"));
  EXPECT_NE(r.output.find("no tokenizer.json"), std::string::npos) << r.output;
}

}  // namespace
