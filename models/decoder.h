// The decoder-only transformer of the Hugging Face Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE and
// Mixtral families (LlamaForCausalLM, Qwen2ForCausalLM, ...) in C++: one decoder whose options are
// the families' differences (mixture-of-experts MLPs included), with the same parameter names and
// module class names, loadable from and savable to a Hugging Face model folder.
#pragma once

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/rope_scaling.h"
#include "ops/ops.h"
#include "parallel/expert_parallel.h"
#include "runtime/config.h"
#include "runtime/module.h"

namespace accel {

// The Hugging Face families one decoder covers, by config.json's model_type.
const char* const kModelTypes[] = {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"};

struct DecoderConfig {
  std::string model_type = "llama";  // one of kModelTypes
  int64_t hidden_size = 256;
  int64_t intermediate_size = 688;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 64;  // hidden_size / num_attention_heads unless set
  int64_t vocab_size = 256;
  int64_t max_position_embeddings = 2048;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;  // rope_type default: none
  double rms_norm_eps = 1e-5;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  // Llama / Qwen3: biases on q, k, v and o_proj. Qwen2 always has q/k/v biases (never o_proj's).
  bool attention_bias = false;
  // Sliding-window attention: `sliding_window` keys (the query's own included) in the layers
  // that use it. Mistral: every layer (0 = none). Qwen2 / Qwen3: with use_sliding_window, the
  // layers from max_window_layers on. `layer_types` (transformers 5: "full_attention" or
  // "sliding_attention" per layer), when given, says which layers instead.
  int64_t sliding_window = 0;
  bool use_sliding_window = false;
  int64_t max_window_layers = 0;
  std::vector<std::string> layer_types;
  // Mixture of experts (qwen3_moe, mixtral). A sparse layer's MLP is a router (gate: hidden ->
  // num_experts, softmax in fp32, top num_experts_per_tok) over num_experts SwiGLU experts of
  // width expert_intermediate_size(). Qwen3-MoE: layer i is sparse when (i + 1) %
  // decoder_sparse_step == 0 and i is not in mlp_only_layers; dense layers keep
  // intermediate_size. Mixtral: every layer sparse, experts of width intermediate_size.
  int64_t num_experts = 0;  // 0: a dense family
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;  // qwen3_moe
  bool norm_topk_prob = false;        // qwen3_moe (mixtral always renormalizes)
  int64_t decoder_sparse_step = 1;    // qwen3_moe
  std::vector<int64_t> mlp_only_layers;
  // The loss adds router_aux_loss_coef x the load-balancing loss when output_router_logits is
  // set, as transformers' *ForCausalLM does.
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;

  bool qkv_bias() const { return model_type == "qwen2" || attention_bias; }
  bool o_proj_bias() const { return model_type != "qwen2" && attention_bias; }
  // Per-head RMSNorm of q and k.
  bool qk_norm() const { return model_type == "qwen3" || model_type == "qwen3_moe"; }
  bool is_moe() const { return model_type == "qwen3_moe" || model_type == "mixtral"; }
  bool layer_is_sparse(int64_t i) const;
  int64_t num_sparse_layers() const;
  int64_t expert_intermediate_size() const {
    return model_type == "mixtral" ? intermediate_size : moe_intermediate_size;
  }
  bool renormalizes_topk() const { return model_type == "mixtral" || norm_topk_prob; }
  // Where a sparse layer's block sits: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral), the
  // checkpoints' tensor names.
  const char* sparse_block_name() const {
    return model_type == "mixtral" ? "block_sparse_moe" : "mlp";
  }
  // The attention window of layer i: 0 = full causal attention.
  int64_t layer_window(int64_t i) const;
  // The family's Hugging Face class name for `suffix` ("DecoderLayer" -> "Qwen3DecoderLayer").
  std::string hf_class(const std::string& suffix) const;
  // Whether sequences may run past max_position_embeddings (dynamic RoPE scaling is made for it).
  bool extends_past_max_positions() const { return rope_scaling.rope_type == "dynamic"; }

  // Throws std::invalid_argument naming the field when the shape is impossible, including sizes
  // whose products (parameter shapes, the parameter count) overflow, or an option the family
  // does not have.
  void validate() const;
  // Throws std::invalid_argument when one micro-batch's activations would hold more elements than
  // a tensor can (micro_batch_size x seq_len x the widest layer).
  void check_batch(int64_t micro_batch_size, int64_t seq_len) const;
  int64_t num_parameters() const;  // every parameter; -1 when the count overflows int64
  // The parameters one token computes with: a sparse layer counts its router and
  // num_experts_per_tok of its experts (all parameters for a dense model).
  int64_t num_active_parameters() const;
  // Training FLOPs per token: 6 * (active non-embedding params + lm_head) + attention
  // 12 * layers * seq * hidden (causal attention counted as the full matrix, like nanoGPT/PaLM).
  double flops_per_token(int64_t seq_len) const;
};

// The decoder described by the YAML's model section (model.name and the Hugging Face fields);
// throws std::invalid_argument naming the model.* key on an impossible shape.
DecoderConfig decoder_config(const ModelConfig& m);
// The model section that describes `c` (the inverse of decoder_config, for the effective config
// of model.init_from).
ModelConfig model_section(const DecoderConfig& c);

// Reads a Hugging Face config.json of a family in kModelTypes (rope theta and scaling in either
// spelling: transformers 5's `rope_parameters`, or `rope_theta` + `rope_scaling`). An unsupported
// model_type or option (longrope, mlp_bias, a hidden_act other than silu, ...) is refused naming
// the key, never loaded as something else. Throws naming the file and the field on bad input.
DecoderConfig read_hf_model_config(const std::string& path);
// Writes the family's config.json layout: model_type, architectures, its fields, and RoPE in
// both spellings (rope_theta + rope_scaling for transformers 4.x, rope_parameters for 5.x).
nlohmann::json hf_model_config_json(const DecoderConfig& c,
                                    const std::string& torch_dtype = "float32");
void write_hf_model_config(const DecoderConfig& c, const std::string& path,
                           const std::string& torch_dtype = "float32");

class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, DType dtype, Device device, bool bias = false);
  std::string type_name() const override { return "Linear"; }
  // residual + x @ weight^T (+ bias): a residual connection around the projection, summed in its
  // GEMM where the linear op can (ops.h) and added after linear_fn otherwise.
  Tensor forward(const Tensor& x, const Tensor& residual = Tensor());
  Parameter& weight;
  Parameter* bias = nullptr;  // [out], added after linear_fn when present
  // When set, forward computes linear_fn(x, weight) instead of linear(x, weight): a conversion
  // of the layer installs one (models/fp8_linear.h).
  std::function<Tensor(const Tensor& x, const Tensor& weight)> linear_fn;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim, DType dtype, Device device);
  std::string type_name() const override { return "Embedding"; }
  Tensor forward(const Tensor& ids);
  Parameter& weight;
};

class RMSNorm : public Module {
 public:
  RMSNorm(int64_t dim, double eps, DType dtype, Device device, std::string type_name);
  std::string type_name() const override { return type_name_; }
  Tensor forward(const Tensor& x);
  // {x + r, forward(x + r)} in one fused op (add_rms_norm), with this module's hooks around it.
  std::pair<Tensor, Tensor> add_forward(const Tensor& x, const Tensor& r);
  Parameter& weight;
  double eps;

 private:
  std::string type_name_;
};

// The keys and values of the positions generated so far, per layer (generation; no autograd).
struct KVCache {
  struct Layer {
    Tensor k, v;  // [B, T, Hkv, D] after RoPE; undefined while empty
    int64_t length() const { return k.defined() ? k.size(1) : 0; }
  };
  std::vector<Layer> layers;
  int64_t length() const { return layers.empty() ? 0 : layers[0].length(); }
};

// Where the tokens of a batch sit when several documents are packed into one row. Both fields
// are optional (undefined: one document per row, positions 0 .. S-1).
struct TokenLayout {
  Tensor position_ids;  // [B, S] integer: each document's positions, restarting at 0
  Tensor segment_ids;   // [B, S] int32: a token attends only to tokens of its own segment
};

class SelfAttention : public Module {
 public:
  // `window`: this layer's sliding window (0 = none; DecoderConfig::layer_window).
  // `dynamic_rope`: rope_type dynamic's frequency state, shared by every layer of the model
  // (CausalLM owns it; null for the other types).
  SelfAttention(const DecoderConfig& c, int64_t window, DType dtype, Device device,
                DynamicRope* dynamic_rope);
  std::string type_name() const override { return config.hf_class("Attention"); }
  // [B, S, hidden] -> [B, S, hidden]. With a cache, x holds the positions after the cached ones
  // (all of a prompt into an empty cache, then one token at a time), and k/v are appended to it.
  Tensor forward(const Tensor& x, KVCache::Layer* cache = nullptr, const TokenLayout& layout = {});
  Linear &q_proj, &k_proj, &v_proj, &o_proj;
  RMSNorm *q_norm = nullptr, *k_norm = nullptr;  // Qwen3: over each head's head_dim, before RoPE
  const int64_t window;
  // When set, the projections that read x together run inside shared_input(x, run): a
  // conversion of the linear layers may share work on their common input (models/fp8_linear.h
  // casts x once for all of them).
  std::function<void(const Tensor& x, const std::function<void()>& run)> shared_input;
  const DecoderConfig config;
  // rope_type dynamic: the frequencies the model carries from one forward to the next
  // (transformers' max_seq_len_cached rule, models/rope_scaling.h); null for the other types.
  DynamicRope* dynamic_rope() { return dynamic_rope_; }
  const DynamicRope* dynamic_rope() const { return dynamic_rope_; }

 private:
  RopeFrequencies rope_;             // from the config (every type but dynamic)
  DynamicRope* const dynamic_rope_;  // the model's (CausalLM), or null
};

class GatedMLP : public Module {
 public:
  GatedMLP(const DecoderConfig& c, DType dtype, Device device);
  // An MLP of another width, its projections registered under `names` (gate, up, down; Mixtral's
  // experts: w1, w3, w2) with class name `type_name`: the experts of a sparse block.
  GatedMLP(const DecoderConfig& c, int64_t intermediate_size, DType dtype, Device device,
           const std::array<const char*, 3>& names, std::string type_name);
  std::string type_name() const override { return type_name_; }
  // residual + down(swiglu(gate(x), up(x))): the decoder layer's residual connection rides on the
  // down projection (its GEMM's addend where the projection can take one).
  Tensor forward(const Tensor& x, const Tensor& residual = Tensor());
  Linear &gate_proj, &up_proj, &down_proj;
  // When set, forward first tries fused_fn(x, residual) (residual possibly undefined); an
  // undefined result means the projections run one by one. A conversion of the layers installs
  // one (fp8_swiglu_mlp, models/fp8_linear.h).
  std::function<Tensor(const Tensor& x, const Tensor& residual)> fused_fn;
  // When set, the projections that read x together run inside shared_input(x, run): a
  // conversion of the linear layers may share work on their common input (models/fp8_linear.h
  // casts x once for all of them).
  std::function<void(const Tensor& x, const std::function<void()>& run)> shared_input;

 private:
  std::string type_name_;
};

class ModuleList : public Module {
 public:
  std::string type_name() const override { return "ModuleList"; }
  template <class M>
  M& append(std::unique_ptr<M> m) {
    return register_module(std::to_string(size_++), std::move(m));
  }
  // Under another index than the next one (an expert-parallel rank's experts keep their global
  // index).
  template <class M>
  M& append_as(int64_t index, std::unique_ptr<M> m) {
    ++size_;
    return register_module(std::to_string(index), std::move(m));
  }

 private:
  int64_t size_ = 0;
};

// What the load-balancing loss needs from one sparse layer's forward.
struct RouterStats {
  std::vector<int64_t> expert_counts;  // [num_experts] routed slots per expert (constants)
  Tensor prob_sum;  // [num_experts] (fp32; f64 models f64): router probabilities summed over tokens
  int64_t tokens = 0;
};

// A mixture-of-experts MLP (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock): the router `gate`
// and `experts`, run as grouped GEMMs over the tokens sorted by expert.
//
// Expert parallelism (`ep` with ep_size > 1): the block holds only experts [ep->expert_begin,
// ep->expert_end), registered under their global index (experts.<e>), and every forward sends
// each routed row to its expert's owner and back by all_to_all_rows over ep->ep_group (a
// collective: every rank of the EP group runs every forward and backward of every sparse block).
// The router runs on this rank's own tokens, as without expert parallelism.
class SparseMoeBlock : public Module {
 public:
  SparseMoeBlock(const DecoderConfig& c, DType dtype, Device device,
                 const ExpertParallelContext* ep = nullptr);
  std::string type_name() const override { return config.hf_class("SparseMoeBlock"); }
  // [B, S, hidden] -> [B, S, hidden]; `stats`, when given, receives the routing of this forward.
  Tensor forward(const Tensor& x, RouterStats* stats = nullptr);
  Linear& gate;  // [num_experts, hidden], no bias
  ModuleList& experts_list;
  std::vector<GatedMLP*> experts;  // the held experts: global index expert_begin() + position
  const DecoderConfig config;
  int64_t expert_begin() const { return ep_ ? ep_->expert_begin : 0; }
  bool expert_parallel() const { return ep_ != nullptr; }
  // The module names of an expert's projections, gate, up, down: Qwen3-MoE's experts are
  // Qwen3MoeMLPs (gate_proj, up_proj, down_proj), Mixtral's MixtralBlockSparseTop2MLPs (w1, w3,
  // w2).
  std::array<const char*, 3> projection_names() const;
  // When set, the experts' projections run as experts_linear_fn(x, weights, rows, projection)
  // instead of grouped_linear(x, weights, rows): weights are the held experts' of that
  // projection (0 gate, 1 up, 2 down), rows their row counts. A conversion of the experts
  // installs one (fp8 training: fp8_grouped_linear, models/fp8_linear.h).
  std::function<Tensor(const Tensor& x, const std::vector<Tensor>& weights,
                       const std::vector<int64_t>& rows, int projection)>
      experts_linear_fn;

 private:
  // The experts' SwiGLU over rows grouped by local expert (`rows[j]` rows for experts[j]).
  Tensor run_experts(const Tensor& xs, const std::vector<int64_t>& rows);
  std::shared_ptr<const ExpertParallelContext> ep_;  // null: every expert here
};

class DecoderLayer : public Module {
 public:
  DecoderLayer(const DecoderConfig& c, int64_t layer_index, DType dtype, Device device,
               DynamicRope* dynamic_rope, const ExpertParallelContext* ep = nullptr);
  std::string type_name() const override { return type_name_; }
  // `router_stats` receives a sparse layer's routing (ignored by dense layers).
  Tensor forward(const Tensor& x, KVCache::Layer* cache = nullptr, const TokenLayout& layout = {},
                 RouterStats* router_stats = nullptr);
  SelfAttention& self_attn;
  GatedMLP* mlp = nullptr;        // a dense layer's MLP
  SparseMoeBlock* moe = nullptr;  // a sparse layer's (config.layer_is_sparse)
  RMSNorm &input_layernorm, &post_attention_layernorm;

 private:
  std::string type_name_;
};

class DecoderModel : public Module {
 public:
  DecoderModel(const DecoderConfig& c, DType dtype, Device device, DynamicRope* dynamic_rope,
               const ExpertParallelContext* ep = nullptr);
  std::string type_name() const override { return type_name_; }
  Embedding& embed_tokens;
  ModuleList& layers_list;
  std::vector<DecoderLayer*> layers;
  RMSNorm& norm;

 private:
  std::string type_name_;
};

class CausalLM : public Module {
 public:
  // Parameters are created with dtype on device and initialized like Hugging Face does
  // (normal(0, initializer_range) for linear and embedding weights, ones for norms, zeros for
  // biases), from `seed`. With `ep` (expert parallelism, ep_size > 1; see SparseMoeBlock) the
  // sparse blocks hold only this rank's experts, and each parameter, experts included (by
  // global index), gets the values it has in the model with every expert: an expert-parallel
  // run starts where the single-process run starts.
  CausalLM(const DecoderConfig& c, DType dtype, Device device, uint64_t seed,
           const ExpertParallelContext* ep = nullptr);
  std::string type_name() const override { return config.hf_class("ForCausalLM"); }

  // ids [B, S] -> logits [B, S, vocab]. With a cache (generation), ids are the positions after
  // the cached ones; the cache is sized on first use. `layout` describes packed rows (training).
  Tensor forward(const Tensor& ids, KVCache* cache = nullptr, const TokenLayout& layout = {});
  // loss(forward(ids, nullptr, layout), targets) without the [B, S, vocab] logits: the LM head's
  // GEMMs and the cross-entropy run fused over row chunks (linear_cross_entropy; a converted head
  // its head_loss_fn, e.g. fp8), which saves two B x S x vocab tensors (4 GiB in bf16 at 8k tokens
  // and a 128k vocabulary). A head converted without a head_loss_fn (linear_fn or tied_head_fn
  // only) computes its logits and then the plain loss. grad_scale: the factor the caller
  // backpropagates this loss with (the trainer's loss scale and micro-batch weight, as the seed of
  // backward_with_seed): the fused head makes its gradients in forward, exactly as the unfused
  // head would for that factor, and takes them as made when the seed is that number
  // (linear_cross_entropy).
  Tensor forward_loss(const Tensor& ids, const Tensor& targets, const TokenLayout& layout = {},
                      double grad_scale = 1.0);
  // Mean next-token cross-entropy of logits [B, S, V] against targets [B, S] (already aligned:
  // targets[b, t] is the token after ids[b, t]; -100 is ignored).
  static Tensor loss(const Tensor& logits, const Tensor& targets);
  // The router's load-balancing loss of the latest forward (transformers'
  // load_balancing_loss_func without an attention mask, over every sparse layer's tokens);
  // undefined for a dense model or before a forward.
  Tensor router_aux_loss() const;
  // lm_loss + router_aux_loss_coef * router_aux_loss() when output_router_logits is set (as
  // transformers' loss), else lm_loss. forward_loss adds it itself; callers of loss() add it here.
  Tensor add_router_aux_loss(const Tensor& lm_loss) const;
  // Routed slots per expert of every layer in the latest forward ([layer][expert]; empty rows
  // for dense layers).
  std::vector<std::vector<int64_t>> expert_counts() const;
  // rope_type dynamic: transformers' max_seq_len_cached after the latest forward
  // (max_position_embeddings before the first longer forward), -1 for the other rope types.
  // restore_dynamic_rope puts the state there (checkpoints).
  int64_t dynamic_rope_max_seq_len_cached() const;
  void restore_dynamic_rope(int64_t max_seq_len_cached);
  // What backward recomputes of each decoder layer instead of keeping it (training only: a
  // forward with a KV cache keeps nothing). Full: the whole layer from its input. Selective: the
  // layer keeps its GEMM and attention outputs (checkpoint's CheckpointMode::Selective).
  void set_activation_checkpointing(ActivationCheckpointing mode) { checkpointing_ = mode; }
  // The expert-parallel context the model was built with (null: every expert here).
  const ExpertParallelContext* expert_parallel() const { return ep_.get(); }

  const DecoderConfig config;

 private:
  // rope_type dynamic: the one frequency state every attention layer reads and updates (null
  // for the other types). Declared between config and model: built from the validated config
  // before the layers that point to it.
  std::unique_ptr<DynamicRope> dynamic_rope_;

 public:
  DecoderModel& model;
  Linear* lm_head = nullptr;  // null when tied to model.embed_tokens
  // A tied head's counterpart of Linear::linear_fn: when set, the logits are
  // tied_head_fn(x, model.embed_tokens.weight.value) instead of linear(x, that weight), in forward
  // (and in forward_loss without a head_loss_fn); autograd adds the head's weight gradient into the
  // embedding's. A conversion
  // installs one (fp8 under the TE recipe, models/fp8_linear.h). The tied head has no module and
  // no hooks of its own: under ZeRO-3 / FSDP it reads the embedding weight the root unit gathered
  // (kept from the root's pre-forward to the end of backward), as the bf16 path does.
  std::function<Tensor(const Tensor& x, const Tensor& weight)> tied_head_fn;
  // A converted head's fused loss (tied or not), installed with its linear_fn / tied_head_fn:
  // forward_loss computes head_loss_fn(x, head weight, targets, grad_scale) instead of
  // linear_cross_entropy (fp8: fp8_linear_cross_entropy, models/fp8_linear.h). An untied head's
  // hooks run around it, as around linear_cross_entropy.
  std::function<Tensor(const Tensor& x, const Tensor& weight, const Tensor& targets,
                       double grad_scale)>
      head_loss_fn;

 private:
  // The final norm's output [B, S, hidden] (forward without the LM head).
  Tensor final_hidden(const Tensor& ids, KVCache* cache, const TokenLayout& layout);
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::None;
  std::shared_ptr<const ExpertParallelContext> ep_;
  std::vector<RouterStats> router_stats_;  // per layer, from the latest forward
};

// Hugging Face targets for a causal LM: targets[b, t] = ids[b, t + 1], the last one ignored.
Tensor shift_labels(const Tensor& labels);

// A tensor a weight file offers for a model parameter: the file, the dtype as the file names it
// ("F32", "BF16", "I32", ...) and the shape.
struct OfferedWeight {
  std::string file;
  std::string dtype;
  Shape shape;
};

// The floating-point dtypes a weight file may hold for the fp32 model: F32, and BF16 or F16,
// which are widened exactly. Anything else (integers, fp8 without its scales, F64) is refused
// rather than value-converted.
bool is_loadable_weight_dtype(const std::string& safetensors_dtype);

// Checks the tensors offered for `model`'s parameters before any is loaded: every parameter
// present with its shape and a loadable dtype, and no tensor the model lacks (an lm_head.weight
// beside tied embeddings is accepted when `allow_tied_lm_head`: some Hugging Face folders store
// it). Throws std::runtime_error naming the file and the tensor; `source` names where the tensors
// come from, `advice` ends the message (what to do).
void check_offered_weights(Module& model, const std::map<std::string, OfferedWeight>& offered,
                           const std::string& source, const std::string& advice,
                           bool allow_tied_lm_head);

// Loads weights by Hugging Face name from a folder holding model.safetensors or a sharded
// model.safetensors.index.json, checked first with check_offered_weights (errors name the tensor
// and both shapes, or its dtype). A weight that holds NaN or Inf is refused, naming the tensor.
// A CausalLM built for expert parallelism reads only its own experts from the full folder (the
// other ranks' experts are skipped; its own must all be there).
void load_hf_weights(Module& model, const std::string& dir);
// Writes config.json + model.safetensors (dtype as the parameters) that transformers loads. An
// expert-parallel model is refused (it holds some experts only): save the strategy's
// full_state_dict, which gathers them (the trainer's checkpoints do).
void save_hf_model(Module& model, const DecoderConfig& config, const std::string& dir);

}  // namespace accel
