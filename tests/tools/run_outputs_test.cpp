// What a run writes besides checkpoints, when things go wrong: a metrics file or config.yaml
// that cannot be written fails the run naming the file; SIGINT/SIGTERM end it with one line and
// 128 + the signal.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;
using accel::tool_test::run_accel_train;
using accel::tool_test::run_command;
using accel::tool_test::write_config;

const char* kTinyConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 7, max_steps: 4, micro_batch_size: 2, seq_len: 16, log_every: 1, progress: plain,
           device: cpu}
data: {source: synthetic}
checkpoint: {at_end: false}
)";

std::string train_args(const fs::path& d) {
  return "--config " + (d / "config.yaml").string() + " --output-dir " + (d / "out").string();
}

TEST(RunOutputs, MetricsFileOnAFullDiskFailsTheRunNamingTheFile) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_run_outputs");
  write_config(d, kTinyConfig);
  // /dev/full accepts the open and fails every write with ENOSPC.
  Result r = run_accel_train(train_args(d) + " --set logging.metrics_file=/dev/full");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("/dev/full: writing the metrics file failed"), std::string::npos)
      << r.output;
}

TEST(RunOutputs, UnwritableMetricsFileFailsTheRunNamingTheFile) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_run_outputs");
  write_config(d, kTinyConfig);
  // A path below a regular file cannot be created (also as root).
  Result r = run_accel_train(train_args(d) + " --set logging.metrics_file=config.yaml/m.jsonl");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("config.yaml/m.jsonl: opening the metrics file failed"),
            std::string::npos)
      << r.output;
}

TEST(RunOutputs, UnwritableConfigYamlFailsTheRunNamingTheFile) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_run_outputs");
  write_config(d, kTinyConfig);
  fs::create_directories(d / "out" / "config.yaml");  // a folder where the file goes
  Result r = run_accel_train(train_args(d) + " --resume auto");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("config.yaml: cannot write the effective configuration"),
            std::string::npos)
      << r.output;
}

// SIGINT stops at once (SIGTERM saves first: ReshardResume.SigtermWritesACheckpoint...).
TEST(RunOutputs, SigintPrintsTheStepAndExitsWith130) {
  const fs::path d = accel::tool_test::fresh_test_dir("accel_run_outputs");
  write_config(d, kTinyConfig);
  const fs::path metrics = d / "out" / "metrics.jsonl";
  // Start a long run, wait for its first metrics line, then SIGINT it.
  const std::string cmd = "sh -c '" + std::string(ACCEL_BIN_DIR) + "/accel-train " + train_args(d) +
                          " --set training.max_steps=100000 & pid=$!; "
                          "for i in $(seq 600); do [ -s " +
                          metrics.string() +
                          " ] && break; sleep 0.1; done; kill -INT $pid; wait $pid; "
                          "echo exit=$?'";
  Result r = run_command(cmd);
  EXPECT_NE(r.output.find("exit=130"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("accel-train: stopped by SIGINT after step "), std::string::npos)
      << r.output;
}

}  // namespace
