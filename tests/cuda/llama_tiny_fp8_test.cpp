// The demo config trained on the GPU in bf16, fp8 TE and fp8 AO: after its 300 steps each fp8
// recipe's eval loss is within 3% of bf16's (issue 9's convergence check, at the config's seed;
// docs/fp8.md has the same over 21 seeds). About 10 s per run on an H200.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "runtime/config.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::read_metrics;
using accel::tool_test::run_accel_train;

TEST(Fp8Convergence, LlamaTinyFp8EndsWithin3PercentOfBf16) {
  ACCEL_SKIP_WITHOUT_CUDA();
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
  fs::path out = accel::tool_test::fresh_test_dir("llama_tiny_fp8");
  auto eval_loss = [&](const std::string& name, const std::string& precision) {
    auto r =
        run_accel_train("--config " + config + " " + precision + " --set data.text_files=" + files +
                        " --set training.device=cuda --set training.progress=plain" +
                        " --set training.sample_tokens=0 --set checkpoint.every_steps=0" +
                        " --set checkpoint.at_end=false -o " + (out / name).string());
    EXPECT_EQ(r.code, 0) << r.output;
    auto m = read_metrics(out / name / "metrics.jsonl");
    EXPECT_FALSE(m.empty());
    return m.empty() || !m.back().contains("final_eval_loss")
               ? NAN
               : m.back()["final_eval_loss"].get<double>();
  };
  const double bf16 = eval_loss("bf16", "--set mixed_precision=bf16");
  const double te = eval_loss("te", "--set mixed_precision=fp8 --set fp8_config.backend=TE");
  const double ao = eval_loss("ao", "--set mixed_precision=fp8 --set fp8_config.backend=AO");
  EXPECT_GT(bf16, 1.5);  // it learned (5.5 at the start) but not implausibly much
  EXPECT_LT(bf16, 2.5);
  EXPECT_LE(std::abs(te / bf16 - 1), 0.03) << "TE " << te << " vs bf16 " << bf16;
  EXPECT_LE(std::abs(ao / bf16 - 1), 0.03) << "AO " << ao << " vs bf16 " << bf16;
  std::printf(
      "llama-tiny eval loss after 300 steps: bf16 %.4f, fp8 TE %.4f (%+.2f%%), fp8 AO %.4f "
      "(%+.2f%%)\n",
      bf16, te, 100 * (te / bf16 - 1), ao, 100 * (ao / bf16 - 1));
}

}  // namespace
