// accel-train on JSONL fine-tuning data, end to end: masked loss and trained-token metrics,
// epochs, exact resume mid-epoch, the loss per trained token across ranks, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/data/test_util.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::read_metrics;
using accel::tool_test::Result;
using accel::tool_test::run_accel_train;
using accel::tool_test::write_config;

// Prompt/completion pairs of varied lengths (byte tokens).
fs::path write_sft(const fs::path& dir, int n) {
  const fs::path f = dir / "sft.jsonl";
  std::ofstream out(f);
  const char* words[] = {"red", "green", "blue", "cyan", "black", "white", "amber"};
  for (int i = 0; i < n; ++i) {
    std::string completion;
    for (int k = 0; k <= i % 5; ++k) completion += std::string(words[(i + k) % 7]) + " ";
    out << nlohmann::json{{"prompt", "Q" + std::to_string(i % 9) + ": colors?\n"},
                          {"completion", completion + "\n"}}
               .dump()
        << "\n";
  }
  return f;
}

std::string config(const fs::path& jsonl, const std::string& data_extra,
                   const std::string& training_extra) {
  return R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 256, max_position_embeddings: 64}
training: {seed: 3, micro_batch_size: 2, seq_len: 64, log_every: 1, progress: plain,
           device: cpu, )" +
         training_extra + R"(}
optimizer: {lr: 0.01, warmup_steps: 2}
data: {source: jsonl, tokenizer: byte, eval_fraction: 0, packing: false, jsonl_files: [)" +
         jsonl.string() + "], " + data_extra + R"(}
checkpoint: {every_steps: 3, keep_last: 0}
)";
}

fs::path temp_dir(const std::string& name) {
  return accel::tool_test::fresh_temp_dir("sft_train_test", name);
}

TEST(SftTrain, EpochsMaskedLossAndTrainedTokenMetrics) {
  const fs::path d = temp_dir("epochs");
  const fs::path cfg = write_config(d, config(write_sft(d, 24), "", "num_epochs: 1"));
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("data.format auto: prompt_completion"), std::string::npos) << r.output;
  // 24 samples, 2 per batch: 12 steps for the epoch.
  EXPECT_NE(r.output.find("training.max_steps 12 from training.num_epochs 1 x 12 batches"),
            std::string::npos)
      << r.output;
  auto m = read_metrics(d / "out" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 13u);
  double last_epoch = 0;
  for (int i = 0; i < 12; ++i) {
    const double f = m[i]["trained_fraction"].get<double>();
    EXPECT_GT(f, 0.2);  // the completions, not the prompts nor the padding
    EXPECT_LT(f, 0.8);
    EXPECT_GT(m[i]["epoch"].get<double>(), last_epoch);
    last_epoch = m[i]["epoch"].get<double>();
  }
  EXPECT_DOUBLE_EQ(last_epoch, 1.0);
  const auto& s = m.back();
  EXPECT_EQ(s["data"]["documents"], 24);
  EXPECT_EQ(s["data"]["truncated"], 0);
  EXPECT_GT(s["trained_tokens"].get<int64_t>(), 0);
  // The effective config holds the steps and still the epochs.
  const std::string yaml = accel::testing::read_bytes((d / "out" / "config.yaml").string());
  EXPECT_NE(yaml.find("max_steps: 12"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("num_epochs: 1"), std::string::npos) << yaml;
}

TEST(SftTrain, MaxStepsWinsOverNumEpochsWithANotice) {
  const fs::path d = temp_dir("both");
  const fs::path cfg = write_config(d, config(write_sft(d, 24), "", "num_epochs: 3, max_steps: 2"));
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("training.num_epochs=3.0 has no effect: training.max_steps"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(read_metrics(d / "out" / "metrics.jsonl").size(), 3u);
}

// Trainer's num_train_epochs (max_steps -1) through --training-args: 1.5 epochs of 12 batches
// with gradient_accumulation_steps 2 are 18 micro-batches, 9 steps, stopping mid-epoch.
TEST(SftTrain, NumTrainEpochsFromTrainingArgsRunsThoseEpochs) {
  const fs::path d = temp_dir("train_epochs");
  const fs::path cfg = write_config(d, config(write_sft(d, 24), "", "eval_every: 0"));
  const fs::path args = d / "args.json";
  std::ofstream(args) << R"({"num_train_epochs": 1.5, "max_steps": -1,
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2})";
  Result r = run_accel_train("--config " + cfg.string() + " --training-args " + args.string() +
                             " --output-dir " + (d / "out").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("max_steps=-1, num_train_epochs=1.5 -> training.num_epochs: 1.5"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("training.max_steps 9 from training.num_epochs 1.5 x 12 batches"),
            std::string::npos)
      << r.output;
  auto m = read_metrics(d / "out" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 10u);  // 9 steps and the summary
  EXPECT_EQ(m[8]["step"], 9);
  EXPECT_DOUBLE_EQ(m[8]["epoch"].get<double>(), 1.5);
  EXPECT_NEAR(m[5]["epoch"].get<double>(), 1.0, 1e-12);  // step 6: the first epoch's end
}

TEST(SftTrain, ResumeMidEpochReproducesTheUninterruptedRun) {
  const fs::path d = temp_dir("resume");
  const fs::path cfg = write_config(d, config(write_sft(d, 14), "", "num_epochs: 2"));
  Result full =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "full").string());
  ASSERT_EQ(full.code, 0) << full.output;
  // 7 steps an epoch: the checkpoint of step 9 is in the middle of the second.
  fs::create_directories(d / "cut" / "checkpoints");
  fs::copy(d / "full" / "checkpoints" / "step_9", d / "cut" / "checkpoints" / "step_9",
           fs::copy_options::recursive);
  Result resumed = run_accel_train("--config " + cfg.string() + " --output-dir " +
                                   (d / "cut").string() + " --resume auto");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  auto a = read_metrics(d / "full" / "metrics.jsonl");
  auto b = read_metrics(d / "cut" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 15u);
  ASSERT_EQ(b.size(), 6u);  // steps 10..14 and the summary
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(b[i]["step"], a[9 + i]["step"]);
    EXPECT_EQ(b[i]["loss"].get<double>(), a[9 + i]["loss"].get<double>()) << b[i]["step"];
    EXPECT_EQ(b[i]["epoch"].get<double>(), a[9 + i]["epoch"].get<double>());
  }
}

// Two ranks of one sample each see the samples one rank of two sees: the loss per trained token
// over both is the same step for step, however unequal the ranks' trained tokens.
TEST(SftTrain, LossIsPerTrainedTokenAcrossRanks) {
  const fs::path d = temp_dir("ranks");
  const fs::path jsonl = write_sft(d, 16);
  const fs::path cfg = write_config(d, config(jsonl, "", "max_steps: 4"));
  Result one =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "one").string());
  ASSERT_EQ(one.code, 0) << one.output;
  Result two =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "two").string() +
                      " --set distributed_type=MULTI_CPU --set num_processes=2"
                      " --set training.micro_batch_size=1");
  ASSERT_EQ(two.code, 0) << two.output;
  auto a = read_metrics(d / "one" / "metrics.jsonl");
  auto b = read_metrics(d / "two" / "metrics.jsonl");
  ASSERT_EQ(a.size(), b.size());
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(b[i]["loss"].get<double>(), a[i]["loss"].get<double>(), 2e-5) << "step " << i + 1;
  }
}

// Packed rows (segment ids, positions restarting per sample) and chat samples rendered by a
// template train end to end; packing trains more of each row than padding does.
TEST(SftTrain, PackedAndChatRunsTrain) {
  const fs::path d = temp_dir("packed");
  const fs::path jsonl = write_sft(d, 24);
  const fs::path cfg = write_config(d, config(jsonl, "", "max_steps: 3"));
  Result padded =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "padded").string());
  ASSERT_EQ(padded.code, 0) << padded.output;
  Result packed = run_accel_train("--config " + cfg.string() + " --output-dir " +
                                  (d / "packed").string() + " --set data.packing=true");
  ASSERT_EQ(packed.code, 0) << packed.output;
  EXPECT_NE(packed.output.find("packed rows of 64 tokens (positions restart per document)"),
            std::string::npos)
      << packed.output;
  const auto a = read_metrics(d / "padded" / "metrics.jsonl").back();
  const auto b = read_metrics(d / "packed" / "metrics.jsonl").back();
  EXPECT_GT(b["trained_tokens"].get<int64_t>(), a["trained_tokens"].get<int64_t>());

  const fs::path chat = d / "chat.jsonl";
  std::ofstream(chat)
      << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]})"
      << "\n"
      << R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "colors?"}, {"role": "assistant", "content": "red"}]})"
      << "\n";
  const fs::path cfg2 = write_config(d, config(chat, "chat_template: chatml", "max_steps: 2"));
  Result r =
      run_accel_train("--config " + cfg2.string() + " --output-dir " + (d / "chat").string() +
                      " --set training.micro_batch_size=1 --set data.packing=true"
                      // chatml's default system prompt is long for byte tokens
                      " --set training.seq_len=256 --set model.max_position_embeddings=256");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("data.format auto: messages"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("chat template chatml"), std::string::npos) << r.output;
}

TEST(SftTrain, BadInputNamesFileAndLine) {
  const fs::path d = temp_dir("bad");
  const fs::path jsonl = write_sft(d, 4);
  std::ofstream(jsonl, std::ios::app) << "{\"prompt\": \"x\"}\n";
  const fs::path cfg = write_config(d, config(jsonl, "", "max_steps: 1"));
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find(jsonl.string() + ":5: missing field 'completion'"), std::string::npos)
      << r.output;
  // A sample longer than seq_len with data.overlong error.
  const fs::path cfg2 = write_config(d, config(write_sft(d, 4), "overlong: error", "max_steps: 1"));
  r = run_accel_train("--config " + cfg2.string() + " --output-dir " + (d / "out2").string() +
                      " --set training.seq_len=16");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("sft.jsonl:1: the sample has"), std::string::npos) << r.output;
  // Parquet is refused with the conversion.
  std::ofstream(d / "t.parquet") << "PAR1";
  const fs::path cfg3 = write_config(d, config(d / "t.parquet", "", "max_steps: 1"));
  r = run_accel_train("--config " + cfg3.string() + " --output-dir " + (d / "out3").string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("to_json('train.jsonl')"), std::string::npos) << r.output;
}

}  // namespace
