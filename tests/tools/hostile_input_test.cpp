// accel-train on the hostile inputs of issue 26 (#1-#3), run as a user would: huge sizes on the
// command line or in an init_from folder, num_attention_heads 0, JSON nested 100,000 deep in a
// model.safetensors header or a trainer_state.json. Each must exit with a message (2 for a bad
// configuration, 1 for a bad file), never with a signal.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/tools/run_tool.h"
#include "tools/trainer/checkpoint.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;
using accel::tool_test::run_accel_train;
using accel::tool_test::write_config;

const char* kTinyConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 7, max_steps: 1, micro_batch_size: 2, seq_len: 16, progress: plain, device: cpu}
data: {source: synthetic}
checkpoint: {every_steps: 0, at_end: false}
)";

const std::string kDeep = std::string(100000, '[') + std::string(100000, ']');

Result train(const fs::path& d, const std::string& extra) {
  const fs::path cfg = write_config(d, kTinyConfig);
  return run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string() +
                         " " + extra);
}

TEST(HostileInput, HugeSizesOnTheCommandLineAreConfigErrors) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_hostile");
  for (const char* key : {"model.hidden_size", "model.vocab_size", "training.micro_batch_size"}) {
    fs::remove_all(d / "out");
    Result r = train(d, std::string("--set ") + key + "=4611686018427387904");
    EXPECT_EQ(r.code, 2) << r.output;  // it was 139 (SIGSEGV)
    EXPECT_NE(r.output.find(std::string(key) + " 4611686018427387904"), std::string::npos)
        << r.output;
  }
}

// A Hugging Face folder with this config.json and no weights (the config is read first).
fs::path hf_folder(const fs::path& d, const std::string& config_json) {
  const fs::path m = d / "hf";
  fs::create_directories(m);
  std::ofstream(m / "config.json") << config_json;
  return m;
}

const std::string kHfFields =
    R"("model_type": "llama", "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 64)";

TEST(HostileInput, InitFromConfigJsonIsCheckedBeforeUse) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_hostile");
  fs::path m = hf_folder(d, "{" + kHfFields + R"(, "hidden_size": 32, "num_attention_heads": 0})");
  Result r = train(d, "--set model.init_from=" + m.string());
  EXPECT_EQ(r.code, 2) << r.output;  // it was 136 (SIGFPE)
  EXPECT_NE(r.output.find("num_attention_heads must be positive, got 0"), std::string::npos)
      << r.output;

  fs::remove_all(d / "out");
  m = hf_folder(d, "{" + kHfFields + R"(, "hidden_size": 4611686018427387904,
                "num_attention_heads": 4})");
  r = train(d, "--set model.init_from=" + m.string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("vocab_size x hidden_size"), std::string::npos) << r.output;

  // The model fits, one micro-batch's logits do not.
  fs::remove_all(d / "out");
  m = hf_folder(d, "{" + kHfFields + R"(, "hidden_size": 32, "num_attention_heads": 4})");
  r = train(d, "--set model.init_from=" + m.string() +
                   " --set training.micro_batch_size=17179869184 --set training.seq_len=1048576");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("training.micro_batch_size 17179869184 x training.seq_len 1048576 x 64"),
            std::string::npos)
      << r.output;

  fs::remove_all(d / "out");
  m = hf_folder(d, "{" + kHfFields + R"(, "hidden_size": 32, "num_attention_heads": 4,
                "rope_scaling": )" +
                       kDeep + "}");
  r = train(d, "--set model.init_from=" + m.string());
  EXPECT_EQ(r.code, 1) << r.output.substr(0, 2000);
  EXPECT_NE(r.output.find("JSON nests arrays/objects deeper than"), std::string::npos)
      << r.output.substr(0, 2000);
}

TEST(HostileInput, DeeplyNestedSafetensorsHeaderInInitFrom) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_hostile");
  const fs::path m =
      hf_folder(d, "{" + kHfFields + R"(, "hidden_size": 32, "num_attention_heads": 4})");
  const std::string header = "{\"a\":" + kDeep + "}";
  const uint64_t n = header.size();
  std::ofstream f(m / "model.safetensors", std::ios::binary);
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header;
  f.close();
  Result r = train(d, "--set model.init_from=" + m.string());
  EXPECT_EQ(r.code, 1) << r.output.substr(0, 2000);  // it was 139 (stack overflow)
  EXPECT_NE(r.output.find("model.safetensors': header: JSON nests arrays/objects deeper than"),
            std::string::npos)
      << r.output.substr(0, 2000);
}

TEST(HostileInput, DeeplyNestedTrainerState) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_hostile");
  std::ofstream(d / "trainer_state.json") << R"({"step": 1, "extra": )" << kDeep << "}";
  try {
    accel::load_checkpoint(d.string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("trainer_state.json: JSON nests arrays/objects deeper"),
              std::string::npos)
        << std::string(e.what()).substr(0, 300);
  }
}

}  // namespace
