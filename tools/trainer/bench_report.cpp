#include "tools/trainer/bench_report.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "parallel/process_group.h"
#include "runtime/json.h"
#include "tools/trainer/progress.h"

namespace accel {

void read_bench_metrics(const std::string& metrics_path, int64_t warmup, double peak_flops,
                        BenchRow& row) {
  std::ifstream in(metrics_path);
  if (!in) throw std::runtime_error(metrics_path + ": no metrics (the run wrote none)");
  std::vector<double> elapsed;
  nlohmann::json summary, last_step;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j = parse_json(line, metrics_path);
    if (j.value("summary", false)) {
      summary = j;
    } else {
      elapsed.push_back(j.at("elapsed_s").get<double>());
      last_step = j;
    }
  }
  if (summary.is_null() || last_step.is_null())
    throw std::runtime_error(metrics_path + ": the run did not finish (no summary line)");
  std::vector<double> step_ms;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(warmup, 1)); i < elapsed.size(); ++i)
    step_ms.push_back(1e3 * (elapsed[i] - elapsed[i - 1]));
  if (step_ms.empty())
    throw std::runtime_error(metrics_path + ": no timed steps after " + std::to_string(warmup) +
                             " warm-up steps (log_every must be 1 and steps > warmup)");
  std::sort(step_ms.begin(), step_ms.end());
  row.step_ms_median = step_ms[step_ms.size() / 2];
  row.step_ms_p90 = step_ms[std::min(step_ms.size() - 1, step_ms.size() * 9 / 10)];
  const double tokens_per_step = summary.at("tokens_per_step").get<double>();
  row.world_size = summary.at("world_size");
  row.tokens_per_s = tokens_per_step / (row.step_ms_median / 1e3);
  row.tokens_per_s_per_device = row.tokens_per_s / row.world_size;
  row.mfu = peak_flops > 0 ? row.tokens_per_s_per_device *
                                 summary.at("flops_per_token").get<double>() / peak_flops
                           : -1;
  row.final_loss = summary.at("final_loss");
  row.peak_by_category = summary.at("peak_memory_bytes");
  row.peak_bytes_max_rank = 0;
  row.peak_by_rank = summary.value("peak_memory_bytes_per_rank", nlohmann::json::array());
  for (const auto& r : row.peak_by_rank)
    row.peak_bytes_max_rank = std::max<int64_t>(row.peak_bytes_max_rank, r.at("total"));
  if (!row.peak_bytes_max_rank) row.peak_bytes_max_rank = row.peak_by_category.at("total");
  row.comm_bytes_per_step = last_step.value("comm_wire_bytes_per_step", nlohmann::json::object());
  row.all_to_all_bytes_per_step =
      row.comm_bytes_per_step.value(comm_kind_name(CommKind::AllToAll), int64_t{0});
  row.expert_load = summary.value("expert_load", nlohmann::json());
  if (summary.contains("final_aux_loss") && summary["final_aux_loss"].is_number())
    row.final_aux_loss = summary["final_aux_loss"].get<double>();
  row.state_dtype = summary.value("optimizer_state_dtype", std::string("fp32"));
  row.activation_checkpointing = summary.value("activation_checkpointing", std::string("none"));
  row.peak_activation_bytes = row.peak_by_category.value("activations", int64_t{0});
  row.master_weights = summary.value("optimizer_master_weights", std::string("fp32"));
  row.expected_model_state_bytes = expected_model_state_bytes(
      row.strategy, row.precision, summary.at("num_parameters").get<int64_t>(), row.world_size,
      row.state_dtype == "bf16" ? 2 : 4, row.master_weights == "bf16" ? 0 : 4);
}

int64_t expected_model_state_bytes(const std::string& strategy, const std::string& precision,
                                   int64_t params, int world, int moment_bytes, int master_bytes) {
  const double P = static_cast<double>(params), N = world;
  const bool low = precision != "no";  // 16-bit (or fp8) compute copies next to fp32 masters
  const double w16 = low ? 2 : 0;      // 16-bit weights
  const double g = low ? 2 : 4;        // gradients in the compute dtype
  // The separate master copy (4, or 0 where the 16-bit weights are the masters) + Adam m + v.
  const double k = master_bytes + 2.0 * moment_bytes;
  double bytes;
  if (strategy == "zero1")
    bytes = (w16 + g) * P + k * P / N;
  else if (strategy == "zero2")
    bytes = w16 * P + (g + k) * P / N;
  else if (strategy == "zero3" || strategy.rfind("fsdp", 0) == 0)
    bytes = (w16 + g + k) * P / N;
  else
    bytes = (w16 + g + k) * P;
  return static_cast<int64_t>(bytes);
}

namespace {
std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::vector<std::vector<std::string>> cells(const std::vector<BenchRow>& rows) {
  // The all-to-all column only where a row has expert parallelism's traffic.
  bool a2a = false;
  for (const BenchRow& r : rows) a2a |= r.all_to_all_bytes_per_step > 0;
  std::vector<std::vector<std::string>> out{
      {"strategy", "precision", "ranks", "tok/s", "tok/s/dev", "step ms (p50/p90)", "MFU",
       "peak mem/rank", "activations (checkpointing)", "model states (formula)", "comm/step",
       "loss", "status"}};
  if (a2a) out[0].insert(out[0].end() - 2, "all-to-all/step");
  for (const BenchRow& r : rows) {
    if (r.status != "ok") {
      out.push_back({r.strategy, r.precision, std::to_string(r.world_size), "-", "-", "-", "-", "-",
                     "-", "-", "-", "-", r.status + ": " + r.reason});
      if (a2a) out.back().insert(out.back().end() - 2, "-");
      continue;
    }
    int64_t comm = 0;
    for (auto& [k, v] : r.comm_bytes_per_step.items()) comm += v.get<int64_t>();
    out.push_back({r.strategy, r.precision, std::to_string(r.world_size),
                   fmt("%.0f", r.tokens_per_s), fmt("%.0f", r.tokens_per_s_per_device),
                   fmt("%.1f", r.step_ms_median) + " / " + fmt("%.1f", r.step_ms_p90),
                   r.mfu >= 0 ? fmt("%.1f%%", 100 * r.mfu) : "-",
                   format_bytes(r.peak_bytes_max_rank),
                   format_bytes(r.peak_activation_bytes) + " (" + r.activation_checkpointing + ")",
                   format_bytes(r.expected_model_state_bytes), comm ? format_bytes(comm) : "0",
                   fmt("%.4f", r.final_loss), "ok"});
    if (a2a)
      out.back().insert(out.back().end() - 2, r.all_to_all_bytes_per_step
                                                  ? format_bytes(r.all_to_all_bytes_per_step)
                                                  : "0");
  }
  return out;
}
}  // namespace

std::string bench_table(const std::vector<BenchRow>& rows) {
  auto c = cells(rows);
  std::vector<size_t> w(c[0].size(), 0);
  for (auto& row : c)
    for (size_t i = 0; i < row.size(); ++i) w[i] = std::max(w[i], row[i].size());
  std::ostringstream o;
  for (auto& row : c) {
    for (size_t i = 0; i < row.size(); ++i) {
      o << row[i] << std::string(w[i] - row[i].size(), ' ');
      if (i + 1 < row.size()) o << "  ";
    }
    o << "\n";
  }
  // Mixture-of-experts runs: how evenly the routers spread the tokens over the experts.
  for (const BenchRow& r : rows) {
    if (!r.expert_load.is_object()) continue;
    char line[256];
    std::snprintf(
        line, sizeof line,
        "expert load %s/%s: tokens per expert min %.0f, max %.0f, mean %.1f, "
        "max/mean %.2f; router aux loss %.4f\n",
        r.strategy.c_str(), r.precision.c_str(), r.expert_load.value("min", 0.0),
        r.expert_load.value("max", 0.0), r.expert_load.value("mean", 0.0),
        r.expert_load["imbalance"].is_number() ? r.expert_load["imbalance"].get<double>() : 0.0,
        r.final_aux_loss);
    o << line;
  }
  return o.str();
}

std::string bench_markdown(const std::vector<BenchRow>& rows) {
  auto c = cells(rows);
  std::ostringstream o;
  for (size_t r = 0; r < c.size(); ++r) {
    o << "|";
    for (auto& cell : c[r]) o << " " << cell << " |";
    o << "\n";
    if (r == 0) {
      o << "|";
      for (size_t i = 0; i < c[0].size(); ++i) o << "---|";
      o << "\n";
    }
  }
  return o.str();
}

nlohmann::json bench_json(const std::vector<BenchRow>& rows) {
  nlohmann::json a = nlohmann::json::array();
  for (const BenchRow& r : rows)
    a.push_back({{"strategy", r.strategy},
                 {"precision", r.precision},
                 {"status", r.status},
                 {"reason", r.reason},
                 {"world_size", r.world_size},
                 {"tokens_per_s", r.tokens_per_s},
                 {"tokens_per_s_per_device", r.tokens_per_s_per_device},
                 {"step_ms_median", r.step_ms_median},
                 {"step_ms_p90", r.step_ms_p90},
                 {"mfu", r.mfu >= 0 ? nlohmann::json(r.mfu) : nlohmann::json(nullptr)},
                 {"final_loss", r.final_loss},
                 {"peak_bytes_max_rank", r.peak_bytes_max_rank},
                 {"peak_bytes_by_category_rank0", r.peak_by_category},
                 {"peak_bytes_by_category_per_rank", r.peak_by_rank},
                 {"expected_model_state_bytes", r.expected_model_state_bytes},
                 {"optimizer_state_dtype", r.state_dtype},
                 {"activation_checkpointing", r.activation_checkpointing},
                 {"peak_activation_bytes_rank0", r.peak_activation_bytes},
                 {"optimizer_master_weights", r.master_weights},
                 {"comm_wire_bytes_per_step", r.comm_bytes_per_step},
                 {"all_to_all_wire_bytes_per_step", r.all_to_all_bytes_per_step}});
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i].expert_load.is_object()) {
      a[i]["expert_load"] = rows[i].expert_load;
      a[i]["final_aux_loss"] = rows[i].final_aux_loss;
    }
  return a;
}

std::string bench_svg(const std::vector<BenchRow>& rows, const std::string& title) {
  // Two bar panels side by side: throughput and peak memory per rank, one bar per combination.
  const int bar_h = 22, gap = 8, label_w = 170, panel_w = 330, top = 50;
  const int n = static_cast<int>(rows.size());
  const int height = top + n * (bar_h + gap) + 40;
  const int width = label_w + 2 * panel_w + 60;
  double max_tps = 1, max_mem = 1;
  for (const BenchRow& r : rows) {
    max_tps = std::max(max_tps, r.tokens_per_s);
    max_mem = std::max(max_mem, static_cast<double>(r.peak_bytes_max_rank));
  }
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"10\" y=\"20\" font-size=\"15\" font-weight=\"bold\">" << title << "</text>\n";
  o << "<text x=\"" << label_w << "\" y=\"40\">tokens/s (all ranks)</text>\n";
  o << "<text x=\"" << label_w + panel_w + 30 << "\" y=\"40\">peak memory per rank</text>\n";
  for (int i = 0; i < n; ++i) {
    const BenchRow& r = rows[i];
    int y = top + i * (bar_h + gap);
    o << "<text x=\"10\" y=\"" << y + 15 << "\">" << r.strategy << " / " << r.precision
      << "</text>\n";
    if (r.status != "ok") {
      o << "<text x=\"" << label_w << "\" y=\"" << y + 15 << "\" fill=\"#a00\">" << r.status
        << "</text>\n";
      continue;
    }
    int w1 = static_cast<int>((panel_w - 70) * r.tokens_per_s / max_tps);
    int w2 =
        static_cast<int>((panel_w - 70) * static_cast<double>(r.peak_bytes_max_rank) / max_mem);
    o << "<rect x=\"" << label_w << "\" y=\"" << y << "\" width=\"" << w1 << "\" height=\"" << bar_h
      << "\" fill=\"#3b7dd8\"/>\n";
    o << "<text x=\"" << label_w + w1 + 4 << "\" y=\"" << y + 15 << "\">"
      << fmt("%.0f", r.tokens_per_s) << "</text>\n";
    int x2 = label_w + panel_w + 30;
    o << "<rect x=\"" << x2 << "\" y=\"" << y << "\" width=\"" << w2 << "\" height=\"" << bar_h
      << "\" fill=\"#e08a2c\"/>\n";
    o << "<text x=\"" << x2 + w2 + 4 << "\" y=\"" << y + 15 << "\">"
      << format_bytes(r.peak_bytes_max_rank) << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace accel
