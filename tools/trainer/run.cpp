#include "tools/trainer/run.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "parallel/fsdp.h"  // reads_init_weights
#include "parallel/process_group.h"
#include "parallel/store.h"

namespace accel {
namespace fs = std::filesystem;

void Distributed::barrier() const {
  if (pg) pg->barrier()->wait();
}

double Distributed::mean_across_ranks(double v, Device device) const {
  if (!pg) return v;
  Tensor t = Tensor::full({1}, v, DType::F64, Device::cpu());
  if (pg->backend() == "nccl") t = t.to(device);
  pg->all_reduce(t, ReduceOp::Avg)->wait();
  return t.item();
}

std::vector<double> Distributed::all_gather(const std::vector<double>& values,
                                            Device device) const {
  if (!pg) return values;
  const int64_t n = static_cast<int64_t>(values.size());
  Tensor in = Tensor::from_vector(values, {n}, DType::F64);
  Tensor all = Tensor::empty({n * world()}, DType::F64);
  if (pg->backend() == "nccl") {
    in = in.to(device);
    all = all.to(device);
  }
  pg->all_gather(all, in)->wait();
  return all.to_vector();
}

int64_t Run::tokens_per_step() const {
  return cfg.training.micro_batch_size * cfg.training.seq_len * cfg.gradient_accumulation_steps *
         dist.world();
}

namespace {

Device resolve_device(const Config& cfg, int local_rank) {
  const DeviceChoice d = cfg.training.device;
  if (d == DeviceChoice::Cuda && !cuda::available())
    throw UsageError(
        "training.device is cuda but no CUDA device is usable in this build/machine; "
        "set training.device: cpu");
  const bool want_cuda =
      d == DeviceChoice::Cuda || (d == DeviceChoice::Auto && !cfg.use_cpu && cuda::available());
  // MULTI_GPU means GPUs: DDP over CPU processes is asked for by name, never fallen back to.
  if (!want_cuda && cfg.distributed_type == DistributedType::MultiGpu)
    throw UsageError(std::string("distributed_type is MULTI_GPU but ") +
                     (cuda::available() ? "training.device is cpu"
                                        : "no CUDA device is usable in this build/machine") +
                     ": set use_cpu: true (Accelerate's way) or distributed_type: MULTI_CPU to "
                     "run DDP over CPU processes");
  if (!want_cuda) return Device::cpu();
  int n = cuda::device_count();
  int idx = cfg.gpu_id_list.empty() ? local_rank % std::max(n, 1) : cfg.gpu_id_list.at(local_rank);
  return Device::cuda(idx);
}

Distributed init_distributed(const Config& cfg, const LaunchEnv& launch, Device device) {
  Distributed d;
  d.env = launch;
  check_world_size(d.env.world_size, static_cast<int>(cfg.num_processes));
  if (!d.env.distributed()) return d;
  share_cpu_cores(d.env);
  Environment env = current_environment();
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(cfg.distributed.timeout_s * 1000));
  Timeouts t = timeouts_from_env(env, Timeouts{timeout, timeout});
  StoreOptions so;
  so.host = d.env.master_addr;
  so.port = d.env.master_port;
  so.is_server = d.env.rank == 0;
  so.listen_fd = d.env.store_listen_fd;
  so.token = resolve_job_token(env).token;
  so.timeout = t.rendezvous;
  d.store = std::make_shared<TcpStore>(so);
  ProcessGroupOptions po;
  po.timeout = t.collective;
  const bool nccl = cfg.distributed.backend == CommBackend::Nccl ||
                    (cfg.distributed.backend == CommBackend::Auto && device.is_cuda());
  if (nccl)
    d.pg = make_nccl_process_group(d.store, d.env.rank, d.env.world_size, device.index, po);
  else
    d.pg = make_cpu_process_group(d.store, d.env.rank, d.env.world_size, po);
  return d;
}

DecoderConfig model_config(const Config& cfg) {
  if (!cfg.model.init_from.empty()) {
    fs::path p = fs::path(cfg.model.init_from) / "config.json";
    if (!fs::exists(p))
      throw UsageError("model.init_from: " + cfg.model.init_from +
                       " has no config.json (expected a Hugging Face model folder)");
    return read_hf_model_config(p.string());
  }
  return decoder_config(cfg.model);
}

// model.init_from gives the shape: the effective config shows the loaded model's, each key's
// origin the folder's config.json.
void adopt_loaded_shape(Config& cfg, const DecoderConfig& mc) {
  ModelConfig& m = cfg.model;
  const std::string where = (fs::path(m.init_from) / "config.json").string();
  const ModelConfig loaded = model_section(mc);
  auto take = [&](const char* key, auto& field, const auto& value) {
    if (field == value) return;
    field = value;
    cfg.origins[std::string("model.") + key] = where;
  };
  // The decoder layer FSDP wraps is the loaded family's (the YAML's model.name named another).
  std::string& wrap = cfg.fsdp.fsdp_transformer_layer_cls_to_wrap;
  if (wrap == hf_class_prefix(m.name) + "DecoderLayer")
    wrap = hf_class_prefix(loaded.name) + "DecoderLayer";
  take("name", m.name, loaded.name);
  take("hidden_size", m.hidden_size, loaded.hidden_size);
  take("intermediate_size", m.intermediate_size, loaded.intermediate_size);
  take("num_hidden_layers", m.num_hidden_layers, loaded.num_hidden_layers);
  take("num_attention_heads", m.num_attention_heads, loaded.num_attention_heads);
  take("num_key_value_heads", m.num_key_value_heads, loaded.num_key_value_heads);
  take("head_dim", m.head_dim, loaded.head_dim);
  take("vocab_size", m.vocab_size, loaded.vocab_size);
  take("max_position_embeddings", m.max_position_embeddings, loaded.max_position_embeddings);
  take("rope_theta", m.rope_theta, loaded.rope_theta);
  take("rope_scaling", m.rope_scaling, loaded.rope_scaling);
  take("rms_norm_eps", m.rms_norm_eps, loaded.rms_norm_eps);
  take("initializer_range", m.initializer_range, loaded.initializer_range);
  take("tie_word_embeddings", m.tie_word_embeddings, loaded.tie_word_embeddings);
  take("attention_bias", m.attention_bias, loaded.attention_bias);
  take("sliding_window", m.sliding_window, loaded.sliding_window);
  take("use_sliding_window", m.use_sliding_window, loaded.use_sliding_window);
  take("max_window_layers", m.max_window_layers, loaded.max_window_layers);
  take("layer_types", m.layer_types, loaded.layer_types);
  take("num_experts", m.num_experts, loaded.num_experts);
  take("num_experts_per_tok", m.num_experts_per_tok, loaded.num_experts_per_tok);
  take("moe_intermediate_size", m.moe_intermediate_size, loaded.moe_intermediate_size);
  take("norm_topk_prob", m.norm_topk_prob, loaded.norm_topk_prob);
  take("decoder_sparse_step", m.decoder_sparse_step, loaded.decoder_sparse_step);
  take("mlp_only_layers", m.mlp_only_layers, loaded.mlp_only_layers);
  take("router_aux_loss_coef", m.router_aux_loss_coef, loaded.router_aux_loss_coef);
  take("output_router_logits", m.output_router_logits, loaded.output_router_logits);
}

// The previous run's files in an output folder we are about to write into.
void check_output_dir(const std::string& dir, bool resuming) {
  if (resuming || !fs::exists(dir)) return;
  for (const char* f : {"metrics.jsonl", "config.yaml", "checkpoints"})
    if (fs::exists(fs::path(dir) / f))
      throw UsageError("output folder " + dir + " already holds another run (found " + f +
                       "); pass --resume auto to continue it, or choose another --output-dir");
}

void write_config_yaml(const std::string& dir, const std::string& yaml) {
  const fs::path p = fs::path(dir) / "config.yaml";
  std::ofstream out(p);
  out << yaml;
  out.close();
  if (!out)
    throw std::runtime_error(p.string() +
                             ": cannot write the effective configuration (disk full, or not "
                             "writable?); free space or choose another --output-dir");
}

DataOptions data_options(const Config& cfg, const DecoderConfig& mc, int rank, int world) {
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
  o.jsonl_files = cfg.data.jsonl_files;
  o.format = cfg.data.format;
  o.text_field = cfg.data.text_field;
  o.chat_template = cfg.data.chat_template;
  o.packing = cfg.data.packing;
  o.reset_position_ids = cfg.data.reset_position_ids;
  o.pad_to_multiple_of = cfg.data.pad_to_multiple_of;
  o.overlong = cfg.data.overlong;
  return o;
}

// training.num_epochs -> training.max_steps, once the data says how many batches an epoch holds;
// the effective config.yaml is written again with the steps (and says where they came from).
void steps_from_epochs(Run& run) {
  TrainingConfig& t = run.cfg.training;
  const int64_t per_epoch = run.data.train->batches_per_epoch();
  if (per_epoch < 0)
    throw UsageError("training.num_epochs needs data that has epochs, but data.source " +
                     std::string(name_of(run.cfg.data.source)) +
                     " is endless; set training.max_steps");
  const double micro_batches = t.num_epochs * static_cast<double>(per_epoch);
  const int64_t accum = run.cfg.gradient_accumulation_steps;
  t.max_steps = std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(micro_batches / static_cast<double>(accum) - 1e-9)));
  std::ostringstream why;
  why << "training.num_epochs " << t.num_epochs << " x " << per_epoch
      << " batches per epoch per rank / gradient_accumulation_steps " << accum;
  run.cfg.origins["training.max_steps"] = why.str();
  run.config_yaml = config_to_yaml(run.cfg);
  if (run.main_rank()) {
    write_config_yaml(run.output_dir(), run.config_yaml);
    std::fprintf(stderr, "training.max_steps %lld from %s\n", static_cast<long long>(t.max_steps),
                 why.str().c_str());
  }
}

OptimizerOptions optimizer_options(const Config& cfg) {
  const OptimizerConfig& c = cfg.optimizer;
  OptimizerOptions o;
  o.name = c.name;
  o.beta1 = c.beta1;
  o.beta2 = c.beta2;
  o.eps = c.eps;
  o.weight_decay = c.weight_decay;
  o.momentum = c.momentum;
  o.state_dtype = c.state_dtype == StateDType::Bf16 ? DType::BF16 : DType::F32;
  o.master_dtype = c.master_weights == StateDType::Bf16 ? DType::BF16 : DType::F32;
  // The stochastic rounding's seeds: training.seed and the optimizer step (restored on resume).
  o.rounding_seed = cfg.training.seed;
  return o;
}

}  // namespace

Run assemble_run(Config cfg, const LaunchEnv& env, bool resuming, bool print_config) {
  Run run;
  run.cfg = std::move(cfg);
  const Config& c = run.cfg;
  run.resuming = resuming;
  run.start_time = std::chrono::steady_clock::now();

  // 1. Device and the distributed init.
  run.device = resolve_device(c, env.local_rank);
  run.precision = std::make_unique<Precision>(c);
  run.model_config = model_config(c);  // before the rendezvous: a bad shape fails at once
  run.model_config.check_batch(c.training.micro_batch_size, c.training.seq_len);  // init_from too
  if (!c.model.init_from.empty()) adopt_loaded_shape(run.cfg, run.model_config);
  set_allow_tf32(run.device, c.training.allow_tf32);
  run.dist = init_distributed(c, env, run.device);
  if (c.distributed.expert_parallel_size > 1) {
    // The groups are made here, in the same order on every rank, before anything else makes
    // groups.
    if (!run.dist.pg || run.dist.world() % c.distributed.expert_parallel_size != 0)
      throw UsageError("distributed.expert_parallel_size " +
                       std::to_string(c.distributed.expert_parallel_size) +
                       " does not divide the " + std::to_string(run.dist.world()) +
                       " processes launched: launch a multiple of it, or set it to a divisor");
    run.expert_parallel = std::make_shared<const ExpertParallelContext>(
        make_expert_parallel(run.dist.pg, static_cast<int>(c.distributed.expert_parallel_size),
                             model_num_experts(c.model), run.device));
  }

  // 2. The output folder.
  const std::string& out_dir = c.training.output_dir;
  if (run.main_rank()) check_output_dir(out_dir, resuming);
  run.dist.barrier();
  fs::create_directories(out_dir);
  run.config_yaml = config_to_yaml(c);
  if (run.main_rank()) {
    write_config_yaml(out_dir, run.config_yaml);
    if (print_config)
      std::fprintf(stderr, "accel-train: effective configuration (also in %s/config.yaml)\n%s",
                   out_dir.c_str(), run.config_yaml.c_str());
    else
      std::fprintf(stderr,
                   "accel-train: output in %s (config.yaml there is the effective configuration; "
                   "-v prints it)\n",
                   out_dir.c_str());
    for (const std::string& n : c.notices) std::fprintf(stderr, "note: %s\n", n.c_str());
  }

  // 3. The model: seeded initialization, then init_from's weights (with
  // fsdp_cpu_ram_efficient_loading only rank 0 reads them; setup() hands them out).
  // Under expert parallelism the MoE layers hold this rank's experts only (global names) and
  // dispatch through the context; init_from then reads just those experts.
  run.model = std::make_unique<CausalLM>(run.model_config, DType::F32, run.device, c.training.seed,
                                         run.expert_parallel.get());
  if (!c.model.init_from.empty() && reads_init_weights(c, run.dist.rank())) {
    load_hf_weights(*run.model, c.model.init_from);
    if (run.main_rank()) {
      const std::vector<Parameter*> params = run.model->parameters();
      int64_t numel = 0;
      for (const Parameter* p : params) numel += p->value.numel();
      std::fprintf(stderr, "model.init_from: read %zu tensors (%.2f M parameters%s) from %s\n",
                   params.size(), static_cast<double>(numel) / 1e6,
                   run.expert_parallel ? ", rank 0's experts only" : "", c.model.init_from.c_str());
    }
  }
  run.model->set_activation_checkpointing(c.training.activation_checkpointing);

  // 4. Precision conversion.
  run.precision->convert(*run.model, run.device);

  // 5. The strategy.
  run.strategy =
      make_strategy(c, run.dist.pg, run.precision->compute_dtype(), run.expert_parallel.get());
  run.precision->attach(*run.strategy);
  run.strategy->setup(*run.model, optimizer_options(c));

  // 6. Data.
  run.data =
      make_data_sources(data_options(c, run.model_config, run.dist.rank(), run.dist.world()));
  if (c.data.source != DataSource::Synthetic) run.tokenizer = make_tokenizer(c.data.tokenizer);
  if (run.main_rank()) {
    for (const std::string& n : run.data.notices) std::fprintf(stderr, "warning: %s\n", n.c_str());
    for (const std::string& n : run.data.info) std::fprintf(stderr, "data: %s\n", n.c_str());
  }
  if (c.training.num_epochs > 0 && !c.origins.count("training.max_steps")) steps_from_epochs(run);
  return run;
}

}  // namespace accel
