// Every configs/*.yaml parses and describes a valid model; the mixture-of-experts ones have the
// parameter counts their comments state.
#include <gtest/gtest.h>

#include <filesystem>

#include "models/decoder.h"
#include "runtime/config.h"

namespace accel {
namespace {

const std::string kConfigs = std::string(ACCEL_SOURCE_DIR) + "/configs";

DecoderConfig model_of(const std::string& file) {
  return decoder_config(load_config(kConfigs + "/" + file, {}, {}).model);
}

TEST(ShippedConfigs, EveryModelConfigParsesAndValidates) {
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(kConfigs)) {
    if (e.path().extension() != ".yaml") continue;
    SCOPED_TRACE(e.path().string());
    Config c = load_config(e.path().string(), {}, {});
    DecoderConfig d = decoder_config(c.model);
    EXPECT_GT(d.num_parameters(), 0);
    ++checked;
  }
  EXPECT_GE(checked, 13);
}

TEST(ShippedConfigs, MixtureOfExpertsShapes) {
  DecoderConfig q = model_of("qwen3-30b-a3b.yaml");
  EXPECT_EQ(q.model_type, "qwen3_moe");
  EXPECT_EQ(q.num_sparse_layers(), 48);
  EXPECT_NEAR(q.num_parameters() / 1e9, 30.5, 0.1);
  EXPECT_NEAR(q.num_active_parameters() / 1e9, 3.3, 0.1);
  DecoderConfig m = model_of("mixtral-8x7b.yaml");
  EXPECT_EQ(m.model_type, "mixtral");
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_NEAR(m.num_parameters() / 1e9, 46.7, 0.1);
  EXPECT_NEAR(m.num_active_parameters() / 1e9, 12.9, 0.1);
  DecoderConfig s = model_of("moe-small.yaml");
  EXPECT_EQ(s.num_experts, 16);
  EXPECT_EQ(s.num_experts_per_tok, 2);
  EXPECT_TRUE(s.output_router_logits);
  // The counts moe-small.yaml's comment gives.
  EXPECT_EQ(s.num_parameters(), 1542444544);
  EXPECT_EQ(s.num_active_parameters(), 485479936);
}

TEST(ShippedConfigs, MoeKeysOnADenseFamilyAreRefusedNamingTheKey) {
  try {
    Config c = load_config(kConfigs + "/qwen3-1.7b.yaml", {"model.num_experts=8"}, {});
    decoder_config(c.model);
    FAIL() << "accepted num_experts on qwen3";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace accel
