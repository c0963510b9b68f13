// Checkpoints on the GPU (issue 24): a background save (checkpoint.async) copies the device state
// to host memory at the step boundary and the run resumed from it continues bit for bit (bf16,
// fp16 with its loss scaler, fp8 delayed scaling); a ZeRO-3 checkpoint resumes as the single
// process (resharded), step 4 within 1e-5. A few seconds on an H200.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "tests/cuda/cuda_test_util.h"
#include "tests/tools/run_tool.h"
#include "tools/trainer/checkpoint.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

// Every dimension a multiple of 16, so that every Linear runs in fp8.
const char* kConfig = R"(
model: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 128, vocab_size: 128, max_position_embeddings: 64}
training: {seed: 5, max_steps: 6, micro_batch_size: 4, seq_len: 32, log_every: 1,
           progress: plain, device: cuda}
optimizer: {lr: 0.01, warmup_steps: 1, lr_schedule: cosine}
data: {source: synthetic}
checkpoint: {every_steps: 3, keep_last: 0, async: true}
)";

class CheckpointResumeCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = accel::tool_test::fresh_test_dir("accel_ckpt_cuda");
    accel::tool_test::write_config(dir_, kConfig);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  Result train(const std::string& out, const std::string& extra) {
    return accel::tool_test::run_accel_train("--config " + (dir_ / "config.yaml").string() +
                                             " --output-dir " + (dir_ / out).string() + " " +
                                             extra);
  }
  std::map<int, double> losses(const std::string& out) {
    return accel::tool_test::read_losses(dir_ / out / "metrics.jsonl");
  }
  std::string step3(const std::string& out) {
    return (dir_ / out / "checkpoints" / "step_3").string();
  }
  fs::path dir_;
};

TEST_F(CheckpointResumeCuda, AsyncSaveResumesBitForBit) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const std::map<std::string, std::string> modes = {
      {"bf16", "--set mixed_precision=bf16"},
      {"fp16", "--set mixed_precision=fp16"},
      {"fp8", "--set mixed_precision=fp8 --set fp8_config.backend=TE"}};
  for (const auto& [name, precision] : modes) {
    Result full = train(name, precision);
    ASSERT_EQ(full.code, 0) << full.output;
    EXPECT_NE(full.output.find("(in the background during"), std::string::npos) << full.output;
    EXPECT_EQ(accel::verify_checkpoint(step3(name)), std::vector<std::string>{}) << name;
    Result resumed = train(name + "_resumed", precision + " --resume " + step3(name));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const std::map<int, double> a = losses(name), b = losses(name + "_resumed");
    for (int s = 4; s <= 6; ++s) EXPECT_EQ(b.at(s), a.at(s)) << name << " step " << s;
  }
}

TEST_F(CheckpointResumeCuda, Zero3CheckpointResumesAsTheSingleProcess) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const std::string bf16 = "--set mixed_precision=bf16";
  Result z3 = train("z3", bf16 + " --set distributed_type=DEEPSPEED --set "
                                 "deepspeed_config.zero_stage=3");
  ASSERT_EQ(z3.code, 0) << z3.output;
  Result single = train("single", bf16 + " --resume " + step3("z3"));
  ASSERT_EQ(single.code, 0) << single.output;
  EXPECT_NE(single.output.find("saved by zero3 x 1, resharded for single x 1"), std::string::npos)
      << single.output;
  EXPECT_NEAR(losses("single").at(4), losses("z3").at(4), 1e-5);
}

}  // namespace
