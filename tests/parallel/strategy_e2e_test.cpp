// The strategies end to end through the accel-train binary: DDP launched by mpirun against the
// single-process run; ZeRO-3 spawned by accel-train itself, checkpointed (shards only), resumed
// from step 5, consolidated by accel-checkpoint, and the consolidated weights loaded by a run at
// another world size.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "runtime/safetensors.h"
#include "tests/parallel/harness.h"
#include "tests/tools/run_tool.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

const char* kConfig = R"(distributed_type: MULTI_CPU
num_processes: 2
model:
  hidden_size: 32
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  intermediate_size: 64
  vocab_size: 64
  max_position_embeddings: 32
training:
  seed: 5
  max_steps: 10
  micro_batch_size: 2
  seq_len: 8
  log_every: 1
  device: cpu
  progress: none
optimizer:
  lr: 0.01
  lr_schedule: constant
data:
  source: synthetic
checkpoint:
  every_steps: 0
  keep_last: 0
distributed:
  ddp_bucket_cap_mb: 0.01
)";

class StrategyEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tool_test::fresh_test_dir("accel_e2e");
    tool_test::write_config(dir_, kConfig);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // Runs a command line; returns its exit code; its output goes to dir_/log.txt.
  int run(const std::string& cmd) {
    std::string full = cmd + " >>" + (dir_ / "log.txt").string() + " 2>&1";
    int rc = std::system(full.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  std::string train(const std::string& out, const std::string& sets) {
    return std::string(ACCEL_BIN_DIR) + "/accel-train --config " + (dir_ / "config.yaml").string() +
           " -o " + (dir_ / out).string() + " " + sets;
  }
  std::string log() {
    std::ifstream in(dir_ / "log.txt");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // step -> loss from a run's metrics.jsonl
  std::map<int, double> losses(const std::string& out) {
    return tool_test::read_losses(dir_ / out / "metrics.jsonl");
  }
  void expect_close(const std::map<int, double>& got, const std::map<int, double>& want,
                    double rel) {
    ASSERT_EQ(got.size(), want.size()) << log();
    for (const auto& [step, l] : want) {
      ASSERT_TRUE(got.count(step)) << "step " << step;
      EXPECT_NEAR(got.at(step), l, rel * std::abs(l)) << "step " << step;
    }
  }
  fs::path dir_;
};

TEST_F(StrategyEndToEnd, DdpUnderMpirunMatchesSingleProcess) {
  if (std::system("mpirun --version >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  ASSERT_EQ(run(train("single",
                      "--set distributed_type=NO --set num_processes=1 "
                      "--set training.micro_batch_size=4")),
            0)
      << log();
  const int port = testing::pick_free_port();
  ASSERT_EQ(run("mpirun --allow-run-as-root --oversubscribe -np 2 " +
                train("ddp", "--set main_process_port=" + std::to_string(port))),
            0)
      << log();
  std::map<int, double> single = losses("single"), ddp = losses("ddp");
  ASSERT_EQ(single.size(), 10u) << log();
  expect_close(ddp, single, 1e-5);
}

TEST_F(StrategyEndToEnd, Zero3ResumesFromShardsAndConsolidatesForAnotherWorldSize) {
  const std::string zero3 =
      "--set distributed_type=DEEPSPEED --set deepspeed_config.zero_stage=3 "
      "--set checkpoint.every_steps=5";
  ASSERT_EQ(run(train("a", zero3)), 0) << log();
  const fs::path step5 = dir_ / "a" / "checkpoints" / "step_5";
  const fs::path step10 = dir_ / "a" / "checkpoints" / "step_10";
  ASSERT_TRUE(fs::exists(step10 / "optimizer.rank1.safetensors")) << log();
  EXPECT_FALSE(fs::exists(step10 / "model.safetensors"))
      << "ZeRO-3 without zero3_save_16bit_model keeps weights in the shards only";

  // Resume from step 5 into a new folder: steps 6-10 as in the uninterrupted run.
  ASSERT_EQ(run(train("b", zero3 + " --resume " + step5.string())), 0) << log();
  std::map<int, double> a = losses("a"), b = losses("b");
  ASSERT_EQ(a.size(), 10u) << log();
  for (int step = 6; step <= 10; ++step) {
    ASSERT_TRUE(b.count(step)) << "resumed run has no step " << step << "\n" << log();
    EXPECT_EQ(b[step], a[step]) << "step " << step;
  }

  // Consolidate the shards into a Hugging Face folder.
  const fs::path hf = dir_ / "hf";
  ASSERT_EQ(run(std::string(ACCEL_BIN_DIR) + "/accel-checkpoint consolidate " + step10.string() +
                " " + hf.string()),
            0)
      << log();
  SafetensorsReader model((hf / "model.safetensors").string());
  EXPECT_TRUE(model.contains("model.layers.1.mlp.down_proj.weight"));
  EXPECT_TRUE(model.contains("lm_head.weight"));
  EXPECT_EQ(model.info("model.embed_tokens.weight").shape, (Shape{64, 32}));
  EXPECT_TRUE(fs::exists(hf / "config.json"));

  // It loads into 3 ranks (ZeRO-2) and gives the same losses as one process from it.
  const std::string from_hf =
      "--set model.init_from=" + hf.string() + " --set training.max_steps=3";
  ASSERT_EQ(run(train("c", from_hf + " --set distributed_type=DEEPSPEED "
                                     "--set deepspeed_config.zero_stage=2 --set num_processes=3")),
            0)
      << log();
  ASSERT_EQ(run(train("d", from_hf + " --set distributed_type=NO --set num_processes=1 "
                                     "--set training.micro_batch_size=6")),
            0)
      << log();
  expect_close(losses("c"), losses("d"), 1e-5);

  // The consolidated weights are the ones the same run writes with zero3_save_16bit_model (fp32
  // compute: the 16-bit save is the fp32 master).
  ASSERT_EQ(run(train("e", zero3 + " --set deepspeed_config.zero3_save_16bit_model=true")), 0)
      << log();
  SafetensorsReader full((dir_ / "e" / "checkpoints" / "step_10" / "model.safetensors").string());
  ASSERT_EQ(full.names().size(), model.names().size());
  for (const std::string& n : full.names())
    EXPECT_EQ(full.load(n).to_vector(), model.load(n).to_vector()) << n;
}

TEST_F(StrategyEndToEnd, ConsolidateRejectsAFolderThatIsNoCheckpoint) {
  EXPECT_NE(run(std::string(ACCEL_BIN_DIR) + "/accel-checkpoint consolidate " + dir_.string() +
                " " + (dir_ / "out").string()),
            0);
  EXPECT_NE(log().find("trainer_state.json"), std::string::npos) << log();
}

}  // namespace
}  // namespace accel
