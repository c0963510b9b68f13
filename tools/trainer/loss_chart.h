// Loss curves read from a run's metrics.jsonl and drawn as an SVG line chart: accel-train keeps
// <output_dir>/loss.svg up to date for its run, accel-plot overlays several runs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace accel {

struct LossCurve {
  std::string label;
  std::vector<std::pair<int64_t, double>> train;  // (step, loss), ascending steps
  std::vector<std::pair<int64_t, double>> eval;   // (step, eval_loss), ascending steps
};

// The loss curve of a run as it trains: a step logged again (a resumed run repeats the steps
// after its checkpoint) replaces the earlier value.
class LossHistory {
 public:
  // The step lines of a metrics.jsonl ({step, loss}, {step, eval_loss} or both), in order. A torn
  // last line (the file of a run still writing) is skipped; any other line that is not JSON, a
  // missing file or a file without a training loss throws std::runtime_error naming the file
  // (and the line).
  static LossHistory read(const std::string& metrics_path);

  void add_train(int64_t step, double loss) { train_[step] = loss; }
  void add_eval(int64_t step, double loss) { eval_[step] = loss; }
  LossCurve curve(const std::string& label) const;

 private:
  std::map<int64_t, double> train_, eval_;
};

// LossHistory::read(metrics_path).curve(label).
LossCurve read_loss_curve(const std::string& metrics_path, const std::string& label);

// One chart: x = optimizer step, y = loss; training loss as thin lines, evaluation loss as thick
// lines with dots, one colour per curve (at most 8 curves), a legend. A curve of more than 2,000
// points is drawn from the lowest and highest point of each of 1,000 runs of consecutive steps
// (spikes stay). Points before `from_step` are left out (the first steps' high loss squeezes the
// rest of the chart). Throws std::invalid_argument when no curve has a point at or after from_step.
std::string loss_chart_svg(const std::vector<LossCurve>& curves, const std::string& title,
                           int64_t from_step = 0);

// loss_chart_svg written to `path` through a temporary file and a rename, so that a reader never
// sees half a chart; throws std::runtime_error when it cannot be written.
void write_loss_chart(const std::string& path, const std::vector<LossCurve>& curves,
                      const std::string& title, int64_t from_step = 0);

// The name of a run from its output folder (or a file in it), trailing "/" or not.
std::string run_name(const std::string& path);

}  // namespace accel
