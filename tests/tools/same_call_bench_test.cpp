// tools/reference/same_call_bench.sh and same_call_table.py on the CPU: two real accel-bench rounds
// of a tiny model around a stand-in for torch_reference.py (one variant answers, one fails, one is
// not asked for), and the table row made of them: each round, their mean, the peak, and the ratios
// of the means to PyTorch's numbers of the same folder.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/tools/run_tool.h"

namespace accel {
namespace {
using namespace tool_test;

std::string commas(double x) {  // as Python's f"{x:,.0f}"
  std::string digits = std::to_string(static_cast<long long>(x + 0.5)), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string fixed(double x, int places) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", places, x);
  return buf;
}

// tokens/s of one precision's single-process row of an accel-bench --json file.
double tokens_per_s(const fs::path& file, const std::string& precision, double* peak_gib) {
  std::ifstream in(file);
  for (const auto& row : nlohmann::json::parse(in))
    if (row["strategy"] == "single" && row["precision"] == precision && row["status"] == "ok") {
      *peak_gib = row["peak_bytes_max_rank"].get<double>() / (1024.0 * 1024.0 * 1024.0);
      return row["tokens_per_s"].get<double>();
    }
  ADD_FAILURE() << "no " << precision << " row in " << file;
  return 0;
}

TEST(SameCallBench, RunsBothSidesAndDividesTheMeansOfOneCall) {
  if (run_command("python3 -c 'import json'").code != 0) GTEST_SKIP() << "no python3";
  const fs::path dir = fresh_test_dir("same_call_bench");
  fs::create_directories(dir / "configs");
  std::ofstream(dir / "configs" / "tiny.yaml") << R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 3, micro_batch_size: 2, seq_len: 16, device: cpu}
data: {source: synthetic}
)";
  // The stand-in: eager answers 1,000 tok/s at 2.5 GiB, compile fails after printing a line that
  // is not JSON.
  std::ofstream(dir / "fake_torch.py") << R"(import json, sys
size, variant, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if variant != "bf16":
    print("compiling...")
    sys.exit(1)
print(json.dumps({"size": size, "variant": variant, "tokens_per_s": 1000.0, "peak_mem_gib": 2.5}))
)";
  const fs::path out = dir / "out";
  const Result r = run_command("cd " + std::string(ACCEL_SOURCE_DIR) +
                               " && ACCEL_BIN=" + std::string(ACCEL_BIN_DIR) +
                               " CONFIG_DIR=" + (dir / "configs").string() +
                               " TORCH_REFERENCE=" + (dir / "fake_torch.py").string() +
                               " TORCH_VARIANTS='bf16 bf16-compile'" +
                               " tools/reference/same_call_bench.sh " + out.string() + " tiny");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("accel-bench tiny round 2 exit 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("torch_reference tiny bf16-compile exit 1"), std::string::npos)
      << r.output;

  // The expected row, from the rounds' own JSON files.
  double peak1 = 0, peak2 = 0, fp8_peak1 = 0, fp8_peak2 = 0;
  const double a1 = tokens_per_s(out / "accel_tiny_r1.json", "bf16", &peak1);
  const double a2 = tokens_per_s(out / "accel_tiny_r2.json", "bf16", &peak2);
  const double f1 = tokens_per_s(out / "accel_tiny_r1.json", "fp8", &fp8_peak1);
  const double f2 = tokens_per_s(out / "accel_tiny_r2.json", "fp8", &fp8_peak2);
  const double mean = (a1 + a2) / 2, fp8_mean = (f1 + f2) / 2;
  const std::string row = "| tiny | " + commas(a1) + " / " + commas(a2) + "; " + commas(mean) +
                          ", " + fixed(std::max(peak1, peak2), 1) + " GiB | " + commas(f1) + " / " +
                          commas(f2) + "; " + commas(fp8_mean) + ", " +
                          fixed(std::max(fp8_peak1, fp8_peak2), 1) +
                          " GiB | bf16 1,000, 2.5 GiB | bf16-compile: did not finish | not run | " +
                          fixed(mean / 1000, 2) + "x | - | - |";
  EXPECT_NE(r.output.find(row), std::string::npos) << "expected " << row << "\n" << r.output;
  std::ifstream table(out / "table.md");
  std::string first;
  std::getline(table, first);
  EXPECT_EQ(first.rfind("| size |", 0), 0u) << first;

  // A folder without accel-bench results is an error that says so.
  fs::create_directories(dir / "empty");
  const Result e = run_command("python3 " + std::string(ACCEL_SOURCE_DIR) +
                               "/tools/reference/same_call_table.py " + (dir / "empty").string());
  EXPECT_NE(e.code, 0);
  EXPECT_NE(e.output.find("no accel_SIZE_rK.json files"), std::string::npos) << e.output;
}

}  // namespace
}  // namespace accel
