// rope_type dynamic in accel-train checkpoints: with packed documents longer than
// max_position_embeddings every micro-batch has its own length, so the frequencies a forward uses
// depend on the forwards before it (transformers' max_seq_len_cached, docs/models.md). Each
// rank's state is saved in trainer_state.json, and a resume continues bit for bit.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

// Prompt/completion documents of 14 to about 50 byte tokens.
fs::path write_documents(const fs::path& dir, int n) {
  const fs::path f = dir / "docs.jsonl";
  std::ofstream out(f);
  const char* words[] = {"red", "green", "blue", "cyan", "black", "white", "amber"};
  for (int i = 0; i < n; ++i) {
    std::string completion;
    for (int k = 0; k <= (i * 7) % 9; ++k) completion += std::string(words[(i + k) % 7]) + " ";
    out << nlohmann::json{{"prompt", "Q" + std::to_string(i % 9) + "?\n"},
                          {"completion", completion + "\n"}}
               .dump()
        << "\n";
  }
  return f;
}

std::string config(const fs::path& jsonl) {
  return R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 256, max_position_embeddings: 16,
        rope_scaling: {rope_type: dynamic, factor: 2.0}}
training: {seed: 5, micro_batch_size: 1, seq_len: 64, max_steps: 6, log_every: 1,
           progress: none, device: cpu}
optimizer: {lr: 0.01, warmup_steps: 1}
data: {source: jsonl, tokenizer: byte, eval_fraction: 0, packing: true, jsonl_files: [)" +
         jsonl.string() + R"(]}
checkpoint: {every_steps: 3, keep_last: 0}
)";
}

void expect_resume_reproduces(const std::string& extra, int world) {
  const fs::path d = accel::tool_test::fresh_temp_dir("dynamic_rope_resume", std::to_string(world));
  const fs::path cfg = accel::tool_test::write_config(d, config(write_documents(d, 40)));
  const std::string base = "--config " + cfg.string() + " " + extra;
  Result full = accel::tool_test::run_accel_train(base + " --output-dir " + (d / "full").string());
  ASSERT_EQ(full.code, 0) << full.output;
  const fs::path ck = d / "full" / "checkpoints" / "step_3";
  nlohmann::json state;
  std::ifstream(ck / "trainer_state.json") >> state;
  ASSERT_TRUE(state.contains("dynamic_rope_max_seq_len_cached")) << state.dump();
  const nlohmann::json saved = state["dynamic_rope_max_seq_len_cached"];
  ASSERT_EQ(saved.size(), static_cast<size_t>(world));
  for (const auto& v : saved) EXPECT_GE(v.get<int64_t>(), 16);  // 16: the original frequencies
  std::printf("dynamic RoPE state at step 3 (%d rank(s)): %s\n", world, saved.dump().c_str());
  Result resumed = accel::tool_test::run_accel_train(
      base + " --output-dir " + (d / "resumed").string() + " --resume " + ck.string());
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  auto a = accel::tool_test::read_losses(d / "full" / "metrics.jsonl");
  auto b = accel::tool_test::read_losses(d / "resumed" / "metrics.jsonl");
  for (int step = 4; step <= 6; ++step) {
    ASSERT_TRUE(b.count(step)) << resumed.output;
    EXPECT_EQ(b[step], a[step]) << "step " << step;
  }
  // The state matters here: the same checkpoint without it (as a fresh instance would start)
  // continues with other numbers.
  const fs::path stateless = d / "stateless" / "step_3";
  fs::create_directories(stateless.parent_path());
  fs::copy(ck, stateless, fs::copy_options::recursive);
  state.erase("dynamic_rope_max_seq_len_cached");
  std::ofstream(stateless / "trainer_state.json") << state.dump(1);
  Result fresh = accel::tool_test::run_accel_train(
      base + " --output-dir " + (d / "fresh").string() + " --resume " + stateless.string());
  ASSERT_EQ(fresh.code, 0) << fresh.output;
  auto c = accel::tool_test::read_losses(d / "fresh" / "metrics.jsonl");
  bool differs = false;
  for (int step = 4; step <= 6; ++step) differs = differs || c[step] != a[step];
  EXPECT_TRUE(differs) << "the saved dynamic RoPE state made no difference";
  fs::remove_all(d);
}

TEST(DynamicRopeResume, PackedDocumentsResumeBitForBit) { expect_resume_reproduces("", 1); }

TEST(DynamicRopeResume, PackedDocumentsResumeBitForBitOnTwoRanks) {
  expect_resume_reproduces("--set distributed_type=MULTI_CPU --set num_processes=2", 2);
}

}  // namespace
