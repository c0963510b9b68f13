// accel-bench: run the same model under several strategies and precisions, each combination in its
// own accel-train processes, and report throughput, step time, MFU, memory, traffic and loss.
//
//   accel-bench --config configs/llama-1b.yaml --strategies ddp,zero1,zero2,zero3,fsdp,fsdp-fp8
//               --precisions bf16,fp8 --steps 20 --warmup 5 --json out.json --chart out.svg
//
// A precision "fp8:NAME" runs mixed_precision fp8 with fp8_config.backend AO and
// fp8_config.recipe_name NAME (tensorwise, rowwise, rowwise_with_gw_hp, blockwise), or backend TE
// for "fp8:te", so that the recipes land side by side in one table:
//   --precisions bf16,fp8:te,fp8:tensorwise,fp8:rowwise,fp8:rowwise_with_gw_hp,fp8:blockwise
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "runtime/config.h"
#include "runtime/device.h"
#include "tools/cli.h"
#include "tools/trainer/bench_report.h"

namespace fs = std::filesystem;
using namespace accel;

namespace {

std::string shell_quote(const std::string& s) {
  std::string o = "'";
  for (char c : s) o += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return o + "'";
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// The config overrides that select a strategy, or a reason it cannot be expressed.
bool strategy_overrides(const std::string& strategy, const std::string& precision, bool gpu,
                        std::vector<std::string>& sets, std::string& why_not) {
  if (strategy == "single") {
    sets.push_back("distributed_type=NO");
  } else if (strategy == "ddp") {
    sets.push_back(std::string("distributed_type=") + (gpu ? "MULTI_GPU" : "MULTI_CPU"));
  } else if (strategy == "zero1" || strategy == "zero2" || strategy == "zero3") {
    sets.push_back("distributed_type=DEEPSPEED");
    sets.push_back("deepspeed_config.zero_stage=" + strategy.substr(4));
  } else if (strategy == "fsdp" || strategy == "fsdp-fp8") {
    sets.push_back("distributed_type=FSDP");
    sets.push_back("fsdp_config.fsdp_version=2");
    if (strategy == "fsdp-fp8") {
      if (precision.rfind("fp8", 0) != 0) {
        why_not = "fsdp-fp8 (fp8 all-gather) needs precision fp8";
        return false;
      }
      // The fp8 all-gather needs dynamic (torchao-style) weight scaling: backend AO.
      sets.push_back("fp8_config.backend=AO");
      sets.push_back("fp8_config.enable_fsdp_float8_all_gather=true");
    }
  } else {
    throw std::invalid_argument("unknown strategy '" + strategy +
                                "' (expected single, ddp, zero1, zero2, zero3, fsdp, fsdp-fp8)");
  }
  return true;
}

// "fp8:NAME" -> mixed_precision fp8 plus the fp8_config overrides of that recipe; any other
// precision is a mixed_precision value as is.
std::string precision_overrides(const std::string& precision, std::vector<std::string>& sets) {
  if (precision.rfind("fp8:", 0) != 0) return precision;
  const std::string recipe = precision.substr(4);
  if (recipe == "te") {
    sets.push_back("fp8_config.backend=TE");
  } else {
    sets.push_back("fp8_config.backend=AO");
    sets.push_back("fp8_config.recipe_name=" + recipe);  // accel-train refuses unknown names
  }
  return "fp8";
}

std::string last_error_line(const fs::path& log) {
  std::ifstream in(log);
  std::string line, last;
  while (std::getline(in, line))
    if (line.rfind("accel-train:", 0) == 0 || line.find("error") != std::string::npos) last = line;
  return last.empty() ? "see " + log.string() : last;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"accel-bench: compare parallelism strategies and precisions on one model"};
  std::string config, strategies = "single,ddp,zero1,zero2,zero3,fsdp", precisions = "bf16";
  std::string json_out, chart_out, markdown_out, work_dir = "out/bench", device = "auto";
  std::vector<std::string> extra_sets;
  int64_t steps = 20, warmup = 5;
  int num_processes = 0;
  app.add_option("--config,-c", config, "model/training YAML (e.g. configs/llama-1b.yaml)")
      ->required();
  app.add_option("--strategies", strategies,
                 "comma list: single ddp zero1 zero2 zero3 fsdp fsdp-fp8");
  app.add_option("--precisions", precisions,
                 "comma list: no bf16 fp16 fp8, or fp8:te / fp8:RECIPE for an AO "
                 "fp8_config.recipe_name (tensorwise rowwise rowwise_with_gw_hp blockwise)");
  app.add_option("--steps", steps, "timed steps per combination");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--num-processes", num_processes,
                 "ranks per combination (default: GPUs, or 2 on CPU)");
  app.add_option("--device", device, "auto | cpu | cuda");
  app.add_option("--set", extra_sets, "extra accel-train --set overrides");
  app.add_option("--work-dir", work_dir, "where each run's output folder goes");
  app.add_option("--json", json_out, "write the results as JSON");
  app.add_option("--chart", chart_out, "write an SVG chart of throughput and memory");
  app.add_option("--markdown", markdown_out, "write the table as markdown");
  if (auto code = parse_command_line(app, argc, argv)) return *code;

  try {
    Config base = load_config(config, extra_sets, environment_variables());
    const bool gpu = device == "cuda" || (device == "auto" && cuda::available());
    const int gpus = cuda::available() ? cuda::device_count() : 0;
    if (num_processes <= 0) num_processes = gpu ? std::max(gpus, 1) : 2;
    const double peak = gpu ? 989e12 : -1;  // dense bf16 of an H100/H200; unknown on CPUs
    const fs::path exe = fs::read_symlink("/proc/self/exe").parent_path() / "accel-train";
    std::vector<BenchRow> rows;
    for (const std::string& strategy : split_list(strategies)) {
      for (const std::string& precision : split_list(precisions)) {
        BenchRow row;
        row.strategy = strategy;
        row.precision = precision;
        const int world = strategy == "single" ? 1 : num_processes;
        row.world_size = world;
        std::vector<std::string> sets = extra_sets;
        std::string why_not;
        if (!strategy_overrides(strategy, precision, gpu, sets, why_not)) {
          row.status = "skipped";
          row.reason = why_not;
        } else if (gpu && world > gpus) {
          row.status = "skipped";
          row.reason =
              "needs " + std::to_string(world) + " GPUs, this machine has " + std::to_string(gpus);
        }
        if (row.status != "ok") {
          rows.push_back(row);
          std::cerr << "accel-bench: " << strategy << "/" << precision << " skipped: " << row.reason
                    << "\n";
          continue;
        }
        fs::path out = fs::path(work_dir) / (strategy + "-" + precision);
        fs::remove_all(out);
        fs::create_directories(out);
        sets.push_back("mixed_precision=" + precision_overrides(precision, sets));
        sets.push_back("num_processes=" + std::to_string(world));
        sets.push_back("training.max_steps=" + std::to_string(steps + warmup));
        sets.push_back("training.log_every=1");
        sets.push_back("training.progress=none");
        sets.push_back("training.device=" + std::string(gpu ? "cuda" : "cpu"));
        sets.push_back("training.eval_every=0");
        sets.push_back("checkpoint.at_end=false");
        sets.push_back("checkpoint.every_steps=0");
        std::string cmd = shell_quote(exe.string()) + " --config " + shell_quote(config) +
                          " --output-dir " + shell_quote((out / "run").string());
        for (const std::string& s : sets) cmd += " --set " + shell_quote(s);
        cmd += " > " + shell_quote((out / "log.txt").string()) + " 2>&1";
        std::cerr << "accel-bench: running " << strategy << "/" << precision << " on " << world
                  << " rank(s)\n";
        int status = std::system(cmd.c_str());
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 0) {
          row.status = "failed";
          row.reason = "exit " + std::to_string(code) + ": " + last_error_line(out / "log.txt");
        } else {
          try {
            read_bench_metrics((out / "run" / "metrics.jsonl").string(), warmup, peak, row);
          } catch (const std::exception& e) {
            row.status = "failed";
            row.reason = e.what();
          }
        }
        rows.push_back(row);
      }
    }
    std::cout << bench_table(rows);
    std::cout << "MFU = tokens/s per device x FLOPs per token / peak, FLOPs per token = 6 x "
                 "(parameters - input embedding) + 12 x layers x seq x hidden"
              << (peak > 0 ? ", peak 989 TFLOP/s (dense bf16)" : " (no known peak on CPUs)")
              << "\n";
    if (!json_out.empty()) std::ofstream(json_out) << bench_json(rows).dump(1) << "\n";
    if (!markdown_out.empty()) std::ofstream(markdown_out) << bench_markdown(rows);
    if (!chart_out.empty())
      std::ofstream(chart_out) << bench_svg(rows,
                                            "accel-bench: " + fs::path(config).stem().string());
    for (const BenchRow& r : rows)
      if (r.status == "failed") return 1;
    return 0;
  } catch (const ConfigError& e) {
    std::cerr << "accel-bench: configuration error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "accel-bench: " << e.what() << "\n";
    return 2;
  }
}
