#include "tools/trainer/trainer.h"

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "models/fp8_linear.h"
#include "models/llama.h"
#include "parallel/fsdp.h"  // reads_init_weights
#include "parallel/launch_env.h"
#include "parallel/launcher.h"
#include "parallel/process_group.h"
#include "parallel/store.h"
#include "parallel/strategy.h"
#include "runtime/config.h"
#include "runtime/data/corpus.h"
#include "runtime/data/loader.h"
#include "runtime/data/tokenizer.h"
#include "tools/trainer/checkpoint.h"
#include "tools/trainer/loss_chart.h"
#include "tools/trainer/progress.h"

namespace accel {
namespace fs = std::filesystem;

namespace {

// A user's mistake that the config validation could not see (exit code 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Device resolve_device(const Config& cfg, int local_rank) {
  const std::string& d = cfg.training.device;
  bool want_cuda = d == "cuda" || (d == "auto" && !cfg.use_cpu && cuda::available());
  if (d == "cuda" && !cuda::available())
    throw UsageError(
        "training.device is cuda but no CUDA device is usable in this build/machine; "
        "set training.device: cpu");
  if (!want_cuda) return Device::cpu();
  int n = cuda::device_count();
  int idx = cfg.gpu_id_list.empty() ? local_rank % std::max(n, 1) : cfg.gpu_id_list.at(local_rank);
  return Device::cuda(idx);
}

DType compute_dtype(const Config& cfg) {
  if (cfg.mixed_precision == "no") return DType::F32;
  if (cfg.mixed_precision == "bf16") return DType::BF16;
  if (cfg.mixed_precision == "fp16") return DType::F16;
  if (cfg.mixed_precision == "fp8") return DType::BF16;  // fp8 linear layers: apply_fp8()
  throw UsageError("mixed_precision: " + cfg.mixed_precision +
                   " training is not implemented yet in accel-train (use no, bf16, fp16 or fp8)");
}

// Peak dense FLOP/s of the device for the compute dtype, or < 0 when unknown (CPU).
double peak_flops(Device d, DType compute, bool tf32) {
  if (!d.is_cuda()) return -1;
  if (compute == DType::BF16 || compute == DType::F16) return 989e12;  // H100/H200 SXM dense
  return tf32 ? 494e12 : 67e12;
}

LlamaConfig model_config(const Config& cfg) {
  if (!cfg.model.init_from.empty()) {
    fs::path p = fs::path(cfg.model.init_from) / "config.json";
    if (!fs::exists(p))
      throw UsageError("model.init_from: " + cfg.model.init_from +
                       " has no config.json (expected a Hugging Face model folder)");
    return read_hf_llama_config(p.string());
  }
  const ModelConfig& m = cfg.model;
  LlamaConfig c;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_hidden_layers = m.num_hidden_layers;
  c.num_attention_heads = m.num_attention_heads;
  c.num_key_value_heads = m.num_key_value_heads ? m.num_key_value_heads : m.num_attention_heads;
  c.head_dim = m.head_dim ? m.head_dim : m.hidden_size / m.num_attention_heads;
  c.vocab_size = m.vocab_size;
  c.max_position_embeddings = m.max_position_embeddings;
  c.rope_theta = m.rope_theta;
  c.rms_norm_eps = m.rms_norm_eps;
  c.initializer_range = m.initializer_range;
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.validate();
  return c;
}

DataOptions data_options(const Config& cfg, const LlamaConfig& mc, int rank, int world) {
  DataOptions o;
  o.source = cfg.data.source;
  if (!cfg.data.train_path.empty()) o.files = {cfg.data.train_path};
  if (!cfg.data.eval_path.empty()) o.eval_files = {cfg.data.eval_path};
  o.eval_fraction = cfg.data.eval_fraction;
  o.text_files = cfg.data.text_files;
  o.tokenizer = cfg.data.tokenizer;
  // Tokenized text is cached beside the run so that a resumed run reads the same shards.
  o.cache_dir = (fs::path(cfg.training.output_dir) / "data").string();
  o.seq_len = cfg.training.seq_len;
  o.micro_batch_size = cfg.training.micro_batch_size;
  o.vocab_size = mc.vocab_size;
  o.rank = rank;
  o.world_size = world;
  o.seed = cfg.training.seed;
  o.shuffle = cfg.data.shuffle;
  return o;
}

// The previous run's files in an output folder we are about to write into.
void check_output_dir(const std::string& dir, bool resuming) {
  if (resuming || !fs::exists(dir)) return;
  for (const char* f : {"metrics.jsonl", "config.yaml", "checkpoints"})
    if (fs::exists(fs::path(dir) / f))
      throw UsageError("output folder " + dir + " already holds another run (found " + f +
                       "); pass --resume auto to continue it, or choose another --output-dir");
}

std::string greedy_sample(LlamaForCausalLM& model, const Tokenizer& tok, const std::string& prompt,
                          int64_t n, Device device) {
  NoGradGuard no_grad;
  std::vector<uint32_t> ids;
  tok.encode(prompt, &ids);
  if (ids.empty()) ids.push_back(0);
  std::vector<uint32_t> generated;
  for (int64_t i = 0; i < n; ++i) {
    int64_t ctx =
        std::min<int64_t>(static_cast<int64_t>(ids.size()), model.config.max_position_embeddings);
    std::vector<int64_t> window(ids.end() - ctx, ids.end());
    Tensor in = Tensor::from_vector(window, {1, ctx}, DType::I64, device);
    Tensor logits = model.forward(in);
    std::vector<double> last = narrow(reshape(logits, {ctx, -1}), 0, ctx - 1, 1).to_vector();
    uint32_t best =
        static_cast<uint32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    ids.push_back(best);
    generated.push_back(best);
  }
  return tok.decode(generated);
}

struct Distributed {
  LaunchEnv env;
  std::shared_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;  // null on one process
  void barrier() const {
    if (pg) pg->barrier()->wait();
  }
  double mean_across_ranks(double v, Device device) const {
    if (!pg) return v;
    Tensor t = Tensor::full({1}, v, DType::F64, Device::cpu());
    if (pg->backend() == "nccl") t = t.to(device);
    pg->all_reduce(t, ReduceOp::Avg)->wait();
    return t.item();
  }
};

Distributed init_distributed(const Config& cfg, Device device) {
  Distributed d;
  d.env = detect_launch_env(cfg.main_process_ip, cfg.main_process_port);
  check_world_size(d.env.world_size, static_cast<int>(cfg.num_processes));
  if (!d.env.distributed()) return d;
  Environment env = current_environment();
  Timeouts t = timeouts_from_env(
      env,
      Timeouts{std::chrono::milliseconds(static_cast<int64_t>(cfg.distributed.timeout_s * 1000)),
               std::chrono::milliseconds(static_cast<int64_t>(cfg.distributed.timeout_s * 1000))});
  StoreOptions so;
  so.host = d.env.master_addr;
  so.port = d.env.master_port;
  so.is_server = d.env.rank == 0;
  so.token = resolve_job_token(env).token;
  so.timeout = t.rendezvous;
  d.store = std::make_shared<TcpStore>(so);
  ProcessGroupOptions po;
  po.timeout = t.collective;
  std::string backend = cfg.distributed.backend;
  if (backend == "auto") backend = device.is_cuda() ? "nccl" : "cpu";
  if (backend == "nccl")
    d.pg = make_nccl_process_group(d.store, d.env.rank, d.env.world_size, device.index, po);
  else
    d.pg = make_cpu_process_group(d.store, d.env.rank, d.env.world_size, po);
  return d;
}

class MetricsLog {
 public:
  MetricsLog(const std::string& path, bool enabled, bool append) {
    if (enabled) out_.open(path, append ? std::ios::app : std::ios::trunc);
  }
  void write(const nlohmann::json& j) {
    if (out_.is_open()) out_ << j.dump() << "\n" << std::flush;
  }

 private:
  std::ofstream out_;
};

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

int train(const TrainOptions& opt) {
  std::vector<std::string> overrides = opt.overrides;
  Config cfg = load_config(opt.config_path, overrides, environment_variables());
  if (!opt.output_dir.empty()) cfg.training.output_dir = opt.output_dir;
  if (opt.print_config) {
    std::cout << config_to_yaml(cfg);
    return 0;
  }
  LaunchEnv pre = detect_launch_env(cfg.main_process_ip, cfg.main_process_port);
  const Device device = resolve_device(cfg, pre.local_rank);
  const DType cdt = compute_dtype(cfg);
  const LlamaConfig mc = model_config(cfg);
  mc.check_batch(cfg.training.micro_batch_size, cfg.training.seq_len);  // init_from sizes too
  set_allow_tf32(device, cfg.training.allow_tf32);
  Distributed dist = init_distributed(cfg, device);
  const int rank = dist.env.rank, world = dist.env.world_size;
  const bool main_rank = rank == 0;
  const std::string out_dir = cfg.training.output_dir;
  const bool resuming = !opt.resume.empty();
  if (main_rank) check_output_dir(out_dir, resuming);
  dist.barrier();
  fs::create_directories(out_dir);
  const std::string config_yaml = config_to_yaml(cfg);
  if (main_rank) {
    std::ofstream(fs::path(out_dir) / "config.yaml") << config_yaml;
    std::fprintf(stderr, "accel-train: effective configuration (also in %s/config.yaml)\n%s",
                 out_dir.c_str(), config_yaml.c_str());
    for (const std::string& n : cfg.notices) std::fprintf(stderr, "note: %s\n", n.c_str());
  }

  // Model, strategy, data.
  auto start_time = std::chrono::steady_clock::now();
  LlamaForCausalLM model(mc, DType::F32, device, cfg.training.seed);
  // fsdp_cpu_ram_efficient_loading: only rank 0 reads the weights; setup() hands them out.
  if (!cfg.model.init_from.empty() && reads_init_weights(cfg, rank))
    load_hf_weights(model, cfg.model.init_from);
  model.set_activation_checkpointing(cfg.training.activation_checkpointing ||
                                     cfg.fsdp.fsdp_activation_checkpointing);
  std::unique_ptr<Fp8Training> fp8 =
      cfg.mixed_precision == "fp8" ? apply_fp8(model, cfg.fp8, device) : nullptr;
  std::unique_ptr<Strategy> strategy = make_strategy(cfg, dist.pg, cdt);
  if (fp8) {  // FSDP's fp8 all-gather hands these layers their gathered e4m3 weights
    Strategy::Fp8Layers layers;
    for (const Fp8LayerChoice& c : fp8->layers())
      if (c.fp8) layers.push_back({c.name, fp8->layer_context(c.name)});
    strategy->set_fp8_layers(layers);
  }
  OptimizerOptions oo;
  oo.name = cfg.optimizer.name;
  oo.beta1 = cfg.optimizer.beta1;
  oo.beta2 = cfg.optimizer.beta2;
  oo.eps = cfg.optimizer.eps;
  oo.weight_decay = cfg.optimizer.weight_decay;
  oo.momentum = cfg.optimizer.momentum;
  strategy->setup(model, oo);
  DataSources data = make_data_sources(data_options(cfg, mc, rank, world));
  std::unique_ptr<Tokenizer> tokenizer =
      cfg.data.source == "synthetic" ? nullptr : make_tokenizer(cfg.data.tokenizer);

  const int64_t accum = cfg.gradient_accumulation_steps;
  const int64_t tokens_per_step =
      cfg.training.micro_batch_size * cfg.training.seq_len * accum * world;
  const double flops_per_token = mc.flops_per_token(cfg.training.seq_len);
  const double peak = peak_flops(device, cdt, cfg.training.allow_tf32);
  LRSchedule sched{cfg.optimizer.lr_schedule, cfg.optimizer.lr, cfg.optimizer.warmup_steps,
                   cfg.training.max_steps, cfg.optimizer.min_lr_ratio};
  double loss_scale = cdt == DType::F16 ? cfg.training.loss_scale_init : 1.0;
  int64_t good_steps = 0, skipped_steps = 0;

  // Test hook (docs/fault_tolerance.md): ACCEL_TEST_INJECT_NAN_STEP=N makes step N's loss NaN
  // (ACCEL_TEST_INJECT_NAN_WHERE=grad: only the gradients, the logged loss stays finite;
  // ACCEL_TEST_INJECT_NAN_RANK=R: only on rank R).
  const char* inject_env = std::getenv("ACCEL_TEST_INJECT_NAN_STEP");
  const int64_t inject_step = inject_env ? std::atoll(inject_env) : -1;
  const char* inject_where_env = std::getenv("ACCEL_TEST_INJECT_NAN_WHERE");
  const bool inject_grad_only = inject_where_env && std::string(inject_where_env) == "grad";
  const char* inject_rank_env = std::getenv("ACCEL_TEST_INJECT_NAN_RANK");
  const bool inject_here = !inject_rank_env || std::atoi(inject_rank_env) == pre.rank;

  int64_t step = 0;
  if (resuming) {
    auto found = find_checkpoint(out_dir, opt.resume);
    if (found) {
      LoadedCheckpoint ck = load_checkpoint(*found, rank, world);
      check_same_shard_layout(*found, ck.state.extra, strategy->checkpoint_manifest());
      strategy->load_state(ck.weights, ck.optimizer_state, ck.state.optimizer_steps);
      const std::string fp8_note = restore_fp8_state(fp8.get(), ck);  // TE: amax histories, scales
      if (main_rank && !fp8_note.empty()) std::fprintf(stderr, "note: %s\n", fp8_note.c_str());
      DataPosition pos;
      from_json(ck.state.data_position, pos);
      data.train->restore(pos);
      step = ck.state.step;
      loss_scale = ck.state.loss_scale;
      if (main_rank)
        std::fprintf(stderr, "resumed from %s at step %lld\n", found->c_str(),
                     static_cast<long long>(step));
    } else if (main_rank) {
      std::fprintf(stderr,
                   "--resume auto: no complete checkpoint in %s/checkpoints; starting fresh\n",
                   out_dir.c_str());
    }
  }
  if (main_rank)
    std::fprintf(
        stderr,
        "model: llama %.1fM params, %lld layers, hidden %lld | device %s | precision %s | "
        "strategy %s x %d | data %s | %lld tokens/step | startup %.1fs\n",
        static_cast<double>(mc.num_parameters()) / 1e6,
        static_cast<long long>(mc.num_hidden_layers), static_cast<long long>(mc.hidden_size),
        device.str().c_str(), cfg.mixed_precision.c_str(), strategy->name().c_str(), world,
        data.train->describe().c_str(), static_cast<long long>(tokens_per_step),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count());
  if (main_rank && fp8) std::fprintf(stderr, "%s\n", fp8->describe().c_str());

  const std::string metrics_path = (fs::path(out_dir) / cfg.logging.metrics_file).string();
  MetricsLog metrics(metrics_path, main_rank, resuming);
  Progress progress(cfg.training.progress, cfg.training.max_steps, step, main_rank);
  // <output_dir>/loss.svg, redrawn after each evaluation and at the end from the losses logged
  // (a resumed run starts from its metrics file). A chart that cannot be written is worth a
  // warning, not the run.
  LossHistory loss_history;
  if (main_rank && resuming && fs::exists(metrics_path)) {
    try {
      loss_history = LossHistory::read(metrics_path);
    } catch (const std::exception& e) {
      progress.println(std::string("warning: the loss chart starts afresh: ") + e.what());
    }
  }
  const std::string precision = cfg.mixed_precision == "no" ? "fp32" : cfg.mixed_precision;
  const std::string chart_title = run_name(out_dir) + ": " + precision + ", " + strategy->name() +
                                  " x " + std::to_string(world);
  auto write_chart = [&] {
    if (!main_rank) return;
    try {
      write_loss_chart((fs::path(out_dir) / "loss.svg").string(), {loss_history.curve("this run")},
                       chart_title);
    } catch (const std::exception& e) {
      progress.println(std::string("warning: loss chart not written: ") + e.what());
    }
  };
  CheckpointWriter writer{rank, world, [&dist] { dist.barrier(); }, fp8.get(), dist.pg.get()};
  auto save = [&](int64_t at_step) {
    TrainerState st;
    st.step = at_step;
    st.optimizer_steps = strategy->optimizer_steps();
    st.seed = cfg.training.seed;
    st.world_size = world;
    st.data_position = data.train->position();
    st.loss_scale = loss_scale;
    st.extra = strategy->checkpoint_manifest();
    std::string dir =
        save_checkpoint(out_dir, st, strategy->full_state_dict(), mc, strategy->optimizer_state(),
                        config_yaml, writer, cfg.checkpoint.keep_last);
    progress.println("saved checkpoint " + dir);
  };
  auto evaluate = [&]() -> double {
    if (!data.eval) return NAN;
    NoGradGuard no_grad;
    Fp8EvalScope fp8_eval(fp8.get());
    DataPosition start = data.eval->position();
    double total = 0;
    int64_t n = std::min(cfg.training.eval_batches, data.eval->batches_per_epoch());
    for (int64_t i = 0; i < n; ++i) {
      Batch b = data.eval->next();
      Tensor logits = model.forward(b.input_ids.to(device));
      total += LlamaForCausalLM::loss(logits, b.labels.to(device)).item();
    }
    data.eval->restore(start);
    return dist.mean_across_ranks(n ? total / static_cast<double>(n) : NAN, device);
  };

  auto train_start = std::chrono::steady_clock::now();
  auto last_log = train_start;
  int64_t last_log_step = step;
  double last_loss = NAN, last_eval = NAN;
  auto logged_step = [&](int64_t s) {
    return s % cfg.training.log_every == 0 || s == cfg.training.max_steps;
  };
  CommStats last_comm;
  if (dist.pg) last_comm = dist.pg->stats();
  double last_host_wait = cuda::host_wait_seconds();
  // Host time per phase less the time blocked on the GPU inside it, summed until the next log
  // line: a phase that takes about as long as the GPU's share of the step means the host (op
  // dispatch, launches), not the GPU, sets the pace.
  std::array<double, 3> host_busy{};  // forward, backward, optimizer (seconds)
  auto host_timed = [](double& busy, auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    const double w0 = cuda::host_wait_seconds();
    f();
    busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() -
            (cuda::host_wait_seconds() - w0);
  };
  reset_peak_memory_stats(device);
  while (step < cfg.training.max_steps) {
    double lr = sched.at(step);
    double loss_sum = 0;
    for (int64_t micro = 0; micro < accum; ++micro) {
      strategy->begin_micro_batch(micro == accum - 1);
      Batch b = data.train->next();
      const bool inject = inject_here && step + 1 == inject_step && micro == accum - 1;
      Tensor loss, scaled;
      host_timed(host_busy[0], [&] {
        Tensor logits = model.forward(b.input_ids.to(device));
        loss = LlamaForCausalLM::loss(logits, b.labels.to(device));
        if (inject && !inject_grad_only) loss = mul(loss, NAN);
        scaled = mul(loss, loss_scale / static_cast<double>(accum));
        if (inject && inject_grad_only) scaled = mul(scaled, NAN);
      });
      host_timed(host_busy[1], [&] { scaled.backward(); });
      loss_sum += loss.item();  // after backward is queued: reading it earlier drains the GPU
      strategy->end_micro_batch();
    }
    StepResult r;
    host_timed(host_busy[2], [&] {
      r = strategy->step(lr, cfg.optimizer.grad_clip, 1.0 / loss_scale);
      if (fp8) fp8->step_end(dist.pg.get());  // delayed scaling: amax all-reduce, new scales
    });
    ++step;
    double loss = dist.mean_across_ranks(loss_sum / static_cast<double>(accum), device);
    if (cdt == DType::F16) {
      // Dynamic loss scaling: back off on overflow, grow after a window of clean steps.
      if (r.skipped) {
        loss_scale = std::max(1.0, loss_scale / 2);
        good_steps = 0;
      } else if (++good_steps % cfg.training.loss_scale_window == 0) {
        loss_scale *= 2;
      }
    }
    if (r.skipped || !std::isfinite(loss)) {
      ++skipped_steps;
      std::string what =
          "non-finite " + std::string(std::isfinite(loss) ? "gradients" : "loss") + " at step " +
          std::to_string(step) + "; first non-finite gradient: " +
          (r.first_non_finite.empty()
               ? std::string("none (the gradients are finite; their norm overflowed)")
               : r.first_non_finite);
      if (cdt != DType::F16 && cfg.training.nan_policy == "stop")
        throw std::runtime_error(what +
                                 " (training.nan_policy: stop; use skip to skip such steps)");
      if (cdt != DType::F16) progress.println("warning: " + what + "; step skipped");
    }
    last_loss = loss;
    const bool evaluated = cfg.training.eval_every > 0 && step % cfg.training.eval_every == 0;
    if (evaluated) {
      last_eval = evaluate();
      progress.println("step " + std::to_string(step) + " eval_loss " + std::to_string(last_eval));
      loss_history.add_eval(step, last_eval);
      if (!logged_step(step)) {  // logged on its own line; else on the step's line below
        metrics.write({{"step", step}, {"eval_loss", last_eval}});
        write_chart();
      }
    }
    if (logged_step(step)) {
      auto now = std::chrono::steady_clock::now();
      double dt = std::chrono::duration<double>(now - last_log).count();
      double tps = dt > 0 ? static_cast<double>((step - last_log_step) * tokens_per_step) / dt : 0;
      const int64_t steps_logged = step - last_log_step;
      last_log = now;
      last_log_step = step;
      StepReport rep;
      rep.step = step;
      rep.loss = loss;
      rep.lr = lr;
      rep.grad_norm = r.grad_norm;
      rep.tokens_per_s = tps;
      rep.elapsed_s = std::chrono::duration<double>(now - train_start).count();
      rep.mfu = peak > 0 ? tps / world * flops_per_token / peak : -1;
      rep.peak_mem_bytes = memory_stats(device).peak_total;
      progress.update(rep);
      nlohmann::json j = {{"step", step},
                          {"loss", loss},
                          {"lr", lr},
                          {"grad_norm", r.grad_norm},
                          {"tokens_per_s", tps},
                          {"mfu", rep.mfu >= 0 ? nlohmann::json(rep.mfu) : nlohmann::json(nullptr)},
                          {"peak_mem_bytes", rep.peak_mem_bytes},
                          {"elapsed_s", rep.elapsed_s},
                          {"skipped_steps", skipped_steps}};
      if (cdt == DType::F16) j["loss_scale"] = loss_scale;
      if (dist.pg)
        j["comm_wire_bytes_per_step"] = comm_delta(dist.pg->stats(), last_comm, steps_logged);
      if (device.is_cuda()) {  // how long the host sat waiting for the GPU, per step
        const double wait = cuda::host_wait_seconds();
        j["host_wait_ms_per_step"] = (wait - last_host_wait) * 1e3 / steps_logged;
        last_host_wait = wait;
        j["host_busy_ms_per_step"] = {{"forward", host_busy[0] * 1e3 / steps_logged},
                                      {"backward", host_busy[1] * 1e3 / steps_logged},
                                      {"optimizer", host_busy[2] * 1e3 / steps_logged}};
        host_busy = {};
      }
      if (evaluated) j["eval_loss"] = last_eval;
      metrics.write(j);
      loss_history.add_train(step, loss);
      if (evaluated) write_chart();
    }
    if (cfg.checkpoint.every_steps > 0 && step % cfg.checkpoint.every_steps == 0 &&
        step < cfg.training.max_steps)
      save(step);
  }
  progress.finish();
  if (cfg.checkpoint.at_end && step > 0) save(step);
  double final_eval = cfg.training.eval_every > 0 ? evaluate() : NAN;
  double train_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start).count();
  // Every rank's peak memory by category, for the summary (accel-bench reads it).
  const std::vector<double> my_peaks = peak_memory(device);
  std::vector<nlohmann::json> rank_memory{memory_json(my_peaks.data())};
  if (dist.pg) {
    const int64_t n = static_cast<int64_t>(my_peaks.size());
    Tensor in = Tensor::from_vector(my_peaks, {n}, DType::F64);
    Tensor all = Tensor::empty({n * world}, DType::F64);
    if (dist.pg->backend() == "nccl") {
      in = in.to(device);
      all = all.to(device);
    }
    dist.pg->all_gather(all, in)->wait();
    std::vector<double> v = all.to_vector();
    rank_memory.clear();
    for (int r = 0; r < world; ++r) rank_memory.push_back(memory_json(&v[r * n]));
  }
  // With sharded parameters (ZeRO-3) every forward is collective: all ranks sample together.
  std::string sample_text;
  if (cfg.training.sample_tokens > 0 && tokenizer &&
      (main_rank || strategy->forward_is_collective())) {
    Fp8EvalScope fp8_eval(fp8.get());
    sample_text = greedy_sample(model, *tokenizer, cfg.training.sample_prompt,
                                cfg.training.sample_tokens, device);
  }
  if (main_rank) {
    nlohmann::json summary = {{"summary", true},
                              {"steps", step},
                              {"final_loss", last_loss},
                              {"train_seconds", train_s},
                              {"skipped_steps", skipped_steps},
                              {"peak_memory_bytes", memory_json(peak_memory(device).data())},
                              {"peak_memory_bytes_per_rank", rank_memory},
                              {"tokens_per_step", tokens_per_step},
                              {"flops_per_token", flops_per_token},
                              {"num_parameters", mc.num_parameters()},
                              {"world_size", world},
                              {"strategy", strategy->name()}};
    if (std::isfinite(final_eval)) summary["final_eval_loss"] = final_eval;
    const nlohmann::json report = strategy->run_report();
    if (report.is_object()) summary.update(report);
    metrics.write(summary);
    if (std::isfinite(final_eval)) loss_history.add_eval(step, final_eval);
    if (step > 0) write_chart();
    const std::string report_line = strategy->run_report_line();
    if (!report_line.empty()) std::fprintf(stderr, "%s\n", report_line.c_str());
    std::fprintf(
        stderr, "done: %lld steps, final loss %.4f%s, %.1fs, peak memory %s\n",
        static_cast<long long>(step), last_loss,
        std::isfinite(final_eval) ? (", eval loss " + std::to_string(final_eval)).c_str() : "",
        train_s, format_bytes(memory_stats(device).peak_total).c_str());
    if (!sample_text.empty())
      std::fprintf(stderr, "sample (greedy): %s%s\n", cfg.training.sample_prompt.c_str(),
                   sample_text.c_str());
  }
  dist.barrier();
  return 0;
}

}  // namespace

int run_training(const TrainOptions& options, int argc, char** argv) {
  try {
    // Without a launcher, num_processes > 1 on one machine: become the launcher of local ranks.
    Config cfg = load_config(options.config_path, options.overrides, environment_variables());
    LaunchEnv env = detect_launch_env(cfg.main_process_ip, cfg.main_process_port);
    if (!options.print_config &&
        should_spawn_local_ranks(env.world_size, static_cast<int>(cfg.num_processes),
                                 static_cast<int>(cfg.num_machines)))
      return run_local_ranks(static_cast<int>(cfg.num_processes), argc, argv);
    return train(options);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "accel-train: configuration error: %s\n", e.what());
    return 2;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "accel-train: %s\n", e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "accel-train: %s\n", e.what());
    return 2;
  } catch (const DistributedError& e) {
    std::fprintf(stderr, "accel-train: error: %s\n", e.what());
    return kExitAfterPeerFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-train: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace accel
