// accel-train end to end, as a user runs it: exit codes, messages, outputs, resume.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "models/decoder.h"
#include "runtime/safetensors.h"
#include "tests/data/test_util.h"
#include "tests/tools/run_tool.h"
#include "tools/trainer/loss_chart.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::read_metrics;
using accel::tool_test::Result;
using accel::tool_test::run_accel_train;
using accel::tool_test::write_config;

fs::path temp_dir(const std::string& name) {
  return accel::tool_test::fresh_temp_dir("accel_train_test", name);
}

// A tiny model on synthetic tokens: seconds per run.
const char* kTinyConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 7, max_steps: 10, micro_batch_size: 4, seq_len: 16, log_every: 1, progress: plain,
           device: cpu}
optimizer: {lr: 0.01, warmup_steps: 2, lr_schedule: cosine}
data: {source: synthetic}
checkpoint: {every_steps: 5, keep_last: 0}
)";

TEST(AccelTrain, TrainsWritesMetricsAndHfCheckpoint) {
  fs::path d = temp_dir("basic");
  fs::path cfg = write_config(d, kTinyConfig);
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string());
  ASSERT_EQ(r.code, 0) << r.output;
  auto m = read_metrics(d / "out" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 11u);  // 10 steps + summary
  for (const char* k :
       {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "elapsed_s"})
    EXPECT_TRUE(m[0].contains(k)) << k;
  EXPECT_TRUE(m[0]["mfu"].is_null());  // no known peak on a CPU
  EXPECT_TRUE(m.back()["summary"].get<bool>());
  fs::path ck = d / "out" / "checkpoints" / "step_10";
  ASSERT_TRUE(fs::exists(ck / "trainer_state.json"));
  EXPECT_TRUE(fs::exists(ck / "config.yaml"));
  // The checkpoint is a Hugging Face folder our own loader (and transformers) reads.
  accel::DecoderConfig lc = accel::read_hf_model_config((ck / "config.json").string());
  accel::CausalLM model(lc, accel::DType::F32, accel::Device::cpu(), 0);
  accel::load_hf_weights(model, ck.string());
  EXPECT_TRUE(fs::exists(d / "out" / "config.yaml"));
}

TEST(AccelTrain, ResumeReproducesTheUninterruptedRun) {
  fs::path d = temp_dir("resume");
  fs::path cfg = write_config(d, kTinyConfig);
  Result full =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "full").string());
  ASSERT_EQ(full.code, 0) << full.output;
  // An interrupted run: the output folder of a run killed after logging step 7, its newest
  // checkpoint at step 5.
  fs::create_directories(d / "cut" / "checkpoints");
  fs::copy(d / "full" / "checkpoints" / "step_5", d / "cut" / "checkpoints" / "step_5",
           fs::copy_options::recursive);
  {
    std::ifstream in(d / "full" / "metrics.jsonl");
    std::ofstream out(d / "cut" / "metrics.jsonl");
    std::string line;
    for (int i = 0; i < 7 && std::getline(in, line); ++i) out << line << "\n";
  }
  Result resumed = run_accel_train("--config " + cfg.string() + " --output-dir " +
                                   (d / "cut").string() + " --resume auto");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  auto a = read_metrics(d / "full" / "metrics.jsonl");
  auto b = read_metrics(d / "cut" / "metrics.jsonl");
  // Steps 1..5 from before the checkpoint, 6..10 from the resumed run (the interrupted run's
  // lines for steps 6 and 7 are dropped: every step once), the summary.
  ASSERT_EQ(b.size(), 11u);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(b[i]["step"], a[i]["step"]);
    EXPECT_EQ(b[i]["loss"].get<double>(), a[i]["loss"].get<double>()) << "step " << b[i]["step"];
  }
  // The resumed run's loss chart has every step once.
  accel::LossCurve chart = accel::read_loss_curve((d / "cut" / "metrics.jsonl").string(), "cut");
  EXPECT_EQ(chart.train.size(), 10u);
  const std::string svg = accel::testing::read_bytes((d / "cut" / "loss.svg").string());
  const size_t at = svg.find("class=\"train\" points=\"");
  ASSERT_NE(at, std::string::npos);
  const std::string points = svg.substr(at, svg.find('"', at + 23) - at);
  EXPECT_EQ(std::count(points.begin(), points.end(), ','), 10) << points;
  accel::SafetensorsReader wa(
      (d / "full" / "checkpoints" / "step_10" / "model.safetensors").string());
  accel::SafetensorsReader wb(
      (d / "cut" / "checkpoints" / "step_10" / "model.safetensors").string());
  for (const std::string& n : wa.names())
    EXPECT_EQ(wa.load(n).to_vector(), wb.load(n).to_vector()) << n;
}

TEST(AccelTrain, UnknownKeyIsAConfigErrorWithSuggestion) {
  fs::path d = temp_dir("badkey");
  fs::path cfg = write_config(d, std::string(kTinyConfig) + "\nlogging: {metrics_fle: x.jsonl}\n");
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("logging.metrics_fle"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("metrics_file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(cfg.string()), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(d / "out"));
}

TEST(AccelTrain, EvaluationWithoutAnEvaluationSplitIsAnError) {
  fs::path d = temp_dir("noeval");
  fs::path cfg = write_config(d, kTinyConfig);
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string() +
                             " --set training.eval_every=5");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("training.eval_every is 5 but data.source synthetic has no evaluation "
                          "data: set training.eval_every: 0"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(d / "out"));  // nothing written: the corrected run can use the folder
}

TEST(AccelTrain, RefusesAnOutputFolderHoldingAnotherRun) {
  fs::path d = temp_dir("occupied");
  fs::path cfg = write_config(d, kTinyConfig);
  fs::create_directories(d / "out");
  std::ofstream(d / "out" / "metrics.jsonl") << "{\"step\": 1}\n";
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string() +
                             " --set training.max_steps=1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("already holds another run"), std::string::npos) << r.output;
  std::ifstream in(d / "out" / "metrics.jsonl");
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "{\"step\": 1}");  // untouched
}

TEST(AccelTrain, MissingDataFileNamesTheFile) {
  fs::path d = temp_dir("nodata");
  fs::path cfg = write_config(d, kTinyConfig);
  Result r =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string() +
                      " --set data.source=shards --set data.train_path=/nonexistent/train.tok");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("/nonexistent/train.tok"), std::string::npos) << r.output;
}

TEST(AccelTrain, InitFromCheckpointWithWrongShapesNamesTensorAndShapes) {
  fs::path d = temp_dir("initfrom");
  fs::path cfg = write_config(d, kTinyConfig);
  Result first = run_accel_train("--config " + cfg.string() + " --output-dir " +
                                 (d / "a").string() + " --set training.max_steps=1");
  ASSERT_EQ(first.code, 0) << first.output;
  // A folder whose config.json promises a wider MLP than its weights have.
  fs::path bad = d / "bad";
  fs::copy(d / "a" / "checkpoints" / "step_1", bad, fs::copy_options::recursive);
  accel::DecoderConfig lc = accel::read_hf_model_config((bad / "config.json").string());
  lc.intermediate_size = 48;
  accel::write_hf_model_config(lc, (bad / "config.json").string());
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "b").string() +
                             " --set model.init_from=" + bad.string());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("model.layers.0.mlp.gate_proj.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[64, 32]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[48, 32]"), std::string::npos) << r.output;
}

// FSDP with the fp8 all-gather through accel-train: two CPU ranks, the summary's per-unit traffic
// shows the layers' gathers moving fewer bytes than bf16 would, and the losses equal the run
// that gathers bf16 and casts afterwards.
TEST(AccelTrain, FsdpFp8AllGatherReportsPerUnitTraffic) {
  fs::path d = temp_dir("fsdpfp8");
  std::string text = std::string(kTinyConfig) +
                     "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: fp8\n"
                     "fsdp_config: {fsdp_version: 2}\n"
                     "fp8_config: {backend: AO, enable_fsdp_float8_all_gather: true}\n";
  fs::path cfg = write_config(d, text);
  Result r = run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "out").string() +
                             " --set model.hidden_size=64 --set model.intermediate_size=128"
                             " --set checkpoint.every_steps=0");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("fsdp traffic (rank 0): all-gathers"), std::string::npos) << r.output;
  auto m = read_metrics(d / "out" / "metrics.jsonl");
  ASSERT_FALSE(m.empty());
  const nlohmann::json& summary = m.back();
  ASSERT_TRUE(summary.contains("fsdp_unit_comm")) << summary.dump();
  int fp8_units = 0;
  for (const auto& u : summary["fsdp_unit_comm"]) {
    EXPECT_GT(u["all_gathers"].get<int64_t>(), 0) << u.dump();
    if (u["fp8_params"].get<int64_t>() == 0) continue;
    ++fp8_units;
    EXPECT_LT(u["all_gather_bytes"].get<int64_t>(),
              u["compute_dtype_all_gather_bytes"].get<int64_t>() * 3 / 4)
        << u.dump();
  }
  EXPECT_EQ(fp8_units, 2) << summary.dump();  // both decoder layers
  // Casting the shards before the gather is bit-identical to casting the gathered weight.
  Result off =
      run_accel_train("--config " + cfg.string() + " --output-dir " + (d / "off").string() +
                      " --set model.hidden_size=64 --set model.intermediate_size=128"
                      " --set checkpoint.every_steps=0"
                      " --set fp8_config.enable_fsdp_float8_all_gather=false");
  ASSERT_EQ(off.code, 0) << off.output;
  auto m_off = read_metrics(d / "off" / "metrics.jsonl");
  ASSERT_EQ(m_off.size(), m.size());
  for (size_t i = 0; i + 1 < m.size(); ++i)
    EXPECT_EQ(m[i]["loss"].get<double>(), m_off[i]["loss"].get<double>()) << "step " << i + 1;
  fs::remove_all(d);
}

TEST(AccelTrain, PrintConfigPrintsEffectiveYaml) {
  fs::path d = temp_dir("print");
  fs::path cfg = write_config(d, kTinyConfig);
  Result r =
      run_accel_train("--config " + cfg.string() + " --print-config --set training.max_steps=77");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("max_steps: 77"), std::string::npos) << r.output;
}

// A TrainingArguments dump (TrainingArguments(...).to_json_string()) trains with the mapping
// listed at start: run length, batch, logging, evaluation and checkpoint cadence come from it.
TEST(AccelTrain, TrainsFromAHuggingFaceTrainingArgumentsDump) {
  fs::path d = temp_dir("training_args");
  {
    std::ofstream t(d / "text.txt");
    for (int i = 0; i < 400; ++i) t << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  fs::path cfg = write_config(d, R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 64,
        max_position_embeddings: 64}
training: {seq_len: 16, progress: plain}
data: {source: text, text_files: [)" +
                                     (d / "text.txt").string() + R"(], eval_fraction: 0.1}
)");
  const std::string args = std::string(ACCEL_TEST_DATA_DIR) + "/config/training_args.json";
  Result r = run_accel_train("--config " + cfg.string() + " --training-args " + args +
                             " --output-dir " + (d / "out").string());
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* line :
       {"note: training_args learning_rate=0.001 -> optimizer.lr: 0.001",
        "note: training_args max_steps=30 -> training.max_steps: 30",
        "note: training_args per_device_train_batch_size=4 -> training.micro_batch_size: 4",
        "note: training_args eval_strategy=steps, eval_steps=10 -> training.eval_every: 10",
        "note: training_args report_to=[\"tensorboard\"] -> logging.tensorboard: true"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  auto m = read_metrics(d / "out" / "metrics.jsonl");
  std::vector<int64_t> logged, evaluated;
  for (const auto& j : m) {
    if (j.contains("loss")) logged.push_back(j["step"].get<int64_t>());
    if (j.contains("eval_loss") && j.contains("step"))
      evaluated.push_back(j["step"].get<int64_t>());
  }
  EXPECT_EQ(logged, (std::vector<int64_t>{5, 10, 15, 20, 25, 30}));  // logging_steps 5
  EXPECT_EQ(evaluated, (std::vector<int64_t>{10, 20, 30}));          // eval_steps 10
  // save_steps 10 with save_total_limit 2: the newest two remain.
  EXPECT_FALSE(fs::exists(d / "out" / "checkpoints" / "step_10"));
  EXPECT_TRUE(fs::exists(d / "out" / "checkpoints" / "step_20"));
  EXPECT_TRUE(fs::exists(d / "out" / "checkpoints" / "step_30"));
  // A YAML key disagreeing with the dump is an error naming both, before anything runs.
  fs::path clash = d / "clash.yaml";
  std::ofstream(clash) << "optimizer: {lr: 0.01}\n";
  Result c = run_accel_train("--config " + clash.string() + " --training-args " + args);
  EXPECT_EQ(c.code, 2) << c.output;
  EXPECT_NE(c.output.find("training_args learning_rate=0.001"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("optimizer.lr = 0.01"), std::string::npos) << c.output;
}

// The configs Accelerate's and Transformers' docs print (tests/data/config/docs_*) train on the
// CPU as they are: a run file extends each and adds only a tiny model and synthetic data; the
// command line overrides num_processes and use_cpu.
TEST(AccelTrain, TheDocsConfigsRunOnTheCpu) {
  fs::path d = temp_dir("docs_configs");
  for (const auto& [name, procs] :
       std::vector<std::pair<std::string, int>>{{"docs_transformers_fsdp2", 2},
                                                {"docs_fp8_te", 1},
                                                {"docs_fp8_ao_fsdp2", 2},
                                                {"docs_deepspeed_zero3", 2},
                                                {"docs_multi_gpu", 2}}) {
    fs::path run = d / (name + ".yaml");
    std::ofstream(run)
        << "extends: " << ACCEL_TEST_DATA_DIR << "/config/" << name << ".yaml\n"
        << "model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,\n"
           "        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}\n"
           "training: {max_steps: 3, micro_batch_size: 2, seq_len: 16, progress: plain}\n"
           "data: {source: synthetic}\n";
    Result r = run_accel_train(
        "--config " + run.string() + " --set num_processes=" + std::to_string(procs) +
        " --set use_cpu=true --output-dir " + (d / ("out_" + name)).string());
    EXPECT_EQ(r.code, 0) << name << "\n" << r.output;
    EXPECT_NE(r.output.find("done: 3 steps"), std::string::npos) << name << "\n" << r.output;
  }
}

}  // namespace
