// Hostile model sizes and Hugging Face config.json files (issue 26 #1-#3): overflowing size
// products, num_attention_heads 0 (a division before validation), deep nesting. Each is an
// exception naming the file and the field, never a crash.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "models/decoder.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

using testing::error_of;

DecoderConfig small() {
  DecoderConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.vocab_size = 256;
  return c;
}

TEST(LlamaConfigLimits, SizeProductsThatOverflowAreRefused) {
  EXPECT_NO_THROW(small().validate());
  const int64_t huge = int64_t{1} << 62;
  DecoderConfig c = small();
  c.hidden_size = huge;
  EXPECT_NE(error_of([&] { c.validate(); }).find("vocab_size x hidden_size"), std::string::npos);
  c = small();
  c.vocab_size = huge;
  EXPECT_NE(error_of([&] { c.validate(); }).find("vocab_size x hidden_size"), std::string::npos);
  c = small();
  c.intermediate_size = int64_t{1} << 56;
  EXPECT_NE(error_of([&] { c.validate(); }).find("intermediate_size x hidden_size"),
            std::string::npos);
  c = small();
  c.num_hidden_layers = int64_t{1} << 50;  // each layer fits; their sum does not
  EXPECT_NE(error_of([&] { c.validate(); }).find("parameter count"), std::string::npos);
  c = small();
  EXPECT_NE(error_of([&] {
              c.check_batch(int64_t{1} << 40, 1 << 20);
            }).find("training.micro_batch_size 1099511627776 x training.seq_len 1048576"),
            std::string::npos);
  EXPECT_NO_THROW(c.check_batch(16, 128));
}

class HfConfig : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("accel_hf_config_" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& text) {
    const std::string p = (dir_ / "config.json").string();
    std::ofstream(p) << text;
    return p;
  }
  fs::path dir_;
};

const std::string kFields =
    R"("model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 1, "vocab_size": 256)";

TEST_F(HfConfig, ZeroHeadsIsAnErrorNotADivisionByZero) {
  const std::string p = write("{" + kFields + R"(, "num_attention_heads": 0})");
  const std::string msg = error_of([&] { read_hf_model_config(p); });
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_attention_heads must be positive, got 0"), std::string::npos) << msg;
  write("{" + kFields + R"(, "num_attention_heads": 2, "num_key_value_heads": 0})");
  EXPECT_NE(error_of([&] { read_hf_model_config(p); }).find("num_key_value_heads must be positive"),
            std::string::npos);
  write("{" + kFields + R"(, "num_attention_heads": 2, "rms_norm_eps": -1})");
  EXPECT_NE(error_of([&] { read_hf_model_config(p); }).find("rms_norm_eps must be a positive"),
            std::string::npos);
  write("{" + kFields + R"(, "num_attention_heads": 2.5})");
  EXPECT_NE(error_of([&] {
              read_hf_model_config(p);
            }).find("field 'num_attention_heads' must be an integer, got 2.5"),
            std::string::npos);
  write("{" + kFields + R"(, "num_attention_heads": 2})");
  EXPECT_EQ(read_hf_model_config(p).head_dim, 32);
}

TEST_F(HfConfig, HugeSizesAreRefused) {
  const std::string p = write(R"({"hidden_size": 4611686018427387904, "intermediate_size": 128,
      "num_hidden_layers": 1, "vocab_size": 256, "num_attention_heads": 2})");
  const std::string msg = error_of([&] { read_hf_model_config(p); });
  EXPECT_NE(msg.find(p + ": llama config: vocab_size x hidden_size"), std::string::npos) << msg;
  write(R"({"hidden_size": 18446744073709551615, "intermediate_size": 128,
      "num_hidden_layers": 1, "vocab_size": 256, "num_attention_heads": 2})");
  EXPECT_NE(error_of([&] {
              read_hf_model_config(p);
            }).find("field 'hidden_size' must be an integer, got 18446744073709551615"),
            std::string::npos);
}

TEST_F(HfConfig, DeepNestingIsAnErrorNotAStackOverflow) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string p =
      write("{" + kFields + R"(, "num_attention_heads": 2, "rope_scaling": )" + deep + "}");
  const std::string msg = error_of([&] { read_hf_model_config(p); });
  EXPECT_NE(msg.find(p + ": JSON nests arrays/objects deeper than"), std::string::npos) << msg;
  // Shallow but long: the message shows an excerpt.
  std::string many;
  for (int i = 0; i < 50000; ++i) many += "1,";
  write("{" + kFields + R"(, "num_attention_heads": 2, "rope_scaling": [)" + many + "1]}");
  EXPECT_LT(error_of([&] { read_hf_model_config(p); }).size(), 300u);
}

}  // namespace
}  // namespace accel
