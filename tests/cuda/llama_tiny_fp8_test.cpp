// The demo config trained on the GPU in bf16, fp8 TE and fp8 AO: after its 300 steps each fp8
// recipe's eval loss is within 3% of bf16's, on average over three seeds (issue 9's convergence
// check; docs/fp8.md has each of 21 seeds). About 10 s on an H200. The same with the LM head tied
// to the embedding (TE then runs the tied head in fp8 too, AO keeps it in bf16).
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

// `extra`: more --set options for every run (the same for bf16 and both fp8 recipes).
void expect_fp8_within_3_percent(const std::string& label, const std::string& extra) {
  const std::string config = std::string(ACCEL_SOURCE_DIR) + "/configs/llama-tiny.yaml";
  // The fortunes texts where tools/setup.sh installs them, or in ACCEL_FORTUNES_DIR.
  std::string files;
  const char* dir = std::getenv("ACCEL_FORTUNES_DIR");
  for (const std::string& f : accel::load_config(config).data.text_files) {
    fs::path p = dir ? fs::path(dir) / fs::path(f).filename() : fs::path(f);
    if (!fs::exists(p))
      GTEST_SKIP() << p << " is missing: install fortunes (tools/setup.sh) or set "
                   << "ACCEL_FORTUNES_DIR to a folder with the config's text files";
    files += (files.empty() ? "" : ",") + p.string();
  }
  fs::path out = accel::tool_test::fresh_test_dir("llama_tiny_fp8_" + label);
  // Three seeds (the config's and two more), nine runs side by side on the GPU. A single run's
  // end point moves with rounding where a loss spike hits (docs/fp8.md); the mean does not.
  const std::vector<std::string> seeds = {"1234", "1", "2"};
  const std::vector<std::pair<std::string, std::string>> modes = {
      {"bf16", "--set mixed_precision=bf16"},
      {"te", "--set mixed_precision=fp8 --set fp8_config.backend=TE"},
      {"ao", "--set mixed_precision=fp8 --set fp8_config.backend=AO"}};
  std::string script;
  for (const auto& seed : seeds)
    for (const auto& [name, precision] : modes)
      script += std::string(ACCEL_BIN_DIR) + "/accel-train --config " + config + " " + precision +
                " " + extra + " --set training.seed=" + seed + " --set data.text_files=" + files +
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
    const double bf16 = eval_loss("bf16-" + seed);
    EXPECT_GT(bf16, 1.5) << "seed " << seed;  // it learned (5.5 at the start), not implausibly
    EXPECT_LT(bf16, 2.5) << "seed " << seed;
    std::printf("seed %s: bf16 %.4f", seed.c_str(), bf16);
    for (int i = 0; i < 2; ++i) {
      const double fp8 = eval_loss(modes[i + 1].first + "-" + seed);
      mean_diff[i] += (fp8 / bf16 - 1) / static_cast<double>(seeds.size());
      std::printf(" | %s %.4f (%+.2f%%)", modes[i + 1].first.c_str(), fp8, 100 * (fp8 / bf16 - 1));
    }
    std::printf("\n");
  }
  EXPECT_LE(std::abs(mean_diff[0]), 0.03) << "TE: mean " << 100 * mean_diff[0] << "%";
  EXPECT_LE(std::abs(mean_diff[1]), 0.03) << "AO: mean " << 100 * mean_diff[1] << "%";
  std::printf("%s: fp8 vs bf16 eval loss, mean of %zu seeds: TE %+.2f%%, AO %+.2f%%\n",
              label.c_str(), seeds.size(), 100 * mean_diff[0], 100 * mean_diff[1]);
}

TEST(Fp8Convergence, LlamaTinyFp8EndsWithin3PercentOfBf16) {
  ACCEL_SKIP_WITHOUT_CUDA();
  expect_fp8_within_3_percent("untied", "");
}

TEST(Fp8Convergence, LlamaTinyTiedFp8EndsWithin3PercentOfBf16) {
  ACCEL_SKIP_WITHOUT_CUDA();
  expect_fp8_within_3_percent("tied", "--set model.tie_word_embeddings=true");
}

}  // namespace
