#include "tools/trainer/run_log.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "tools/trainer/run.h"

namespace accel {
namespace fs = std::filesystem;

namespace {

// Peak dense FLOP/s of the device for the compute dtype, or < 0 when unknown (CPU).
double peak_flops(Device d, DType compute, bool tf32) {
  if (!d.is_cuda()) return -1;
  if (compute == DType::BF16 || compute == DType::F16) return 989e12;  // H100/H200 SXM dense
  return tf32 ? 494e12 : 67e12;
}

// What this rank's collectives moved: the world group's and the strategy's own groups' (expert
// parallelism's all-to-alls).
CommStats comm_stats(const Run& run) {
  CommStats s = run.dist.pg->stats();
  if (run.strategy) {
    const CommStats g = run.strategy->group_comm_stats();
    for (int k = 0; k < kNumCommKinds; ++k) {
      s.kind[k].calls += g.kind[k].calls;
      s.kind[k].bytes += g.kind[k].bytes;
      s.kind[k].wire_bytes += g.kind[k].wire_bytes;
    }
  }
  return s;
}

// Bytes this rank sent per step, by collective, since `last` (which is then updated).
nlohmann::json comm_delta(const CommStats& now, CommStats& last, int64_t steps) {
  nlohmann::json j = nlohmann::json::object();
  for (int k = 0; k < kNumCommKinds; ++k) {
    int64_t b = now.kind[k].wire_bytes - last.kind[k].wire_bytes;
    if (b > 0) j[comm_kind_name(static_cast<CommKind>(k))] = b / std::max<int64_t>(steps, 1);
  }
  last = now;
  return j;
}

// This process's peak bytes per MemCategory, then the total.
std::vector<double> peak_memory(Device d) {
  MemoryStats s = memory_stats(d);
  std::vector<double> v(s.peak.begin(), s.peak.end());
  v.push_back(static_cast<double>(s.peak_total));
  return v;
}

// {"<category>": bytes, ..., "total": bytes} from peak_memory()'s layout.
nlohmann::json memory_json(const double* peaks) {
  nlohmann::json j;
  for (int i = 0; i < kNumMemCategories; ++i)
    j[mem_category_name(static_cast<MemCategory>(i))] = static_cast<int64_t>(peaks[i]);
  j["total"] = static_cast<int64_t>(peaks[kNumMemCategories]);
  return j;
}

std::string why_not(const std::string& path, const char* doing) {
  return path + ": " + doing + " failed (" + std::strerror(errno) +
         "); free space or point logging.metrics_file at a writable place";
}

}  // namespace

nlohmann::json HostTimes::take_ms_per_step(int64_t steps) {
  const double n = static_cast<double>(std::max<int64_t>(steps, 1));
  nlohmann::json j = {{"forward", busy_[kForward] * 1e3 / n},
                      {"backward", busy_[kBackward] * 1e3 / n},
                      {"optimizer", busy_[kOptimizer] * 1e3 / n}};
  busy_ = {};
  return j;
}

MetricsFile::MetricsFile(const std::string& path, bool append, const std::string& tensorboard_dir)
    : path_(path) {
  errno = 0;
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_.is_open()) throw std::runtime_error(why_not(path, "opening the metrics file"));
  if (tensorboard_dir.empty()) return;
  // The event files say what metrics.jsonl says: older ones would keep a resumed run's re-run
  // steps twice, so they go and the kept lines are written again.
  std::error_code ec;
  if (fs::is_directory(tensorboard_dir, ec))
    for (const auto& e : fs::directory_iterator(tensorboard_dir))
      if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) fs::remove(e.path());
  tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_dir);
  if (append) {
    std::ifstream in(path);
    const double now = wall_time_now();
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded()) tensorboard_->add_metrics(j, now);
    }
  }
  tensorboard_->flush();
}

void MetricsFile::write(const nlohmann::json& line) {
  if (!out_.is_open()) return;
  errno = 0;
  out_ << line.dump() << "\n" << std::flush;
  if (!out_) throw std::runtime_error(why_not(path_, "writing the metrics file"));
  if (tensorboard_) {
    tensorboard_->add_metrics(line, wall_time_now());
    tensorboard_->flush();
  }
}

void truncate_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  in.close();
  std::string kept;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      if (i + 1 == lines.size()) continue;  // torn by the interruption
    } else if (j.is_object() && j.contains("summary")) {
      continue;
    } else if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
               j["step"].get<int64_t>() > step) {
      continue;
    }
    kept += line + "\n";
  }
  const std::string tmp = path + ".tmp";
  {
    errno = 0;
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    out.close();
    if (!out) throw std::runtime_error(why_not(tmp, "rewriting the metrics file for the resume"));
  }
  fs::rename(tmp, path);
}

RunLog::RunLog(const Run& run, int64_t first_step)
    : run_(run),
      main_(run.main_rank()),
      progress_(run.cfg.training.progress, run.cfg.training.max_steps, first_step, main_),
      last_log_step_(first_step) {
  const std::string metrics_path =
      (fs::path(run.output_dir()) / run.cfg.logging.metrics_file).string();
  if (main_) {
    if (run.resuming) truncate_metrics_after(metrics_path, first_step);
    metrics_ = MetricsFile(
        metrics_path, run.resuming,
        run.cfg.logging.tensorboard ? (fs::path(run.output_dir()) / "tb").string() : "");
    // The loss chart of a resumed run starts from its metrics file. A chart that cannot be
    // written (or read back) is worth a warning, not the run.
    if (first_step > 0 && fs::exists(metrics_path)) {
      try {
        loss_history_ = LossHistory::read(metrics_path);
      } catch (const std::exception& e) {
        println(std::string("warning: the loss chart starts afresh: ") + e.what());
      }
    }
  }
  chart_title_ = run_name(run.output_dir()) + ": " + run.precision->name() + ", " +
                 run.strategy->name() + " x " + std::to_string(run.dist.world());
  flops_per_token_ = run.model_config.flops_per_token(run.cfg.training.seq_len);
  peak_flops_ = peak_flops(run.device, run.precision->compute_dtype(), run.cfg.training.allow_tf32);
  if (run.dist.pg) last_comm_ = comm_stats(run);
  last_host_wait_ = cuda::host_wait_seconds();
  reset_peak_memory_stats(run.device);
  train_start_ = last_log_ = std::chrono::steady_clock::now();
}

void RunLog::println(const std::string& line) { progress_.println(line); }

bool RunLog::logged_step(int64_t s) const {
  return s % run_.cfg.training.log_every == 0 || s == run_.cfg.training.max_steps;
}

void RunLog::write_chart() {
  if (!main_) return;
  try {
    write_loss_chart((fs::path(run_.output_dir()) / "loss.svg").string(),
                     {loss_history_.curve("this run")}, chart_title_);
  } catch (const std::exception& e) {
    println(std::string("warning: loss chart not written: ") + e.what());
  }
}

nlohmann::json expert_load_json(const std::vector<std::vector<double>>& expert_tokens) {
  double lo = INFINITY, hi = 0, sum = 0;
  int64_t n = 0;
  for (const auto& layer : expert_tokens)
    for (double v : layer) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      sum += v;
      ++n;
    }
  if (n == 0) return nullptr;
  const double mean = sum / static_cast<double>(n);
  return {{"min", lo},
          {"max", hi},
          {"mean", mean},
          {"imbalance", mean > 0 ? nlohmann::json(hi / mean) : nlohmann::json(nullptr)}};
}

void RunLog::step(int64_t step, double loss, double lr, const StepResult& r,
                  std::optional<double> eval_loss, const StepTokens& tokens,
                  const MoeStepStats* moe) {
  last_loss_ = loss;
  if (moe) {
    moe_ = true;
    last_aux_loss_ = moe->aux_loss;
    expert_tokens_total_.resize(moe->expert_tokens.size());
    for (size_t l = 0; l < moe->expert_tokens.size(); ++l) {
      expert_tokens_total_[l].resize(moe->expert_tokens[l].size(), 0.0);
      for (size_t e = 0; e < moe->expert_tokens[l].size(); ++e)
        expert_tokens_total_[l][e] += moe->expert_tokens[l][e];
    }
  }
  since_log_.positions += tokens.positions;
  since_log_.trained += tokens.trained;
  total_.positions += tokens.positions;
  total_.trained += tokens.trained;
  if (eval_loss) {
    println("step " + std::to_string(step) + " eval_loss " + std::to_string(*eval_loss));
    loss_history_.add_eval(step, *eval_loss);
    if (!logged_step(step)) {  // a line of its own; else on the step's line below
      metrics_.write({{"step", step}, {"eval_loss", *eval_loss}});
      write_chart();
    }
  }
  if (!logged_step(step)) {
    progress_.tick(step);  // the bar moves every step; its numbers change at logged ones
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  const double dt = std::chrono::duration<double>(now - last_log_).count();
  const int64_t steps_logged = step - last_log_step_;
  const double tps = dt > 0 ? static_cast<double>(since_log_.trained) / dt : 0;
  const double trained_fraction =
      since_log_.positions > 0
          ? static_cast<double>(since_log_.trained) / static_cast<double>(since_log_.positions)
          : 0;
  since_log_ = {};
  last_log_ = now;
  last_log_step_ = step;
  StepReport rep;
  rep.step = step;
  rep.loss = loss;
  rep.lr = lr;
  rep.grad_norm = r.grad_norm;
  rep.tokens_per_s = tps;
  rep.elapsed_s = std::chrono::duration<double>(now - train_start_).count();
  rep.mfu = peak_flops_ > 0 ? tps / run_.dist.world() * flops_per_token_ / peak_flops_ : -1;
  rep.peak_mem_bytes = memory_stats(run_.device).peak_total;
  progress_.update(rep);
  nlohmann::json j = {{"step", step},
                      {"loss", loss},
                      {"lr", lr},
                      {"grad_norm", r.grad_norm},
                      {"tokens_per_s", tps},
                      {"mfu", rep.mfu >= 0 ? nlohmann::json(rep.mfu) : nlohmann::json(nullptr)},
                      {"peak_mem_bytes", rep.peak_mem_bytes},
                      {"elapsed_s", rep.elapsed_s},
                      {"skipped_steps", run_.precision->skipped_steps()}};
  if (run_.data.train->batches_per_epoch() > 0) {  // epochs done, from the data position
    const DataPosition p = run_.data.train->position();
    j["epoch"] = static_cast<double>(p.epoch) +
                 static_cast<double>(p.samples_consumed) / static_cast<double>(p.num_samples);
  }
  if (run_.data.train->has_documents()) j["trained_fraction"] = trained_fraction;
  const nlohmann::json precision_entries = run_.precision->metrics();
  if (precision_entries.is_object()) j.update(precision_entries);
  if (run_.dist.pg)
    j["comm_wire_bytes_per_step"] = comm_delta(comm_stats(run_), last_comm_, steps_logged);
  if (run_.device.is_cuda()) {  // how long the host sat waiting for the GPU, per step
    const double wait = cuda::host_wait_seconds();
    j["host_wait_ms_per_step"] = (wait - last_host_wait_) * 1e3 / steps_logged;
    last_host_wait_ = wait;
    j["host_busy_ms_per_step"] = host_.take_ms_per_step(steps_logged);
  }
  if (eval_loss) j["eval_loss"] = *eval_loss;
  if (moe) {
    j["aux_loss"] = moe->aux_loss;
    const nlohmann::json load = expert_load_json(moe->expert_tokens);
    if (load.is_object())
      for (const char* k : {"min", "max", "mean", "imbalance"})
        j[std::string("expert_tokens_") + k] = load[k];
  }
  metrics_.write(j);
  loss_history_.add_train(step, loss);
  if (eval_loss) write_chart();
}

void RunLog::finish(int64_t step, double final_eval,
                    const std::function<std::string()>& sample_fn) {
  const double train_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start_).count();
  // Every rank's peak memory by category, for the summary (accel-bench reads it).
  const std::vector<double> my_peaks = peak_memory(run_.device);
  const std::vector<double> all = run_.dist.all_gather(my_peaks, run_.device);
  std::vector<nlohmann::json> rank_memory;
  for (size_t at = 0; at < all.size(); at += my_peaks.size())
    rank_memory.push_back(memory_json(&all[at]));
  const std::string sample = sample_fn();
  if (!main_) return;
  const Strategy& strategy = *run_.strategy;
  nlohmann::json summary = {
      {"summary", true},
      {"steps", step},
      {"final_loss", last_loss_},
      {"train_seconds", train_s},
      {"skipped_steps", run_.precision->skipped_steps()},
      {"peak_memory_bytes", memory_json(peak_memory(run_.device).data())},
      {"peak_memory_bytes_per_rank", rank_memory},
      {"tokens_per_step", run_.tokens_per_step()},
      {"flops_per_token", flops_per_token_},
      {"num_parameters", run_.model_config.num_parameters()},
      {"world_size", run_.dist.world()},
      {"strategy", strategy.name()},
      {"optimizer_state_dtype", name_of(run_.cfg.optimizer.state_dtype)},
      {"optimizer_master_weights", name_of(run_.cfg.optimizer.master_weights)},
      {"activation_checkpointing", name_of(run_.cfg.training.activation_checkpointing)}};
  if (std::isfinite(final_eval)) summary["final_eval_loss"] = final_eval;
  if (moe_) {
    summary["num_active_parameters"] = run_.model_config.num_active_parameters();
    summary["final_aux_loss"] = last_aux_loss_;
    // Routed slots per expert over the run, by layer index (sparse layers only).
    nlohmann::json per_layer = nlohmann::json::object();
    for (size_t l = 0; l < expert_tokens_total_.size(); ++l)
      if (!expert_tokens_total_[l].empty()) per_layer[std::to_string(l)] = expert_tokens_total_[l];
    summary["expert_tokens"] = per_layer;
    summary["expert_load"] = expert_load_json(expert_tokens_total_);
  }
  if (run_.data.train->has_documents()) {
    summary["data"] = run_.data.train->stats().to_json();
    summary["trained_tokens"] = total_.trained;
    summary["trained_fraction"] = total_.positions > 0 ? static_cast<double>(total_.trained) /
                                                             static_cast<double>(total_.positions)
                                                       : 0.0;
  }
  const nlohmann::json report = strategy.run_report();
  if (report.is_object()) summary.update(report);
  metrics_.write(summary);
  if (std::isfinite(final_eval)) loss_history_.add_eval(step, final_eval);
  if (step > 0) write_chart();
  const std::string report_line = strategy.run_report_line();
  if (!report_line.empty()) std::fprintf(stderr, "%s\n", report_line.c_str());
  const MemoryStats mem = memory_stats(run_.device);
  std::fprintf(
      stderr,
      "done: %lld steps, final loss %.4f%s%s, %.1fs, peak memory %s (activations %s, "
      "checkpointing %s)\n",
      static_cast<long long>(step), last_loss_,
      moe_ ? (" (router aux loss " + std::to_string(last_aux_loss_) + ")").c_str() : "",
      std::isfinite(final_eval) ? (", eval loss " + std::to_string(final_eval)).c_str() : "",
      train_s, format_bytes(mem.peak_total).c_str(),
      format_bytes(mem.peak[static_cast<int>(MemCategory::Activations)]).c_str(),
      name_of(run_.cfg.training.activation_checkpointing));
  if (!sample.empty())
    std::fprintf(stderr, "sample (greedy): %s%s\n", run_.cfg.training.sample_prompt.c_str(),
                 sample.c_str());
  if (run_.cfg.checkpoint.at_end && step > 0)
    std::fprintf(stderr,
                 "sample more: accel-generate --model %s/checkpoints/step_%lld --prompt \"%s\" "
                 "--temperature 0.8 --top-p 0.95\n",
                 run_.output_dir().c_str(), static_cast<long long>(step),
                 run_.cfg.training.sample_prompt.c_str());
}

}  // namespace accel
