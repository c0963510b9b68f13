// fp8 delayed-scaling state in accel-train checkpoints (CPU emulation): a TE-recipe run resumed
// from a checkpoint continues with bit-identical losses (one process and two DDP ranks); dynamic
// scaling (AO) writes and needs no state; a checkpoint whose fp8 state does not fit the run is
// refused with a message saying what differs.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/safetensors.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

// Every dimension a multiple of 16, so every Linear runs in fp8. A short amax history with
// 'max' and interval 2 make each part of the state matter: the histories, the scales and the
// update count (which steps recompute).
const char* kConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
mixed_precision: fp8
fp8_config: {backend: TE, amax_history_len: 4, amax_compute_algo: max, interval: 2}
training: {seed: 11, max_steps: 6, micro_batch_size: 4, seq_len: 16, log_every: 1,
           progress: none, device: cpu}
optimizer: {lr: 0.01, warmup_steps: 1, lr_schedule: cosine}
data: {source: synthetic}
checkpoint: {every_steps: 3, keep_last: 0}
)";

class Fp8Resume : public accel::tool_test::ConfigFolderTest {
 protected:
  Fp8Resume() : ConfigFolderTest("accel_fp8_resume", kConfig) {}
  fs::path step3(const std::string& out) { return dir_ / out / "checkpoints" / "step_3"; }
  // Runs `out` to the end, then resumes from its step-3 checkpoint into `out`_resumed with the
  // same settings; expects steps 4-6 bit for bit.
  void expect_resume_reproduces(const std::string& out, const std::string& extra) {
    Result full = train(out, extra);
    ASSERT_EQ(full.code, 0) << full.output;
    full_output_ = full.output;
    Result resumed = train(out + "_resumed", extra + " --resume " + step3(out).string());
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    std::map<int, double> a = losses(out), b = losses(out + "_resumed");
    ASSERT_EQ(a.size(), 6u) << full.output;
    for (int step = 4; step <= 6; ++step) {
      ASSERT_TRUE(b.count(step)) << "resumed run has no step " << step << "\n" << resumed.output;
      EXPECT_EQ(b[step], a[step]) << "step " << step << " (fp8 state not restored?)";
    }
  }
  std::string full_output_;  // the uninterrupted run's, from expect_resume_reproduces
};

TEST_F(Fp8Resume, DelayedScalingResumesBitForBit) {
  expect_resume_reproduces("te", "");
  // The state file: per layer and role, written once, listed in trainer_state.json.
  const fs::path ck = step3("te");
  accel::SafetensorsReader f((ck / "fp8_state.safetensors").string());
  EXPECT_EQ(f.info("model.layers.1.mlp.down_proj.grad_output.amax_history").shape,
            (accel::Shape{4}));
  EXPECT_TRUE(f.contains("model.layers.0.self_attn.q_proj.input.scale"));
  EXPECT_TRUE(f.contains("model.layers.0.self_attn.q_proj.weight.scale_inv"));
  EXPECT_EQ(f.metadata().at("updates"), "3");
  EXPECT_EQ(f.metadata().at("amax_history_len"), "4");
  std::ifstream in(ck / "trainer_state.json");
  nlohmann::json j;
  in >> j;
  EXPECT_EQ(j.at("fp8_state_file"), "fp8_state.safetensors");
}

TEST_F(Fp8Resume, DelayedScalingResumesBitForBitOnTwoRanks) {
  expect_resume_reproduces("ddp", "--set distributed_type=MULTI_CPU --set num_processes=2");
  EXPECT_TRUE(fs::exists(step3("ddp") / "fp8_state.safetensors"));
  EXPECT_FALSE(fs::exists(step3("ddp") / "fp8_state.rank1.safetensors"));
}

TEST_F(Fp8Resume, DynamicScalingWritesAndNeedsNoState) {
  expect_resume_reproduces("ao", "--set fp8_config.backend=AO");
  EXPECT_FALSE(fs::exists(step3("ao") / "fp8_state.safetensors"));
  std::ifstream in(step3("ao") / "trainer_state.json");
  nlohmann::json j;
  in >> j;
  EXPECT_FALSE(j.contains("fp8_state_file"));
}

// A mixture-of-experts model's experts run in fp8 under TE with a scaling state per expert
// projection, which the checkpoint carries; on two ranks with expert parallelism (each rank runs
// two experts, every rank holds every expert's state) too.
const std::string kMoe =
    "--set model.name=qwen3_moe --set model.moe_intermediate_size=16 --set model.num_experts=4 "
    "--set model.num_experts_per_tok=2 --set model.norm_topk_prob=true";

TEST_F(Fp8Resume, MoeExpertsResumeBitForBit) {
  expect_resume_reproduces("moe", kMoe);
  // 2 x (4 attention projections + 12 expert projections) + lm_head; the routers (out 4) in bf16.
  EXPECT_NE(full_output_.find("fp8: 33 of 35 linear layers in fp8"), std::string::npos)
      << full_output_;
  EXPECT_NE(full_output_.find("in fp8: 24 mixture-of-experts expert projections"),
            std::string::npos)
      << full_output_;
  accel::SafetensorsReader f((step3("moe") / "fp8_state.safetensors").string());
  EXPECT_TRUE(f.contains("model.layers.1.mlp.experts.3.down_proj.grad_output.amax_history"));
  EXPECT_TRUE(f.contains("model.layers.0.mlp.experts.0.gate_proj.input.scale"));
}

TEST_F(Fp8Resume, MoeExpertsResumeBitForBitUnderExpertParallelism) {
  expect_resume_reproduces("moe_ep", kMoe +
                                         " --set distributed_type=MULTI_CPU --set num_processes=2"
                                         " --set distributed.expert_parallel_size=2");
  accel::SafetensorsReader f((step3("moe_ep") / "fp8_state.safetensors").string());
  for (const char* layer :
       {"model.layers.0.mlp.experts.0.up_proj", "model.layers.0.mlp.experts.3.up_proj"})
    EXPECT_TRUE(f.contains(std::string(layer) + ".weight.amax_history")) << layer;
}

// A tied LM head runs in fp8 under TE with its own slots (lm_head.*), which the checkpoint carries.
TEST_F(Fp8Resume, TiedHeadResumesBitForBit) {
  expect_resume_reproduces("tied", "--set model.tie_word_embeddings=true");
  EXPECT_NE(full_output_.find("15 of 15 linear layers in fp8"), std::string::npos) << full_output_;
  EXPECT_NE(full_output_.find("in fp8: lm_head (tied to model.embed_tokens)"), std::string::npos)
      << full_output_;
  accel::SafetensorsReader f((step3("tied") / "fp8_state.safetensors").string());
  EXPECT_TRUE(f.contains("lm_head.input.scale"));
  EXPECT_TRUE(f.contains("lm_head.grad_output.amax_history"));
  EXPECT_EQ(f.metadata().at("tied_lm_head"), "fp8");
  EXPECT_EQ(f.metadata().at("updates"), "3");
}

// A checkpoint written when tied heads still ran in bf16 (its fp8 state has no lm_head slots and
// no tied_lm_head key) resumes: every saved layer continues with its state, the head starts
// afresh, and the run says so.
TEST_F(Fp8Resume, TiedHeadCheckpointFromBeforeTiedFp8ResumesWithANote) {
  const std::string tied = "--set model.tie_word_embeddings=true";
  Result full = train("tied", tied);
  ASSERT_EQ(full.code, 0) << full.output;
  const fs::path old = dir_ / "old" / "step_3";
  fs::create_directories(old.parent_path());
  fs::copy(step3("tied"), old, fs::copy_options::recursive);
  const std::string file = (old / "fp8_state.safetensors").string();
  std::vector<std::pair<std::string, accel::Tensor>> kept;
  std::map<std::string, std::string> meta;
  {
    accel::SafetensorsReader f(file);
    for (const std::string& n : f.names())
      if (n.rfind("lm_head.", 0) != 0) kept.push_back({n, f.load(n, accel::MemCategory::Other)});
    meta = f.metadata();
  }
  ASSERT_EQ(kept.size(), 14u * 9u);  // the projections' slots only
  meta.erase("tied_lm_head");
  accel::save_safetensors(file, kept, meta);
  Result resumed = train("from_old", tied + " --resume " + old.string());
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("lm_head (tied to model.embed_tokens) has no saved state"),
            std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  std::map<int, double> b = losses("from_old");
  for (int step = 4; step <= 6; ++step) EXPECT_TRUE(b.count(step)) << resumed.output;
}

TEST_F(Fp8Resume, MismatchedStateIsRefusedWithWhatDiffers) {
  Result te = train("te");
  ASSERT_EQ(te.code, 0) << te.output;
  const std::string from = " --resume " + step3("te").string();

  Result len = train("len", "--set fp8_config.amax_history_len=8" + from);
  EXPECT_NE(len.code, 0) << len.output;
  EXPECT_NE(len.output.find("amax_history_len changed"), std::string::npos) << len.output;
  EXPECT_NE(len.output.find("amax_history_len: 4"), std::string::npos) << len.output;

  Result fmt = train("fmt", "--set fp8_config.fp8_format=E4M3" + from);
  EXPECT_NE(fmt.code, 0) << fmt.output;
  EXPECT_NE(fmt.output.find("fp8_format HYBRID, this run uses E4M3"), std::string::npos)
      << fmt.output;

  // A checkpoint of a run without fp8 resumed as a TE run.
  Result bf16 = train("bf16", "--set mixed_precision=bf16");
  ASSERT_EQ(bf16.code, 0) << bf16.output;
  Result as_te = train("as_te", "--resume " + step3("bf16").string());
  EXPECT_NE(as_te.code, 0) << as_te.output;
  EXPECT_NE(as_te.output.find("has no fp8_state.safetensors"), std::string::npos) << as_te.output;

  // The reverse is fine: a TE checkpoint resumed with dynamic scaling ignores the state.
  Result ao = train("ao", "--set fp8_config.backend=AO" + from);
  EXPECT_EQ(ao.code, 0) << ao.output;
  EXPECT_NE(ao.output.find("fp8 delayed-scaling state ignored"), std::string::npos) << ao.output;

  // A listed state file that went missing.
  fs::create_directories(dir_ / "copy" / "checkpoints");
  fs::copy(step3("te"), dir_ / "copy" / "step_3", fs::copy_options::recursive);
  fs::remove(dir_ / "copy" / "step_3" / "fp8_state.safetensors");
  Result gone = train("gone", "--resume " + (dir_ / "copy" / "step_3").string());
  EXPECT_NE(gone.code, 0) << gone.output;
  EXPECT_NE(gone.output.find("lists fp8_state.safetensors but the file is missing"),
            std::string::npos)
      << gone.output;
}

}  // namespace
