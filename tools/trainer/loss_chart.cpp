#include "tools/trainer/loss_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "runtime/json.h"

namespace accel {

LossCurve LossHistory::curve(const std::string& label) const {
  LossCurve c;
  c.label = label;
  c.train.assign(train_.begin(), train_.end());
  c.eval.assign(eval_.begin(), eval_.end());
  return c;
}

LossHistory LossHistory::read(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  if (!in)
    throw std::runtime_error(metrics_path +
                             ": cannot open it (give a run's output folder or its metrics file)");
  LossHistory h;
  std::string line, bad;
  int64_t line_no = 0, bad_line = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (bad_line)  // a line that did not parse was not the last one
      throw std::runtime_error(metrics_path + " line " + std::to_string(bad_line) +
                               " is not JSON: " + bad.substr(0, 80));
    nlohmann::json j;
    try {
      j = parse_json(line, metrics_path);
    } catch (const JsonError&) {
      bad_line = line_no;
      bad = line;
      continue;
    }
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    const int64_t step = j["step"].get<int64_t>();
    if (j.contains("loss") && j["loss"].is_number()) h.add_train(step, j["loss"].get<double>());
    if (j.contains("eval_loss") && j["eval_loss"].is_number())
      h.add_eval(step, j["eval_loss"].get<double>());
  }
  if (h.train_.empty())
    throw std::runtime_error(metrics_path + " has no step lines with a training loss (" +
                             std::to_string(line_no) + " lines): not an accel-train metrics file?");
  return h;
}

LossCurve read_loss_curve(const std::string& metrics_path, const std::string& label) {
  return LossHistory::read(metrics_path).curve(label);
}

namespace {

std::string escape_xml(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        if (static_cast<unsigned char>(ch) >= 0x20) o += ch;  // XML has no control characters
    }
  }
  return o;
}

// Tick spacing of 1, 2 or 5 times a power of ten giving about `target` ticks over `span`.
double tick_step(double span, int target) {
  if (!(span > 0)) return 1;
  double raw = span / target, p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

// At most about 2 * kMaxBuckets points of a long run: per bucket of consecutive points its lowest
// and its highest (in step order), so that a one-step spike still shows.
constexpr size_t kMaxBuckets = 1000;
std::vector<std::pair<int64_t, double>> thin_out(std::vector<std::pair<int64_t, double>> pts) {
  if (pts.size() <= 2 * kMaxBuckets) return pts;
  const size_t per = (pts.size() + kMaxBuckets - 1) / kMaxBuckets;
  std::vector<std::pair<int64_t, double>> out;
  for (size_t b = 0; b < pts.size(); b += per) {
    const auto first = pts.begin() + static_cast<std::ptrdiff_t>(b);
    const auto last = pts.begin() + static_cast<std::ptrdiff_t>(std::min(b + per, pts.size()));
    auto by_value = [](const auto& x, const auto& y) { return x.second < y.second; };
    auto lo = std::min_element(first, last, by_value), hi = std::max_element(first, last, by_value);
    if (lo->first > hi->first) std::swap(lo, hi);
    out.push_back(*lo);
    if (hi != lo) out.push_back(*hi);
  }
  return out;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

}  // namespace

std::string loss_chart_svg(const std::vector<LossCurve>& curves, const std::string& title,
                           int64_t from_step) {
  const char* colours[] = {"#3b7dd8", "#e08a2c", "#2ca02c", "#d62728",
                           "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};
  constexpr size_t kMaxCurves = sizeof colours / sizeof colours[0];
  if (curves.size() > kMaxCurves)
    throw std::invalid_argument("loss chart: " + std::to_string(curves.size()) +
                                " curves, at most " + std::to_string(kMaxCurves) +
                                " fit in one chart (each has its own colour and legend entry)");
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (const LossCurve& c : curves)
    for (const auto* pts : {&c.train, &c.eval})
      for (const auto& [s, v] : *pts) {
        if (s < from_step) continue;
        x_lo = std::min(x_lo, static_cast<double>(s));
        x_hi = std::max(x_hi, static_cast<double>(s));
        y_lo = std::min(y_lo, v);
        y_hi = std::max(y_hi, v);
      }
  if (!(x_lo <= x_hi))
    throw std::invalid_argument("loss chart: no logged step at or after step " +
                                std::to_string(from_step));
  if (x_hi == x_lo) x_hi = x_lo + 1;
  if (y_hi - y_lo < 1e-9) y_hi = y_lo + 1e-3;
  const double pad = 0.04 * (y_hi - y_lo);
  y_lo -= pad;
  y_hi += pad;

  const int width = 780, height = 440, left = 60, right = 200, top = 40, bottom = 50;
  const double pw = width - left - right, ph = height - top - bottom;
  auto px = [&](double s) { return left + pw * (s - x_lo) / (x_hi - x_lo); };
  auto py = [&](double v) { return top + ph * (y_hi - v) / (y_hi - y_lo); };
  auto xy = [&](double s, double v) {
    char b[48];
    std::snprintf(b, sizeof b, "%.1f,%.1f", px(s), py(v));
    return std::string(b);
  };

  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">" << escape_xml(title)
    << "</text>\n";
  // Grid and axes: ticks at round steps and losses.
  // Steps are whole numbers: no tick between two of them.
  const double xs = std::max(1.0, tick_step(x_hi - x_lo, 6)), ys = tick_step(y_hi - y_lo, 6);
  for (double i = std::ceil(x_lo / xs), t = i * xs; t <= x_hi + 1e-9; t = ++i * xs)
    o << "<line x1=\"" << px(t) << "\" y1=\"" << top << "\" x2=\"" << px(t) << "\" y2=\""
      << top + ph << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << px(t) << "\" y=\"" << top + ph + 16
      << "\" text-anchor=\"middle\">" << num(t) << "</text>\n";
  for (double i = std::ceil(y_lo / ys), t = i * ys; t <= y_hi + 1e-9; t = ++i * ys)
    o << "<line x1=\"" << left << "\" y1=\"" << py(t) << "\" x2=\"" << left + pw << "\" y2=\""
      << py(t) << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << left - 6 << "\" y=\"" << py(t) + 4
      << "\" text-anchor=\"end\">" << num(t) << "</text>\n";
  o << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"#888\"/>\n"
    << "<text x=\"" << left + pw / 2 << "\" y=\"" << height - 12
    << "\" text-anchor=\"middle\">step</text>\n"
    << "<text transform=\"translate(16," << top + ph / 2
    << ") rotate(-90)\" text-anchor=\"middle\">loss</text>\n";

  for (size_t i = 0; i < curves.size(); ++i) {
    const LossCurve& c = curves[i];
    const char* colour = colours[i];
    auto polyline = [&](const std::vector<std::pair<int64_t, double>>& pts, const char* cls,
                        double stroke) {
      std::vector<std::pair<int64_t, double>> shown;
      for (const auto& pt : pts)
        if (pt.first >= from_step) shown.push_back(pt);
      if (shown.size() == 1)  // a one-point line would not show
        o << "<circle cx=\"" << px(shown[0].first) << "\" cy=\"" << py(shown[0].second)
          << "\" r=\"2\" fill=\"" << colour << "\"/>\n";
      std::string points;
      for (const auto& [s, v] : thin_out(std::move(shown)))
        points += (points.empty() ? "" : " ") + xy(s, v);
      if (points.empty()) return;
      o << "<polyline class=\"" << cls << "\" points=\"" << points << "\" fill=\"none\" stroke=\""
        << colour << "\" stroke-width=\"" << stroke << "\""
        << (stroke < 1.5 ? " opacity=\"0.6\"" : "") << "/>\n";
    };
    polyline(c.train, "train", 1.0);
    polyline(c.eval, "eval", 2.5);
    const auto shown_evals = std::count_if(c.eval.begin(), c.eval.end(),
                                           [&](const auto& e) { return e.first >= from_step; });
    for (const auto& [s, v] : c.eval)
      if (s >= from_step && shown_evals <= 200)  // dots only where they stay apart
        o << "<circle cx=\"" << px(s) << "\" cy=\"" << py(v) << "\" r=\"3\" fill=\"" << colour
          << "\"/>\n";
    // Legend: the label, then the last evaluation loss (or training loss) for reading off.
    const int ly = top + 10 + static_cast<int>(i) * 34;
    const int lx = width - right + 14;
    o << "<line x1=\"" << lx << "\" y1=\"" << ly << "\" x2=\"" << lx + 22 << "\" y2=\"" << ly
      << "\" stroke=\"" << colour << "\" stroke-width=\"2.5\"/>\n<text x=\"" << lx + 28 << "\" y=\""
      << ly + 4 << "\">" << escape_xml(c.label) << "</text>\n";
    char last[80] = "";
    if (!c.eval.empty())
      std::snprintf(last, sizeof last, "eval %.4f at step %lld", c.eval.back().second,
                    static_cast<long long>(c.eval.back().first));
    else if (!c.train.empty())
      std::snprintf(last, sizeof last, "loss %.4f at step %lld", c.train.back().second,
                    static_cast<long long>(c.train.back().first));
    o << "<text x=\"" << lx + 28 << "\" y=\"" << ly + 18 << "\" fill=\"#555\" font-size=\"11\">"
      << last << "</text>\n";
  }
  o << "<text x=\"" << width - right + 14 << "\" y=\"" << height - bottom
    << "\" fill=\"#555\" font-size=\"11\">thin: training loss</text>\n"
    << "<text x=\"" << width - right + 14 << "\" y=\"" << height - bottom + 14
    << "\" fill=\"#555\" font-size=\"11\">thick + dots: evaluation</text>\n"
    << "</svg>\n";
  return o.str();
}

void write_loss_chart(const std::string& path, const std::vector<LossCurve>& curves,
                      const std::string& title, int64_t from_step) {
  const std::string svg = loss_chart_svg(curves, title, from_step);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << svg;
    f.close();
    if (!f) throw std::runtime_error("cannot write " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw std::runtime_error("cannot rename " + tmp + " to " + path + ": " + ec.message());
}

std::string run_name(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "out/run/" -> "out/run"
  return p.filename().string();
}

}  // namespace accel
