// accel-plot: the loss curves of accel-train runs, overlaid in one SVG chart.
//
//   accel-plot RUN[=LABEL]... -o chart.svg [--title T] [--from-step N]
//
// RUN is a run's output folder (its metrics.jsonl is read) or a metrics file.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "tools/cli.h"
#include "tools/trainer/loss_chart.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"accel-plot: overlay the loss curves of accel-train runs in one SVG chart"};
  std::vector<std::string> runs;
  std::string out, title = "loss";
  int64_t from_step = 0;
  app.add_option("RUNS", runs,
                 "run output folders (or metrics.jsonl files), each optionally =LABEL "
                 "(default label: the folder's name)")
      ->required();
  app.add_option("--out,-o", out, "the SVG file to write")->required();
  app.add_option("--title", title, "chart title")->capture_default_str();
  app.add_option("--from-step", from_step,
                 "leave out the steps before this one (the first steps' loss squeezes the rest)")
      ->check(CLI::NonNegativeNumber);
  if (auto code = accel::parse_command_line(app, argc, argv)) return *code;

  try {
    std::vector<accel::LossCurve> curves;
    for (const std::string& arg : runs) {
      std::string path = arg, label;
      size_t eq = arg.rfind('=');
      if (eq != std::string::npos && !fs::exists(arg)) {
        path = arg.substr(0, eq);
        label = arg.substr(eq + 1);
      }
      fs::path p(path);
      if (label.empty())
        label = accel::run_name(fs::is_directory(p) ? path : p.parent_path().string());
      if (label.empty()) label = path;
      if (fs::is_directory(p)) p /= "metrics.jsonl";
      curves.push_back(accel::read_loss_curve(p.string(), label));
    }
    accel::write_loss_chart(out, curves, title, from_step);
    for (const auto& c : curves) {
      if (!c.eval.empty())
        printf("%-24s %zu logged steps, last eval loss %.4f (step %lld)\n", c.label.c_str(),
               c.train.size(), c.eval.back().second, static_cast<long long>(c.eval.back().first));
      else
        printf("%-24s %zu logged steps, last loss %.4f (step %lld)\n", c.label.c_str(),
               c.train.size(), c.train.back().second, static_cast<long long>(c.train.back().first));
    }
    printf("wrote %s\n", out.c_str());
  } catch (const std::exception& e) {
    fprintf(stderr, "accel-plot: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
