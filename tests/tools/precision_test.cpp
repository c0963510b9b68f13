// The run's precision part on its own: compute dtype by mixed_precision, fp16 dynamic loss
// scaling, the non-finite policy; and the metrics rewrite a resume does.
#include "tools/trainer/precision.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "parallel/strategy.h"
#include "tests/tools/run_tool.h"
#include "tools/trainer/run_log.h"

namespace {

using accel::Config;
using accel::MixedPrecision;
using accel::NanPolicy;
using accel::Precision;
using accel::StepResult;

Config with(MixedPrecision m, NanPolicy p = NanPolicy::Stop) {
  Config c;
  c.mixed_precision = m;
  c.training.nan_policy = p;
  c.training.loss_scale_init = 1024;
  c.training.loss_scale_window = 2;
  return c;
}

TEST(Precision, ComputeDtypeAndNameFollowMixedPrecision) {
  EXPECT_EQ(Precision(with(MixedPrecision::No)).compute_dtype(), accel::DType::F32);
  EXPECT_EQ(Precision(with(MixedPrecision::Fp16)).compute_dtype(), accel::DType::F16);
  EXPECT_EQ(Precision(with(MixedPrecision::Bf16)).compute_dtype(), accel::DType::BF16);
  EXPECT_EQ(Precision(with(MixedPrecision::Fp8)).compute_dtype(), accel::DType::BF16);
  EXPECT_EQ(Precision(with(MixedPrecision::No)).name(), "fp32");
  EXPECT_STREQ(Precision(with(MixedPrecision::No)).mixed_precision(), "no");
  EXPECT_EQ(Precision(with(MixedPrecision::Bf16)).loss_scale(), 1.0);
}

TEST(Precision, Fp16BacksOffOnOverflowAndGrowsAfterTheWindow) {
  Precision p(with(MixedPrecision::Fp16));
  EXPECT_EQ(p.loss_scale(), 1024);
  StepResult overflow;
  overflow.skipped = true;
  EXPECT_EQ(p.after_step(overflow, 1.0, 1), "");  // expected under fp16: no warning, no stop
  EXPECT_EQ(p.loss_scale(), 512);
  EXPECT_EQ(p.skipped_steps(), 1);
  p.after_step(StepResult{}, 1.0, 2);
  EXPECT_EQ(p.loss_scale(), 512);
  p.after_step(StepResult{}, 1.0, 3);  // two clean steps: the window
  EXPECT_EQ(p.loss_scale(), 1024);
  EXPECT_EQ(p.metrics().at("loss_scale"), 1024);
  EXPECT_TRUE(Precision(with(MixedPrecision::Bf16)).metrics().is_null());
}

TEST(Precision, NonFiniteStepStopsOrWarnsByPolicy) {
  StepResult bad;
  bad.skipped = true;
  bad.first_non_finite = "model.norm.weight";
  Precision stop(with(MixedPrecision::Bf16, NanPolicy::Stop));
  try {
    stop.after_step(bad, 2.0, 7);
    FAIL() << "nan_policy stop did not stop";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("non-finite gradients at step 7"), std::string::npos) << m;
    EXPECT_NE(m.find("model.norm.weight"), std::string::npos) << m;
  }
  Precision skip(with(MixedPrecision::Bf16, NanPolicy::Skip));
  const std::string w = skip.after_step(StepResult{}, NAN, 3);
  EXPECT_NE(w.find("warning: non-finite loss at step 3"), std::string::npos) << w;
  EXPECT_EQ(skip.skipped_steps(), 1);
  EXPECT_EQ(skip.after_step(StepResult{}, 1.0, 4), "");
}

TEST(RunLogResume, MetricsLinesAfterTheCheckpointAndTornOrSummaryLinesAreDropped) {
  const auto d = accel::tool_test::fresh_test_dir("accel_precision_test");
  const std::string path = (d / "metrics.jsonl").string();
  std::ofstream(path) << "{\"step\":1,\"loss\":3}\n{\"step\":2,\"eval_loss\":2.5}\n"
                         "{\"step\":2,\"loss\":2}\n{\"step\":3,\"loss\":1}\n"
                         "{\"summary\":true,\"steps\":3}\n{\"step\":4,\"lo";
  accel::truncate_metrics_after(path, 2);
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  EXPECT_EQ(s.str(),
            "{\"step\":1,\"loss\":3}\n{\"step\":2,\"eval_loss\":2.5}\n{\"step\":2,\"loss\":2}\n");
  accel::truncate_metrics_after((d / "none.jsonl").string(), 2);  // no file: nothing to do
  EXPECT_FALSE(std::filesystem::exists(d / "none.jsonl"));
}

}  // namespace
