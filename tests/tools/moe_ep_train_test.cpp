// accel-train with expert parallelism on the real MoE model (CPU ranks through the local
// launcher): a checkpoint saved by 4 ranks under ZeRO-2 with expert_parallel_size 2 holds every
// expert, resumes on one process and on 2 ranks (FSDP, ep 2) with the uninterrupted run's losses,
// consolidates to a Hugging Face folder with all experts, and init_from of that folder under ep 2
// equals the single process (DDP for the rest).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "models/decoder.h"
#include "runtime/safetensors.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

// 8 samples per step in micro-batches of one sample: processes x gradient_accumulation_steps = 8.
// The aux loss is a mean over micro-batches, and the synthetic data deals samples to ranks in
// turn, so only one-sample micro-batches are the same micro-batches in every layout.
const char* kConfig = R"(
model: {name: qwen3_moe, hidden_size: 16, num_hidden_layers: 2, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 8, intermediate_size: 32, moe_intermediate_size: 8,
        num_experts: 8, num_experts_per_tok: 2, norm_topk_prob: true, mlp_only_layers: [1],
        router_aux_loss_coef: 0.05, output_router_logits: true, vocab_size: 64,
        max_position_embeddings: 32}
training: {seed: 3, max_steps: 4, micro_batch_size: 1, seq_len: 8, log_every: 1, progress: none,
           device: cpu}
optimizer: {lr: 0.01, lr_schedule: constant}
data: {source: synthetic}
checkpoint: {every_steps: 2, keep_last: 0}
)";

const std::string kEp2 = " --set distributed.expert_parallel_size=2";
const std::string kZero2x4 =
    "--set distributed_type=DEEPSPEED --set deepspeed_config.zero_stage=2 --set num_processes=4 "
    "--set gradient_accumulation_steps=2" +
    kEp2;
const std::string kFsdpx2 =
    "--set distributed_type=FSDP --set num_processes=2 --set gradient_accumulation_steps=4" + kEp2;
const std::string kSingle = "--set gradient_accumulation_steps=8";

class MoeEpTrain : public accel::tool_test::ConfigFolderTest {
 protected:
  MoeEpTrain() : ConfigFolderTest("accel_moe_ep", kConfig) {}
  Result train(const std::string& out, const std::string& extra) {
    return ConfigFolderTest::train(out, extra, "OMP_NUM_THREADS=1");
  }
  void expect_same_losses(const std::string& out, const std::map<int, double>& want, int from) {
    const std::map<int, double> got = losses(out);
    for (int s = from; s <= 4; ++s) {
      ASSERT_TRUE(got.count(s)) << out << ": no step " << s;
      EXPECT_NEAR(got.at(s), want.at(s), 1e-5 * std::abs(want.at(s))) << out << " step " << s;
    }
  }
};

// Every expert of the sparse layer (0) is in the folder, and a full model loads it.
void expect_every_expert(const fs::path& folder) {
  accel::SafetensorsReader r((folder / "model.safetensors").string());
  for (int e = 0; e < 8; ++e)
    for (const char* w : {"gate_proj", "up_proj", "down_proj"}) {
      const std::string n = "model.layers.0.mlp.experts." + std::to_string(e) + "." + w + ".weight";
      EXPECT_TRUE(r.contains(n)) << folder << ": " << n;
    }
  accel::DecoderConfig c = accel::read_hf_model_config((folder / "config.json").string());
  accel::CausalLM model(c, accel::DType::F32, accel::Device::cpu(), 0);
  accel::load_hf_weights(model, folder.string());
}

TEST_F(MoeEpTrain, CheckpointUnderEpResumesEverywhereAndConsolidates) {
  Result a = train("ep", kZero2x4);
  ASSERT_EQ(a.code, 0) << a.output;
  EXPECT_NE(a.output.find("expert parallelism: 2 ranks per EP group, 4 local experts"),
            std::string::npos)
      << a.output;
  const std::map<int, double> ref = losses("ep");
  ASSERT_EQ(ref.size(), 4u) << a.output;
  // The same run on one process: expert parallelism changes nothing.
  Result s = train("single", kSingle);
  ASSERT_EQ(s.code, 0) << s.output;
  expect_same_losses("single", ref, 1);
  // Resumed at step 2 on one process and on 2 ranks under FSDP with ep 2.
  for (const auto& [name, args] :
       {std::pair{"resumed_single", kSingle}, {"resumed_fsdp", kFsdpx2}}) {
    Result r = train(name, args + " --resume " + step("ep", 2).string());
    ASSERT_EQ(r.code, 0) << name << "\n" << r.output;
    expect_same_losses(name, ref, 3);
  }
  expect_every_expert(step("ep", 2));
  Result cons =
      accel::tool_test::run_command(std::string(ACCEL_BIN_DIR) + "/accel-checkpoint consolidate " +
                                    step("ep", 4).string() + " " + (dir_ / "hf").string());
  ASSERT_EQ(cons.code, 0) << cons.output;
  expect_every_expert(dir_ / "hf");
  // init_from the consolidated folder: each EP rank reads its experts; the same losses as one
  // process reading all of them.
  const std::string from = " --set model.init_from=" + (dir_ / "hf").string() +
                           " --set training.max_steps=2 --set checkpoint.every_steps=0";
  Result ia = train("init_ep",
                    "--set distributed_type=MULTI_CPU --set num_processes=2 --set "
                    "gradient_accumulation_steps=4" +
                        kEp2 + from);
  ASSERT_EQ(ia.code, 0) << ia.output;
  Result ib = train("init_single", kSingle + from);
  ASSERT_EQ(ib.code, 0) << ib.output;
  const std::map<int, double> want = losses("init_single");
  const std::map<int, double> got = losses("init_ep");
  ASSERT_EQ(got.size(), 2u) << ia.output;
  for (int st = 1; st <= 2; ++st)
    EXPECT_NEAR(got.at(st), want.at(st), 1e-5 * std::abs(want.at(st))) << "init_from step " << st;
  EXPECT_GT(std::abs(want.at(1) - ref.at(1)), 1e-3) << "init_from should start elsewhere";
  // A YAML whose model section names only init_from: the experts come from the folder.
  const fs::path bare = dir_ / "bare.yaml";
  {
    std::string text = kConfig;
    text.replace(text.find("model: {"), text.find("training:") - text.find("model: {"),
                 "model: {init_from: " + (dir_ / "hf").string() + "}\n");
    std::ofstream(bare) << text;
  }
  Result ic = accel::tool_test::run_command(
      "OMP_NUM_THREADS=1 " + std::string(ACCEL_BIN_DIR) + "/accel-train --config " + bare.string() +
      " --output-dir " + (dir_ / "init_bare").string() +
      " --set distributed_type=MULTI_CPU --set num_processes=2 --set "
      "gradient_accumulation_steps=4 --set training.max_steps=1 --set checkpoint.every_steps=0" +
      kEp2);
  ASSERT_EQ(ic.code, 0) << ic.output;
  EXPECT_NEAR(losses("init_bare").at(1), want.at(1), 1e-5 * std::abs(want.at(1)));
}

// Evaluation and the final greedy sample run their forwards on every rank together (the
// all-to-all makes them collective): the run ends instead of hanging.
TEST_F(MoeEpTrain, EvaluationAndSamplingRunOnEveryRank) {
  {
    std::ofstream t(dir_ / "text.txt");
    for (int i = 0; i < 300; ++i) t << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  Result r = accel::tool_test::run_command(
      "OMP_NUM_THREADS=1 timeout 120 " + std::string(ACCEL_BIN_DIR) + "/accel-train --config " +
      (dir_ / "config.yaml").string() + " --output-dir " + (dir_ / "eval").string() +
      " --set model.vocab_size=256 --set data.source=text --set data.tokenizer=byte --set "
      "data.eval_fraction=0.1 --set data.text_files=" +
      (dir_ / "text.txt").string() +
      " --set training.eval_every=2 --set training.sample_tokens=4 --set "
      "distributed_type=MULTI_CPU --set num_processes=2 --set gradient_accumulation_steps=4" +
      kEp2);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("eval loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sample (greedy):"), std::string::npos) << r.output;
}

}  // namespace
