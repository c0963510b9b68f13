// Loss charts: reading metrics.jsonl (resumed runs, torn last lines, bad files), the SVG's
// geometry, and accel-plot and accel-train writing them.
#include "tools/trainer/loss_chart.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/data/test_util.h"
#include "tests/tools/run_tool.h"

namespace fs = std::filesystem;

namespace {

using accel::LossCurve;
using accel::testing::error_of;

fs::path write_file(const fs::path& p, const std::string& text) {
  accel::testing::write_bytes(p.string(), text);
  return p;
}

struct Point {
  double x, y;
};

// The points of each <polyline class="cls">, in document order.
std::vector<std::vector<Point>> polylines(const std::string& svg, const std::string& cls) {
  std::vector<std::vector<Point>> out;
  std::regex re("<polyline class=\"" + cls + "\" points=\"([^\"]*)\"");
  for (std::sregex_iterator it(svg.begin(), svg.end(), re), end; it != end; ++it) {
    std::vector<Point> pts;
    std::istringstream s((*it)[1].str());
    std::string xy;
    while (s >> xy) {
      size_t c = xy.find(',');
      pts.push_back({std::stod(xy.substr(0, c)), std::stod(xy.substr(c + 1))});
    }
    out.push_back(pts);
  }
  return out;
}

TEST(LossChart, ReadsStepLinesLaterLinesWinTornLastLineSkipped) {
  fs::path d = accel::tool_test::fresh_test_dir("loss_chart");
  // Steps 1-3, a resume from step 2 that logs step 3 again, an evaluation on its own line, the
  // summary, a torn last line.
  fs::path f = write_file(d / "metrics.jsonl",
                          "{\"step\":1,\"loss\":5.0}\n"
                          "{\"step\":2,\"loss\":4.0,\"eval_loss\":4.5}\n"
                          "{\"step\":3,\"loss\":3.9}\n"
                          "\n"
                          "{\"step\":3,\"loss\":3.5}\n"
                          "{\"step\":4,\"loss\":3.0,\"eval_loss\":3.2}\n"
                          "{\"step\":5,\"eval_loss\":2.9}\n"
                          "{\"step\":6,\"loss\":2.8}\n"
                          "{\"summary\":true,\"final_loss\":3.0}\n"
                          "{\"step\":5,\"lo");
  LossCurve c = accel::read_loss_curve(f.string(), "run");
  EXPECT_EQ(c.label, "run");
  ASSERT_EQ(c.train.size(), 5u);
  EXPECT_EQ(c.train[2], (std::pair<int64_t, double>{3, 3.5}));
  EXPECT_EQ(c.train[3], (std::pair<int64_t, double>{4, 3.0}));
  ASSERT_EQ(c.eval.size(), 3u);
  EXPECT_EQ(c.eval[0], (std::pair<int64_t, double>{2, 4.5}));
  EXPECT_EQ(c.eval[1], (std::pair<int64_t, double>{4, 3.2}));
  EXPECT_EQ(c.eval[2], (std::pair<int64_t, double>{5, 2.9}));  // an evaluation's own line
}

TEST(LossChart, BadFilesNameTheFileAndLine) {
  fs::path d = accel::tool_test::fresh_test_dir("loss_chart");
  std::string e = error_of([&] { accel::read_loss_curve((d / "nope.jsonl").string(), "x"); });
  EXPECT_NE(e.find("nope.jsonl: cannot open"), std::string::npos) << e;
  fs::path garbled = write_file(d / "garbled.jsonl",
                                "{\"step\":1,\"loss\":5.0}\nnot json\n{\"step\":2,\"loss\":4}\n");
  e = error_of([&] { accel::read_loss_curve(garbled.string(), "x"); });
  EXPECT_NE(e.find("garbled.jsonl line 2 is not JSON"), std::string::npos) << e;
  fs::path other = write_file(d / "other.jsonl", "{\"a\":1}\n{\"step\":1}\n");
  e = error_of([&] { accel::read_loss_curve(other.string(), "x"); });
  EXPECT_NE(e.find("other.jsonl has no step lines with a training loss"), std::string::npos) << e;
}

TEST(LossChart, CurvesAreDrawnInsideThePlotHighLossAtTheTop) {
  LossCurve a{"bf16 <ref>", {{0, 4.0}, {10, 3.0}, {20, 2.0}}, {{10, 3.2}, {20, 2.2}}};
  LossCurve b{"fp8", {{0, 4.2}, {10, 2.5}, {20, 2.1}}, {}};
  std::string svg = accel::loss_chart_svg({a, b}, "t & t");
  auto train = polylines(svg, "train");
  auto eval = polylines(svg, "eval");
  ASSERT_EQ(train.size(), 2u);
  ASSERT_EQ(eval.size(), 1u);  // b has no evaluation
  ASSERT_EQ(train[0].size(), 3u);
  // Steps run left to right; lower loss lies lower in the picture (larger y).
  EXPECT_LT(train[0][0].x, train[0][1].x);
  EXPECT_LT(train[0][0].y, train[0][1].y);
  EXPECT_LT(train[0][1].y, train[0][2].y);
  // The highest loss (4.2) is nearest the top, the lowest (2.0) nearest the bottom; x of the
  // same step agrees across curves.
  EXPECT_LT(train[1][0].y, train[0][0].y);
  EXPECT_GT(train[0][2].y, train[1][2].y);
  EXPECT_DOUBLE_EQ(train[0][2].x, train[1][2].x);
  for (const auto& line : train)
    for (const Point& p : line) {
      EXPECT_GE(p.x, 60);
      EXPECT_LE(p.x, 580);
      EXPECT_GE(p.y, 40);
      EXPECT_LE(p.y, 390);
    }
  EXPECT_NE(svg.find("bf16 &lt;ref&gt;"), std::string::npos);  // labels and title escaped
  EXPECT_NE(svg.find("t &amp; t"), std::string::npos);
  EXPECT_NE(svg.find("eval 2.2000 at step 20"), std::string::npos);
  EXPECT_NE(svg.find("loss 2.1000 at step 20"), std::string::npos);
  // from_step leaves out the first points; beyond every point is an error.
  auto late = polylines(accel::loss_chart_svg({a, b}, "t", 10), "train");
  ASSERT_EQ(late.size(), 2u);
  EXPECT_EQ(late[0].size(), 2u);
  std::string e = error_of([&] { accel::loss_chart_svg({a, b}, "t", 21); });
  EXPECT_NE(e.find("no logged step at or after step 21"), std::string::npos) << e;
}

TEST(LossChart, LongRunsAreThinnedOutKeepingSpikes) {
  LossCurve c{"long", {}, {}};
  for (int64_t s = 1; s <= 100000; ++s) c.train.push_back({s, s == 77777 ? 9.0 : 3.0 - 1e-5 * s});
  auto line = polylines(accel::loss_chart_svg({c}, "t"), "train");
  ASSERT_EQ(line.size(), 1u);
  EXPECT_LE(line[0].size(), 2000u);
  EXPECT_GE(line[0].size(), 1000u);
  double top = 1e9, right = 0;
  for (const Point& p : line[0]) {
    top = std::min(top, p.y);
    right = std::max(right, p.x);
  }
  EXPECT_LT(top, 60);       // the spike (the highest loss) reaches the top of the plot
  EXPECT_GT(right, 579.0);  // and the last step is still drawn
}

TEST(AccelPlot, OverlaysRunsAndSaysWhatIsWrong) {
  using accel::tool_test::run_command;
  fs::path d = accel::tool_test::fresh_test_dir("accel_plot");
  fs::create_directories(d / "run_a");
  write_file(d / "run_a" / "metrics.jsonl",
             "{\"step\":1,\"loss\":5.0}\n{\"step\":2,\"loss\":4.0,\"eval_loss\":4.4}\n");
  fs::path b = write_file(d / "b.jsonl", "{\"step\":1,\"loss\":5.1}\n{\"step\":2,\"loss\":3.9}\n");
  const std::string plot = std::string(ACCEL_BIN_DIR) + "/accel-plot ";
  // A folder given with a trailing "/" is still named after itself.
  auto r = run_command(plot + (d / "run_a").string() + "/ " + b.string() + "=fp8 -o " +
                       (d / "c.svg").string() + " --title cmp");
  ASSERT_EQ(r.code, 0) << r.output;
  std::string svg = accel::testing::read_bytes((d / "c.svg").string());
  EXPECT_EQ(polylines(svg, "train").size(), 2u);
  EXPECT_NE(svg.find(">run_a<"), std::string::npos);
  EXPECT_NE(svg.find(">fp8<"), std::string::npos);
  EXPECT_NE(r.output.find("2 logged steps, last eval loss 4.4000 (step 2)"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(d / "c.svg.tmp"));
  r = run_command(plot + (d / "missing").string() + " -o " + (d / "x.svg").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("accel-plot: error: " + (d / "missing").string()), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(d / "x.svg"));
  r = run_command(plot + (d / "run_a").string() + " -o " + (d / "no" / "such" / "x.svg").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("cannot write"), std::string::npos) << r.output;
  std::string nine;
  for (int i = 0; i < 9; ++i) nine += b.string() + "=run" + std::to_string(i) + " ";
  r = run_command(plot + nine + "-o " + (d / "y.svg").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("9 curves, at most 8 fit in one chart"), std::string::npos) << r.output;
  r = run_command(plot + (d / "run_a").string());  // no -o
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--out"), std::string::npos) << r.output;
}

TEST(AccelTrain, WritesALossChartOfTheRun) {
  fs::path d = accel::tool_test::fresh_test_dir("loss_chart_train");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox " + std::to_string(i) + " jumps\n";
  write_file(d / "text.txt", text);
  // Evaluations at steps 3 and 6, neither of them a logged step (4 and 8).
  fs::path cfg = accel::tool_test::write_config(d, R"(
model: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 256, max_position_embeddings: 64}
training: {seed: 7, max_steps: 8, micro_batch_size: 2, seq_len: 16, log_every: 4, eval_every: 3,
           eval_batches: 2, sample_tokens: 0, progress: plain, device: cpu}
data: {source: text, tokenizer: byte, eval_fraction: 0.2, text_files: [)" +
                                                       (d / "text.txt").string() + R"(]}
checkpoint: {every_steps: 0, at_end: false}
)");
  auto r = accel::tool_test::run_accel_train("--config " + cfg.string() + " --output-dir " +
                                             (d / "out").string());
  ASSERT_EQ(r.code, 0) << r.output;
  // Each evaluation has its own line where its step is not logged.
  auto m = accel::tool_test::read_metrics(d / "out" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0]["step"], 3);
  EXPECT_TRUE(m[0].contains("eval_loss"));
  EXPECT_FALSE(m[0].contains("loss"));
  EXPECT_EQ(m[1]["step"], 4);
  EXPECT_FALSE(m[1].contains("eval_loss"));
  EXPECT_EQ(m[2]["step"], 6);
  EXPECT_TRUE(m[2].contains("eval_loss"));
  std::string svg = accel::testing::read_bytes((d / "out" / "loss.svg").string());
  auto train = polylines(svg, "train");
  ASSERT_EQ(train.size(), 1u) << svg;
  EXPECT_EQ(train[0].size(), 2u);  // steps 4 and 8
  auto eval = polylines(svg, "eval");
  ASSERT_EQ(eval.size(), 1u);
  ASSERT_EQ(eval[0].size(), 3u);  // steps 3, 6 and the final evaluation at 8
  EXPECT_LT(eval[0][0].x, train[0][0].x);
  EXPECT_DOUBLE_EQ(eval[0][2].x, train[0][1].x);
  EXPECT_NE(svg.find(">out: fp32, single x 1<"), std::string::npos);
  EXPECT_FALSE(fs::exists(d / "out" / "loss.svg.tmp"));
}

}  // namespace
