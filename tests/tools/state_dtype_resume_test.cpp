// optimizer.state_dtype bf16 through accel-train's checkpoints: the moments are saved in bf16
// (the index and accel-checkpoint inspect say so, reshard keeps them bf16), a resume with the same
// state dtype continues the uninterrupted run exactly (single) and within 1e-5 at another world
// size and strategy (ZeRO-2 x 3 -> FSDP x 2), and a resume with the other state dtype converts the
// moments (fp32 -> bf16 rounds to nearest even, bf16 -> fp32 is exact) and says so.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

// 12 samples per step (micro_batch_size 4 x 3 processes, or 6 x 2, or 12 x 1).
const char* kConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 5, max_steps: 6, micro_batch_size: 12, seq_len: 8, log_every: 1,
           progress: none, device: cpu}
optimizer: {lr: 0.01, warmup_steps: 1, lr_schedule: cosine, state_dtype: bf16}
data: {source: synthetic}
checkpoint: {every_steps: 3, keep_last: 0}
)";

class StateDtypeResume : public accel::tool_test::ConfigFolderTest {
 protected:
  StateDtypeResume() : ConfigFolderTest("accel_state_dtype", kConfig) {}
  Result tool(const std::string& args) {
    return accel::tool_test::run_command(std::string(ACCEL_BIN_DIR) + "/accel-checkpoint " + args);
  }
  nlohmann::json trainer_state(const fs::path& ckpt) {
    return nlohmann::json::parse(
        accel::tool_test::run_command("cat " + (ckpt / "trainer_state.json").string()).output);
  }
};

TEST_F(StateDtypeResume, Bf16MomentsAreSavedInBf16AndResumeExactly) {
  Result r = train("ref", "");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::map<int, double> ref = losses("ref");
  ASSERT_EQ(ref.size(), 6u) << r.output;

  const nlohmann::json st = trainer_state(step("ref", 3));
  EXPECT_EQ(st.value("state_dtype", std::string()), "BF16");
  EXPECT_EQ(st["state"]["dtypes"]["exp_avg"], "BF16");
  EXPECT_EQ(st["state"]["dtypes"]["exp_avg_sq"], "BF16");
  EXPECT_EQ(st["state"]["dtypes"]["master"], "F32");
  Result insp = tool("inspect " + step("ref", 3).string());
  ASSERT_EQ(insp.code, 0) << insp.output;
  EXPECT_NE(insp.output.find("state dtype BF16"), std::string::npos) << insp.output;
  EXPECT_NE(insp.output.find("exp_avg BF16, exp_avg_sq BF16"), std::string::npos) << insp.output;
  Result ver = tool("verify " + step("ref", 3).string());
  EXPECT_EQ(ver.code, 0) << ver.output;

  // The same run resumed from step 3: the same losses, to the last digit.
  Result res = train("resumed", "--resume " + step("ref", 3).string());
  ASSERT_EQ(res.code, 0) << res.output;
  EXPECT_EQ(res.output.find("converted"), std::string::npos) << res.output;
  const std::map<int, double> got = losses("resumed");
  for (int s = 4; s <= 6; ++s) {
    ASSERT_TRUE(got.count(s)) << res.output;
    EXPECT_EQ(got.at(s), ref.at(s)) << "step " << s;
  }

  // Offline reshard keeps the moments in bf16.
  Result rs = tool("reshard " + step("ref", 3).string() + " " + (dir_ / "resharded").string() +
                   " --strategy zero --world-size 3");
  ASSERT_EQ(rs.code, 0) << rs.output;
  Result insp2 = tool("inspect " + (dir_ / "resharded").string());
  EXPECT_NE(insp2.output.find("exp_avg BF16, exp_avg_sq BF16"), std::string::npos) << insp2.output;
  EXPECT_EQ(tool("verify " + (dir_ / "resharded").string()).code, 0);
}

TEST_F(StateDtypeResume, Zero2AtThreeResumesUnderFsdpAtTwo) {
  Result r = train("z2",
                   "--set distributed_type=DEEPSPEED --set deepspeed_config.zero_stage=2 "
                   "--set num_processes=3 --set training.micro_batch_size=4");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::map<int, double> ref = losses("z2");
  ASSERT_EQ(ref.size(), 6u) << r.output;
  Result res = train("fsdp",
                     "--set distributed_type=FSDP --set num_processes=2 --set "
                     "training.micro_batch_size=6 --resume " +
                         step("z2", 3).string());
  ASSERT_EQ(res.code, 0) << res.output;
  const std::map<int, double> got = losses("fsdp");
  for (int s = 4; s <= 6; ++s) {
    ASSERT_TRUE(got.count(s)) << res.output;
    EXPECT_NEAR(got.at(s), ref.at(s), 1e-5) << "step " << s;
  }
}

TEST_F(StateDtypeResume, OtherStateDtypeIsConvertedWithANote) {
  // An fp32-state checkpoint resumed with bf16 state: rounded once, then training goes on.
  Result a = train("fp32", "--set optimizer.state_dtype=fp32");
  ASSERT_EQ(a.code, 0) << a.output;
  const std::map<int, double> ref32 = losses("fp32");
  Result b = train("to_bf16", "--resume " + step("fp32", 3).string());
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("stored as exp_avg F32, exp_avg_sq F32; optimizer.state_dtype is bf16, "
                          "so it is converted to BF16 on load (rounded to nearest even)"),
            std::string::npos)
      << b.output;
  const std::map<int, double> got = losses("to_bf16");
  ASSERT_TRUE(got.count(6)) << b.output;
  // Step 4's loss comes from the checkpoint's weights (before the first update from the
  // converted moments): the fp32 run's own; later steps differ by the moments' rounding only.
  EXPECT_EQ(got.at(4), ref32.at(4));
  EXPECT_NEAR(got.at(6), ref32.at(6), 1e-2);
  // A bf16-state checkpoint resumed with fp32 state: widened exactly.
  Result c = train("bf16", "");
  ASSERT_EQ(c.code, 0) << c.output;
  Result d =
      train("to_fp32", "--set optimizer.state_dtype=fp32 --resume " + step("bf16", 3).string());
  ASSERT_EQ(d.code, 0) << d.output;
  EXPECT_NE(d.output.find("converted to F32 on load (exact)"), std::string::npos) << d.output;
  EXPECT_EQ(losses("to_fp32").at(4), losses("bf16").at(4));
}

}  // namespace
