// The demo config trained on the GPU in bf16 with bf16 master weights (optimizer.master_weights
// bf16: stochastic rounding, no fp32 copy) against fp32 masters, each alone and with bf16 moments
// too: after its 300 steps the eval loss is within 2% of the fp32-master run on average over
// three seeds. Why 2%: stochastic rounding is unbiased, so what it adds is noise (up to one bf16
// ulp, 2^-8 relative, per weight and step); a single seed's end point moves with rounding where a
// loss spike hits (docs/fp8.md), the mean over seeds much less; fp8 is held to 3% the same way
// (llama_tiny_fp8_test.cpp), and bf16 masters lose less precision than fp8 compute.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "runtime/config.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::read_metrics;

TEST(MasterBf16Convergence, LlamaTinyEndsWithin2PercentOfFp32Masters) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const std::string config = std::string(ACCEL_SOURCE_DIR) + "/configs/llama-tiny.yaml";
  std::string files;
  const char* dir = std::getenv("ACCEL_FORTUNES_DIR");
  for (const std::string& f : accel::load_config(config).data.text_files) {
    fs::path p = dir ? fs::path(dir) / fs::path(f).filename() : fs::path(f);
    if (!fs::exists(p))
      GTEST_SKIP() << p << " is missing: install fortunes (tools/setup.sh) or set "
                   << "ACCEL_FORTUNES_DIR to a folder with the config's text files";
    files += (files.empty() ? "" : ",") + p.string();
  }
  const fs::path out = accel::tool_test::fresh_test_dir("llama_tiny_master_bf16");
  const std::vector<std::string> seeds = {"1234", "1", "2"};
  const std::vector<std::pair<std::string, std::string>> modes = {
      {"fp32", "--set optimizer.master_weights=fp32"},
      {"bf16", "--set optimizer.master_weights=bf16"},
      {"bf16-state", "--set optimizer.master_weights=bf16 --set optimizer.state_dtype=bf16"}};
  std::string script;
  for (const auto& seed : seeds)
    for (const auto& [name, flags] : modes)
      script += std::string(ACCEL_BIN_DIR) + "/accel-train --config " + config +
                " --set mixed_precision=bf16 " + flags + " --set training.seed=" + seed +
                " --set data.text_files=" + files +
                " --set training.device=cuda --set training.progress=plain" +
                " --set training.sample_tokens=0 --set checkpoint.every_steps=0" +
                " --set checkpoint.at_end=false -o " + (out / (name + "-" + seed)).string() +
                " > " + (out / (name + "-" + seed + ".log")).string() + " 2>&1 & ";
  accel::tool_test::run_command(script + "wait");
  auto eval_loss = [&](const std::string& run) -> double {
    auto m = read_metrics(out / run / "metrics.jsonl");
    if (m.empty() || !m.back().contains("final_eval_loss")) {
      ADD_FAILURE() << run << " did not finish: " << (out / (run + ".log")).string();
      return NAN;
    }
    return m.back()["final_eval_loss"].get<double>();
  };
  double mean_diff[2] = {0, 0};
  for (const auto& seed : seeds) {
    const double fp32 = eval_loss("fp32-" + seed);
    EXPECT_GT(fp32, 1.5) << "seed " << seed;
    EXPECT_LT(fp32, 2.5) << "seed " << seed;
    std::printf("seed %s: fp32 masters %.4f", seed.c_str(), fp32);
    for (int i = 0; i < 2; ++i) {
      const double got = eval_loss(modes[i + 1].first + "-" + seed);
      mean_diff[i] += (got / fp32 - 1) / static_cast<double>(seeds.size());
      std::printf(" | %s %.4f (%+.2f%%)", modes[i + 1].first.c_str(), got, 100 * (got / fp32 - 1));
    }
    std::printf("\n");
  }
  EXPECT_LE(std::abs(mean_diff[0]), 0.02) << "bf16 masters: mean " << 100 * mean_diff[0] << "%";
  EXPECT_LE(std::abs(mean_diff[1]), 0.02)
      << "bf16 masters and moments: mean " << 100 * mean_diff[1] << "%";
  if (!HasFailure()) fs::remove_all(out);
}

}  // namespace
