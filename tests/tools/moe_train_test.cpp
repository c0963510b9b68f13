// A tiny mixture-of-experts model trained by accel-train on the CPU: the loss falls, the router's
// aux loss is logged on its own (metrics.jsonl, summary, the "done" line) with the tokens per
// expert, the checkpoint is a Hugging Face qwen3_moe folder, activation checkpointing gives the
// same losses, and accel-bench reports the expert load.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/decoder.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::read_metrics;
using accel::tool_test::Result;
using accel::tool_test::run_accel_train;
using accel::tool_test::write_config;

// A tiny Qwen3-MoE (layer 0 sparse: 4 experts, top-2; layer 1 dense) on a repetitive text that
// it learns within a few steps, two micro-batches per step.
std::string tiny_moe_config(const fs::path& dir) {
  const fs::path text = dir / "text.txt";
  {
    std::ofstream t(text);
    for (int i = 0; i < 400; ++i) t << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  return R"(
model: {name: qwen3_moe, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,
        num_key_value_heads: 2, head_dim: 8, intermediate_size: 64, moe_intermediate_size: 16,
        num_experts: 4, num_experts_per_tok: 2, norm_topk_prob: true, mlp_only_layers: [1],
        router_aux_loss_coef: 0.05, output_router_logits: true, vocab_size: 256,
        max_position_embeddings: 64}
training: {seed: 5, max_steps: 12, micro_batch_size: 4, seq_len: 16, log_every: 1, progress: plain,
           device: cpu}
optimizer: {lr: 0.01, lr_schedule: constant}
data: {source: text, tokenizer: byte, eval_fraction: 0.1, text_files: [)" +
         text.string() + R"(]}
checkpoint: {every_steps: 0, at_end: true}
gradient_accumulation_steps: 2
)";
}

TEST(MoeTraining, LossFallsAndTheAuxLossIsLoggedWithTheExpertLoad) {
  fs::path d = accel::tool_test::fresh_temp_dir("moe_train_test", "run");
  fs::path cfg = write_config(d, tiny_moe_config(d));
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("router aux loss"), std::string::npos) << r.output;
  auto m = read_metrics(d / "out" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 13u) << "12 steps + summary";
  for (size_t i = 0; i + 1 < m.size(); ++i) {
    ASSERT_TRUE(m[i].contains("aux_loss")) << m[i].dump();
    // num_experts x sum_e (slot share) x (mean probability): about num_experts_per_tok (2) when
    // the load is even, more when it is not.
    EXPECT_GT(m[i]["aux_loss"].get<double>(), 0.5);
    EXPECT_EQ(m[i]["expert_tokens_mean"].get<double>(), 2 * 4 * 16 * 2 / 4.0)
        << "2 micro-batches x 4 x 16 tokens x top-2 over 4 experts of the one sparse layer";
    EXPECT_GE(m[i]["expert_tokens_imbalance"].get<double>(), 1.0);
  }
  const double first = m.front()["loss"], last = m[m.size() - 2]["loss"];
  EXPECT_LT(last, first - 0.3) << "the loss should fall on the synthetic data";
  const nlohmann::json& summary = m.back();
  ASSERT_TRUE(summary["summary"].get<bool>());
  EXPECT_TRUE(summary["final_aux_loss"].is_number());
  ASSERT_TRUE(summary["expert_tokens"].contains("0")) << summary.dump();
  EXPECT_FALSE(summary["expert_tokens"].contains("1")) << "layer 1 is dense (mlp_only_layers)";
  EXPECT_EQ(summary["expert_tokens"]["0"].size(), 4u);
  EXPECT_LT(summary["num_active_parameters"].get<int64_t>(),
            summary["num_parameters"].get<int64_t>());
  // The final checkpoint is a Hugging Face qwen3_moe folder.
  fs::path ck = d / "out" / "checkpoints" / "step_12";
  accel::DecoderConfig lc = accel::read_hf_model_config((ck / "config.json").string());
  EXPECT_EQ(lc.model_type, "qwen3_moe");
  EXPECT_EQ(lc.num_experts, 4);
  accel::CausalLM model(lc, accel::DType::F32, accel::Device::cpu(), 0);
  accel::load_hf_weights(model, ck.string());

  // Activation checkpointing recomputes the same routing: the same losses.
  Result rc =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "ckpt").string() +
                      " --set training.activation_checkpointing=true");
  ASSERT_EQ(rc.code, 0) << rc.output;
  auto mc = read_metrics(d / "ckpt" / "metrics.jsonl");
  ASSERT_EQ(mc.size(), m.size());
  for (size_t i = 0; i + 1 < m.size(); ++i) {
    EXPECT_NEAR(mc[i]["loss"].get<double>(), m[i]["loss"].get<double>(), 1e-5) << i;
    EXPECT_NEAR(mc[i]["aux_loss"].get<double>(), m[i]["aux_loss"].get<double>(), 1e-5) << i;
  }
  fs::remove_all(d);
}

TEST(MoeTraining, AccelBenchReportsTheExpertLoad) {
  fs::path d = accel::tool_test::fresh_temp_dir("moe_train_test", "bench");
  fs::path cfg = write_config(d, tiny_moe_config(d));
  const std::string cmd = std::string(ACCEL_BIN_DIR) + "/accel-bench --config " + cfg.string() +
                          " --strategies single --precisions no --steps 3 --warmup 1 --device cpu" +
                          " --work-dir " + (d / "work").string() + " --json " +
                          (d / "r.json").string() + " > " + (d / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream log(d / "out.txt");
  const std::string out((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("expert load single/no: tokens per expert"), std::string::npos) << out;
  std::ifstream in(d / "r.json");
  nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 1u);
  const nlohmann::json& load = rows[0]["expert_load"];
  ASSERT_TRUE(load.is_object()) << rows.dump();
  EXPECT_LE(load["min"].get<double>(), load["mean"].get<double>());
  EXPECT_GE(load["max"].get<double>(), load["mean"].get<double>());
  EXPECT_GE(load["imbalance"].get<double>(), 1.0);
  EXPECT_TRUE(rows[0]["final_aux_loss"].is_number());
  fs::remove_all(d);
}

}  // namespace
