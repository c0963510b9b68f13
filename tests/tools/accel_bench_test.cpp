// accel-bench on the CPU: combinations run in their own processes, skipped and failed ones are
// reported while the others still run, and the JSON, markdown and SVG outputs are written.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tools/trainer/bench_report.h"

namespace fs = std::filesystem;

namespace {

TEST(AccelBench, RunsSkipsAndReportsFailuresWithoutStopping) {
  fs::path d = fs::temp_directory_path() / ("accel_bench_test_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  std::ofstream(d / "tiny.yaml") << R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 3, micro_batch_size: 2, seq_len: 16, device: cpu}
data: {source: synthetic}
)";
  std::string cmd =
      std::string(ACCEL_BIN_DIR) + "/accel-bench --config " + (d / "tiny.yaml").string() +
      " --strategies single,ddp,fsdp-fp8 --precisions no,bogus --steps 3 --warmup 1" +
      " --num-processes 2 --device cpu --set training.activation_checkpointing=selective" +
      " --work-dir " + (d / "work").string() + " --json " + (d / "r.json").string() + " --chart " +
      (d / "r.svg").string() + " --markdown " + (d / "r.md").string() + " > " +
      (d / "out.txt").string() + " 2>&1";
  int status = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 1);  // the bogus precision fails
  std::ifstream in(d / "r.json");
  nlohmann::json rows = nlohmann::json::parse(in);
  ASSERT_EQ(rows.size(), 6u);
  int ok = 0, skipped = 0, failed = 0;
  for (const auto& r : rows) {
    std::string s = r["status"];
    if (s == "ok") {
      ++ok;
      EXPECT_EQ(r["precision"], "no");
      EXPECT_GT(r["tokens_per_s"].get<double>(), 0);
      EXPECT_GT(r["peak_bytes_max_rank"].get<int64_t>(), 0);
      EXPECT_GT(r["final_loss"].get<double>(), 0);
      // --set reaches the runs, whose summaries report the mode and the activations' peak.
      EXPECT_EQ(r["activation_checkpointing"], "selective");
      EXPECT_GT(r["peak_activation_bytes_rank0"].get<int64_t>(), 0);
      if (r["strategy"] == "ddp") {
        EXPECT_EQ(r["world_size"], 2);
        EXPECT_GT(r["comm_wire_bytes_per_step"]["all_reduce"].get<int64_t>(), 0);
        ASSERT_EQ(r["peak_bytes_by_category_per_rank"].size(), 2u);
        EXPECT_GT(r["peak_bytes_by_category_per_rank"][1]["params"].get<int64_t>(), 0);
      }
    } else if (s == "skipped") {
      ++skipped;
      EXPECT_EQ(r["strategy"], "fsdp-fp8");
      EXPECT_NE(r["reason"].get<std::string>().find("needs precision fp8"), std::string::npos);
    } else {
      ++failed;
      EXPECT_EQ(r["precision"], "bogus");
      EXPECT_NE(r["reason"].get<std::string>().find("mixed_precision"), std::string::npos)
          << r["reason"];
    }
  }
  EXPECT_EQ(ok, 2);
  EXPECT_EQ(skipped, 2);
  EXPECT_EQ(failed, 2);
  std::ifstream svg(d / "r.svg");
  std::string first;
  std::getline(svg, first);
  EXPECT_EQ(first.rfind("<svg", 0), 0u);
  std::ifstream md(d / "r.md");
  std::getline(md, first);
  EXPECT_EQ(first.rfind("| strategy |", 0), 0u) << first;
}

// A usage error exits 2 with CLI11's message, as every other tool does (CLI11's own code is 106).
TEST(AccelBench, AnUnknownOptionIsAUsageError) {
  const std::string out =
      (fs::temp_directory_path() / ("accel_bench_usage_" + std::to_string(getpid()))).string();
  const std::string cmd = std::string(ACCEL_BIN_DIR) +
                          "/accel-bench --config x.yaml --no-such-option > " + out + " 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("--no-such-option"), std::string::npos) << text.str();
  fs::remove(out);
}

TEST(BenchReport, ModelStateFormulasMatchTheZeroPaper) {
  const int64_t P = 1000000;
  EXPECT_EQ(accel::expected_model_state_bytes("ddp", "bf16", P, 4), 16 * P);
  EXPECT_EQ(accel::expected_model_state_bytes("zero1", "bf16", P, 4), 4 * P + 12 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("zero2", "bf16", P, 4), 2 * P + 14 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("zero3", "bf16", P, 4), 16 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("fsdp", "bf16", P, 4), 16 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("ddp", "no", P, 4), 16 * P);
  // optimizer.state_dtype bf16: 2 bytes per moment element (fp32 master + m + v = 8P).
  EXPECT_EQ(accel::expected_model_state_bytes("single", "bf16", P, 1, 2), 12 * P);
  EXPECT_EQ(accel::expected_model_state_bytes("ddp", "no", P, 4, 2), 12 * P);
  EXPECT_EQ(accel::expected_model_state_bytes("zero1", "bf16", P, 4, 2), 4 * P + 8 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("zero2", "bf16", P, 4, 2), 2 * P + 10 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("zero3", "bf16", P, 4, 2), 12 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("fsdp", "bf16", P, 4, 2), 12 * P / 4);
  // optimizer.master_weights bf16: no fp32 master (the 16-bit weights are the masters), with fp32
  // moments (8P) and with bf16 ones (4P).
  EXPECT_EQ(accel::expected_model_state_bytes("single", "bf16", P, 1, 4, 0), 12 * P);
  EXPECT_EQ(accel::expected_model_state_bytes("ddp", "bf16", P, 4, 4, 0), 12 * P);
  EXPECT_EQ(accel::expected_model_state_bytes("zero1", "bf16", P, 4, 4, 0), 4 * P + 8 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("zero2", "bf16", P, 4, 4, 0), 2 * P + 10 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("fsdp", "fp8", P, 4, 4, 0), 12 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("single", "bf16", P, 1, 2, 0), 8 * P);
  EXPECT_EQ(accel::expected_model_state_bytes("zero1", "bf16", P, 4, 2, 0), 4 * P + 4 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("zero2", "bf16", P, 4, 2, 0), 2 * P + 6 * P / 4);
  EXPECT_EQ(accel::expected_model_state_bytes("zero3", "bf16", P, 4, 2, 0), 8 * P / 4);
}

// Expert parallelism's all-to-all gets a column of its own, only where a row has some.
TEST(BenchReport, AllToAllColumnOnlyWithExpertParallelTraffic) {
  accel::BenchRow dense;
  dense.strategy = "ddp";
  dense.precision = "no";
  dense.world_size = 2;
  dense.comm_bytes_per_step = {{"all_reduce", 1000}};
  accel::BenchRow failed = dense;
  failed.status = "failed";
  failed.reason = "boom";
  EXPECT_EQ(accel::bench_table({dense, failed}).find("all-to-all"), std::string::npos);
  accel::BenchRow ep = dense;
  ep.comm_bytes_per_step = {{"all_reduce", 1000}, {"all_to_all", 4096}};
  ep.all_to_all_bytes_per_step = 4096;
  const std::string table = accel::bench_table({dense, ep, failed});
  EXPECT_NE(table.find("all-to-all/step"), std::string::npos) << table;
  const std::string md = accel::bench_markdown({dense, ep, failed});
  // Every markdown line has as many cells as the header.
  std::istringstream lines(md);
  std::string line;
  size_t cells = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '|') continue;
    const size_t n = static_cast<size_t>(std::count(line.begin(), line.end(), '|'));
    if (!cells) cells = n;
    EXPECT_EQ(n, cells) << line;
  }
  EXPECT_EQ(accel::bench_json({ep})[0]["all_to_all_wire_bytes_per_step"].get<int64_t>(), 4096);
}

}  // namespace
