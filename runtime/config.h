// The run configuration: one YAML file (which may `extends:` others), then ACCEL_* environment
// variables, then `--set key.path=value` overrides, over built-in defaults.
//
// Top-level keys and the fsdp_config / deepspeed_config / fp8_config sections are Accelerate's,
// with Accelerate's names and meanings, so an Accelerate default_config.yaml loads as is. Our own
// sections (model, training, optimizer, data, checkpoint, logging, distributed) follow. Validation
// is strict: unknown keys (with the closest valid key suggested), wrong types, bad enum values and
// impossible combinations all throw ConfigError naming the file (and line), the key path and what
// was expected. Accelerate keys that accel-train accepts but does not act on are kept and listed in
// Config::notices. docs/config.md documents every key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/rope_scaling.h"

namespace accel {

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Enum-valued keys are parsed once into these; the YAML spelling of each enumerator is
// EnumNames<E>::names[E] (name_of), the only place that spells it.
enum class MixedPrecision { No, Fp16, Bf16, Fp8 };
enum class DistributedType { No, MultiCpu, MultiGpu, Fsdp, DeepSpeed };
enum class DeviceChoice { Auto, Cpu, Cuda };  // training.device
enum class NanPolicy { Stop, Skip };
enum class ProgressMode { Auto, Bar, Plain, None };
enum class OptimizerName { AdamW, Sgd };
enum class StateDType { Fp32, Bf16 };  // optimizer.state_dtype
enum class LrScheduleKind { Constant, Linear, Cosine };
enum class DataSource { Text, Shards, Synthetic, Jsonl };
enum class DataFormat { Auto, Text, PromptCompletion, Messages };        // data.format
enum class ChatTemplateChoice { Llama3, Chatml, Qwen3, Mistral, Auto };  // data.chat_template
enum class OverlongPolicy { Truncate, Drop, Error };                     // data.overlong
enum class CommBackend { Auto, Nccl, Cpu };                              // distributed.backend
enum class FsdpWrapPolicy { TransformerBased, SizeBased, NoWrap };
enum class FsdpStateDictType { Sharded, Full };
enum class OffloadDevice { None, Cpu, Nvme };
enum class Fp8Backend { TE, AO, MSAMP };
enum class Fp8Format { Hybrid, E4M3, E5M2 };
enum class AmaxComputeAlgo { Max, MostRecent };
// fp8_config.recipe_name (backend AO): torchao's Float8LinearRecipeName values, plus DeepSeek-V3's
// blockwise recipe.
enum class Fp8RecipeName { Tensorwise, Rowwise, RowwiseWithGwHp, Blockwise };

template <class E>
struct EnumNames;
#define ACCEL_ENUM_NAMES(E, ...)                          \
  template <>                                             \
  struct EnumNames<E> {                                   \
    static constexpr const char* names[] = {__VA_ARGS__}; \
  }
ACCEL_ENUM_NAMES(MixedPrecision, "no", "fp16", "bf16", "fp8");
ACCEL_ENUM_NAMES(DistributedType, "NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED");
ACCEL_ENUM_NAMES(DeviceChoice, "auto", "cpu", "cuda");
ACCEL_ENUM_NAMES(NanPolicy, "stop", "skip");
ACCEL_ENUM_NAMES(ProgressMode, "auto", "bar", "plain", "none");
ACCEL_ENUM_NAMES(OptimizerName, "adamw", "sgd");
ACCEL_ENUM_NAMES(StateDType, "fp32", "bf16");
ACCEL_ENUM_NAMES(LrScheduleKind, "constant", "linear", "cosine");
ACCEL_ENUM_NAMES(DataSource, "text", "shards", "synthetic", "jsonl");
ACCEL_ENUM_NAMES(DataFormat, "auto", "text", "prompt_completion", "messages");
ACCEL_ENUM_NAMES(ChatTemplateChoice, "llama3", "chatml", "qwen3", "mistral", "auto");
ACCEL_ENUM_NAMES(OverlongPolicy, "truncate", "drop", "error");
ACCEL_ENUM_NAMES(CommBackend, "auto", "nccl", "cpu");
ACCEL_ENUM_NAMES(FsdpWrapPolicy, "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP");
ACCEL_ENUM_NAMES(FsdpStateDictType, "SHARDED_STATE_DICT", "FULL_STATE_DICT");
ACCEL_ENUM_NAMES(OffloadDevice, "none", "cpu", "nvme");
ACCEL_ENUM_NAMES(Fp8Backend, "TE", "AO", "MSAMP");
ACCEL_ENUM_NAMES(Fp8Format, "HYBRID", "E4M3", "E5M2");
ACCEL_ENUM_NAMES(AmaxComputeAlgo, "max", "most_recent");
ACCEL_ENUM_NAMES(Fp8RecipeName, "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise");
#undef ACCEL_ENUM_NAMES

// The config spelling of `e` ("bf16", "FSDP", ...), for messages and config.yaml.
template <class E>
const char* name_of(E e) {
  return EnumNames<E>::names[static_cast<size_t>(e)];
}

// Hugging Face config.json names (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig).
struct ModelConfig {
  std::string name =
      "llama";  // config.json's model_type (llama, qwen2, qwen3, mistral, qwen3_moe, mixtral)
  int64_t hidden_size = 256, num_hidden_layers = 4, num_attention_heads = 4,
          num_key_value_heads = 0 /* 0 = same as num_attention_heads */, intermediate_size = 688,
          vocab_size = 256, max_position_embeddings = 2048,
          head_dim = 0 /* 0 = hidden_size / num_attention_heads */;
  double rope_theta = 10000, rms_norm_eps = 1e-5, initializer_range = 0.02;
  RopeScaling rope_scaling;  // rope_scaling / rope_parameters
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // llama, qwen3: q/k/v/o biases (qwen2 always has q/k/v biases)
  // Sliding window (0 = none): mistral in every layer; qwen2/qwen3 with use_sliding_window from
  // layer max_window_layers on; layer_types (full_attention / sliding_attention) per layer.
  int64_t sliding_window = 0, max_window_layers = 0;
  bool use_sliding_window = false;
  std::vector<std::string> layer_types;
  // Mixture of experts (qwen3_moe, mixtral; the defaults elsewhere). num_experts is qwen3_moe's
  // num_experts and mixtral's num_local_experts; moe_intermediate_size is qwen3_moe's expert
  // width (mixtral's experts take intermediate_size). The defaults are transformers'.
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0,
          decoder_sparse_step = 1;
  bool norm_topk_prob = false, output_router_logits = false;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;
  // Hugging Face fields with one supported value (others are refused naming the key).
  std::string hidden_act = "silu";
  bool mlp_bias = false;
  double attention_dropout = 0;
  std::string init_from;  // a Hugging Face model folder; its config.json gives the shape
};

// The Hugging Face class-name prefix of a model family ("qwen3" -> "Qwen3": Qwen3DecoderLayer).
std::string hf_class_prefix(const std::string& model_name);

struct TrainingConfig {
  uint64_t seed = 0;
  int64_t max_steps = 100, micro_batch_size = 8, seq_len = 128, eval_every = 0 /* 0 = off */,
          eval_batches = 4, log_every = 1, sample_tokens = 0;
  std::string sample_prompt;
  // Epochs over the training data instead of max_steps (0 = off); a max_steps given too wins.
  double num_epochs = 0;
  DeviceChoice device = DeviceChoice::Auto;
  bool allow_tf32 = false;
  bool activation_checkpointing = false;
  NanPolicy nan_policy = NanPolicy::Stop;
  double loss_scale_init = 65536;  // fp16 dynamic loss scaling
  int64_t loss_scale_window = 1000;
  std::string output_dir = "out";
  ProgressMode progress = ProgressMode::Auto;
};

struct OptimizerConfig {
  OptimizerName name = OptimizerName::AdamW;
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, momentum = 0.9,
         grad_clip = 1.0 /* 0 = off */;
  LrScheduleKind lr_schedule = LrScheduleKind::Cosine;
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.1;
  // The dtype AdamW's exp_avg / exp_avg_sq (SGD's momentum buffer) are stored in; the update
  // math is fp32 either way (bf16: loaded, updated in fp32, rounded to nearest even).
  StateDType state_dtype = StateDType::Fp32;
};

struct DataConfig {
  DataSource source = DataSource::Text;
  std::vector<std::string> text_files;
  std::string train_path, eval_path;
  std::string tokenizer = "byte";  // "byte" or a path to a tokenizer.json
  double eval_fraction = 0.05;
  bool shuffle = true;
  // source jsonl (docs/data.md): files or patterns, .jsonl / .jsonl.gz / .jsonl.zst.
  std::vector<std::string> jsonl_files;
  DataFormat format = DataFormat::Auto;
  std::string text_field = "text";
  ChatTemplateChoice chat_template = ChatTemplateChoice::Auto;
  // Documents (JSONL, or document shards): packed into seq_len rows, or one per row padded.
  bool packing = true;
  bool reset_position_ids = true;  // packing: positions restart at 0 in each document
  int64_t pad_to_multiple_of = 0;  // no packing: rows padded to the longest (0) or a multiple
  OverlongPolicy overlong = OverlongPolicy::Truncate;
};

struct CheckpointConfig {
  int64_t every_steps = 0;  // 0 = only at the end
  int64_t keep_last = 3;    // 0 = keep all
  bool save_optimizer = true;
  bool at_end = true;
  bool async = false;  // write in the background while training goes on
};

struct LoggingConfig {
  std::string metrics_file = "metrics.jsonl";
  bool tensorboard = true;  // event files in <output_dir>/tb/
};

// Our `distributed:` section.
struct DistributedConfig {
  CommBackend backend = CommBackend::Auto;
  double timeout_s = 300;
  double ddp_bucket_cap_mb = 25;
  bool find_unused_parameters = false;
  // Expert parallelism: a mixture-of-experts model's experts split over this many consecutive
  // ranks (parallel/expert_parallel.h); 1 = every rank holds every expert.
  int64_t expert_parallel_size = 1;
};

// The model section's number of experts (num_experts, qwen3_moe; num_local_experts, mixtral), or
// 0 for a dense model.
int64_t model_num_experts(const ModelConfig& m);

// Accelerate's fsdp_config. FSDP1-only keys are accepted and kept in Config::inert.
struct FsdpConfig {
  int fsdp_version = 2;
  bool fsdp_reshard_after_forward = true, fsdp_offload_params = false,
       fsdp_activation_checkpointing = false, fsdp_cpu_ram_efficient_loading = false;
  FsdpWrapPolicy fsdp_auto_wrap_policy = FsdpWrapPolicy::TransformerBased;
  std::string fsdp_transformer_layer_cls_to_wrap = "LlamaDecoderLayer";
  FsdpStateDictType fsdp_state_dict_type = FsdpStateDictType::Sharded;
  int64_t fsdp_min_num_params = 100000000;
  bool present = false;  // any fsdp_config key was given
};

// Accelerate's deepspeed_config. gradient_clipping and gradient_accumulation_steps mirror
// optimizer.grad_clip and the top-level gradient_accumulation_steps (the loader keeps them equal).
struct DeepSpeedConfig {
  int zero_stage = 2;
  OffloadDevice offload_optimizer_device = OffloadDevice::None;
  OffloadDevice offload_param_device = OffloadDevice::None;  // ZeRO-3 only
  double gradient_clipping = 1.0;
  int64_t gradient_accumulation_steps = 1;
  bool zero3_save_16bit_model = false;
  std::string deepspeed_config_file;  // a DeepSpeed JSON whose known keys were applied
  bool present = false;               // any deepspeed_config key was given
};

// Accelerate's fp8_config (TransformerEngine-style delayed scaling, torchao-style dynamic).
struct Fp8Config {
  Fp8Backend backend = Fp8Backend::TE;
  Fp8Format fp8_format = Fp8Format::Hybrid;
  Fp8RecipeName recipe_name = Fp8RecipeName::Tensorwise;  // AO only
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::MostRecent;
  int64_t amax_history_len = 1024, margin = 0, interval = 1;
  // YAML: override_linear_precision: [fprop, dgrad, wgrad]; true runs that GEMM in bf16.
  bool override_linear_precision_fprop = false, override_linear_precision_dgrad = false,
       override_linear_precision_wgrad = false;
  bool use_autocast_during_eval = false, use_mxfp8_block_scaling = false, pad_inner_dim = false,
       enable_fsdp_float8_all_gather = false;
  std::vector<std::string> exclude_modules;  // name patterns kept in bf16 (AO)
  bool present = false;                      // any fp8_config key was given
};

struct Config {
  // Accelerate's top-level keys.
  std::string compute_environment = "LOCAL_MACHINE";
  DistributedType distributed_type = DistributedType::No;
  MixedPrecision mixed_precision = MixedPrecision::No;
  int64_t num_processes = 1, num_machines = 1, machine_rank = 0, gradient_accumulation_steps = 1;
  std::string main_process_ip = "127.0.0.1";
  int main_process_port = 29500;
  bool use_cpu = false;          // true forces training.device = cpu
  std::string gpu_ids = "all";   // "all" or a comma list; see gpu_id_list
  std::vector<int> gpu_id_list;  // parsed gpu_ids (empty = all): local rank r uses gpu_id_list[r]

  ModelConfig model;
  TrainingConfig training;
  OptimizerConfig optimizer;
  DataConfig data;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  DistributedConfig distributed;
  FsdpConfig fsdp;
  DeepSpeedConfig deepspeed;
  Fp8Config fp8;

  // Accelerate keys accepted without effect, by dotted path, as YAML flow text (kept so that
  // config_to_yaml writes them back).
  std::map<std::string, std::string> inert;
  // "key X=value has no effect in accel-train (why)" and similar; the trainer prints them.
  std::vector<std::string> notices;
  std::string source_path;  // the --config file ("" when none)
  // Where each key that is not at its default was set: "file.yaml:12", "environment variable
  // ACCEL_X", "--set a.b=c".
  std::map<std::string, std::string> origins;
};

// Built-in defaults (already validated).
Config default_config();

// defaults < `path` (and the files it extends) < env (ACCEL_<SECTION>__<KEY>, see docs/config.md)
// < set_overrides ("a.b=c"). `path` may be empty (no file). Pass environment_variables() as env
// in tools; tests pass a map. Throws ConfigError.
// `training_args_path`, when given, is a Hugging Face TrainingArguments JSON (accel-train
// --training-args) applied together with `path`'s own keys (see runtime/training_args.h).
Config load_config(const std::string& path, const std::vector<std::string>& set_overrides = {},
                   const std::map<std::string, std::string>& env = {},
                   const std::string& training_args_path = "");

// The process environment as a map (for load_config).
std::map<std::string, std::string> environment_variables();

// The effective configuration as YAML: every key with its resolved value, plus the inert
// Accelerate keys. load_config() on the result gives the same configuration back.
std::string config_to_yaml(const Config& c);

// Re-checks a Config changed in code (cross-key rules only; the same checks load_config runs).
// Throws ConfigError.
void validate_config(const Config& c);

// Every key the loader knows, for documentation and `--help`-style listings.
struct ConfigKeyInfo {
  std::string path;           // "training.max_steps"
  std::string type;           // "integer", "boolean", "one of: stop, skip", ...
  std::string default_value;  // as YAML text
  std::string doc;
  bool accelerate = false;  // defined by Accelerate
  bool inert = false;       // accepted but without effect
  bool alias = false;       // another spelling of a key listed elsewhere
};
std::vector<ConfigKeyInfo> config_keys();

// The per-section key tables of docs/config.md, generated from config_keys().
std::string config_reference_markdown();

// Edit distance used for "did you mean" suggestions (insertions, deletions, substitutions and
// adjacent transpositions each cost one).
size_t config_edit_distance(const std::string& a, const std::string& b);

}  // namespace accel
