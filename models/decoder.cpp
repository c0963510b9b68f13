#include "models/decoder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "runtime/json.h"
#include "runtime/safetensors.h"

namespace accel {
namespace fs = std::filesystem;

int64_t DecoderConfig::layer_window(int64_t i) const {
  if (!layer_types.empty())
    return layer_types[static_cast<size_t>(i)] == "sliding_attention" ? sliding_window : 0;
  if (model_type == "mistral" || model_type == "mixtral") return sliding_window;
  if (model_type == "qwen2" || model_type == "qwen3" || model_type == "qwen3_moe")
    return use_sliding_window && i >= max_window_layers ? sliding_window : 0;
  return 0;
}

bool DecoderConfig::layer_is_sparse(int64_t i) const {
  if (!is_moe() || num_experts <= 0) return false;
  if (model_type == "mixtral") return true;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end())
    return false;
  return decoder_sparse_step > 0 && (i + 1) % decoder_sparse_step == 0;
}

int64_t DecoderConfig::num_sparse_layers() const {
  if (!is_moe() || num_experts <= 0 || num_hidden_layers <= 0) return 0;
  if (model_type == "mixtral") return num_hidden_layers;
  if (decoder_sparse_step <= 0) return 0;
  // Counted without a loop over the layers (validate() runs on any num_hidden_layers).
  int64_t n = num_hidden_layers / decoder_sparse_step;
  std::set<int64_t> dense(mlp_only_layers.begin(), mlp_only_layers.end());
  for (int64_t i : dense)
    if (i >= 0 && i < num_hidden_layers && (i + 1) % decoder_sparse_step == 0) --n;
  return n;
}

std::string DecoderConfig::hf_class(const std::string& suffix) const {
  return hf_class_prefix(model_type) + suffix;
}

void DecoderConfig::validate() const {
  const std::string prefix = text_excerpt(model_type) + " config: ";
  auto fail = [&](const std::string& m) { throw std::invalid_argument(prefix + m); };
  if (std::find(std::begin(kModelTypes), std::end(kModelTypes), model_type) ==
      std::end(kModelTypes))
    fail("model_type '" + text_excerpt(model_type) +
         "' is not supported (supported: llama, qwen2, qwen3, mistral, qwen3_moe, mixtral)");
  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0) fail(std::string(key) + " must be positive, got " + std::to_string(v));
  };
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("vocab_size", vocab_size);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("max_position_embeddings", max_position_embeddings);
  if (num_attention_heads % num_key_value_heads != 0)
    fail("num_attention_heads (" + std::to_string(num_attention_heads) +
         ") must be a multiple of num_key_value_heads (" + std::to_string(num_key_value_heads) +
         ")");
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail("head_dim must be positive and even for RoPE, got " + std::to_string(head_dim));
  if (!(std::isfinite(rope_theta) && rope_theta > 0))
    fail("rope_theta must be a positive number, got " + std::to_string(rope_theta));
  validate_rope_scaling(rope_scaling, max_position_embeddings, prefix + "rope_scaling");
  if (rope_scaling.rope_type == "dynamic" && head_dim <= 2)
    fail("rope_type dynamic needs head_dim > 2, got " + std::to_string(head_dim));
  if (!(std::isfinite(rms_norm_eps) && rms_norm_eps > 0))
    fail("rms_norm_eps must be a positive number, got " + std::to_string(rms_norm_eps));
  if (!(std::isfinite(initializer_range) && initializer_range >= 0))
    fail("initializer_range must be a non-negative number, got " +
         std::to_string(initializer_range));
  if (attention_bias &&
      (model_type == "qwen2" || model_type == "mistral" || model_type == "mixtral"))
    fail("attention_bias is not an option of " + model_type +
         (model_type == "qwen2" ? " (its q/k/v projections always have biases, o_proj none)"
                                : " (no biases)"));
  if (sliding_window < 0)
    fail("sliding_window must not be negative, got " + std::to_string(sliding_window));
  if (max_window_layers < 0)
    fail("max_window_layers must not be negative, got " + std::to_string(max_window_layers));
  // Mixture of experts.
  if (!is_moe()) {
    const std::string moe_families = " is an option of qwen3_moe and mixtral, not " + model_type;
    if (num_experts != 0) fail("num_experts" + moe_families);
    if (num_experts_per_tok != 0) fail("num_experts_per_tok" + moe_families);
    if (moe_intermediate_size != 0) fail("moe_intermediate_size" + moe_families);
    if (norm_topk_prob) fail("norm_topk_prob" + moe_families);
    if (decoder_sparse_step != 1) fail("decoder_sparse_step" + moe_families);
    if (!mlp_only_layers.empty()) fail("mlp_only_layers" + moe_families);
    if (output_router_logits) fail("output_router_logits" + moe_families);
    if (router_aux_loss_coef != 0.001) fail("router_aux_loss_coef" + moe_families);
  } else {
    const bool mixtral = model_type == "mixtral";
    positive(mixtral ? "num_local_experts (num_experts)" : "num_experts", num_experts);
    if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts)
      fail("num_experts_per_tok must be in [1, " + std::to_string(num_experts) +
           "] (num_experts), got " + std::to_string(num_experts_per_tok));
    if (mixtral) {
      const std::string why =
          " is not an option of mixtral (every layer is sparse, experts take intermediate_size, "
          "routing weights are always renormalized)";
      if (moe_intermediate_size != 0) fail("moe_intermediate_size" + why);
      if (norm_topk_prob) fail("norm_topk_prob" + why);
      if (decoder_sparse_step != 1) fail("decoder_sparse_step" + why);
      if (!mlp_only_layers.empty()) fail("mlp_only_layers" + why);
    } else {
      positive("moe_intermediate_size", moe_intermediate_size);
      positive("decoder_sparse_step", decoder_sparse_step);
      std::set<int64_t> seen;
      for (int64_t i : mlp_only_layers) {
        if (i < 0 || i >= num_hidden_layers)
          fail("mlp_only_layers: layer " + std::to_string(i) + " is not in [0, " +
               std::to_string(num_hidden_layers) + ") (num_hidden_layers)");
        if (!seen.insert(i).second)
          fail("mlp_only_layers lists layer " + std::to_string(i) + " twice");
      }
    }
    if (!(std::isfinite(router_aux_loss_coef) && router_aux_loss_coef >= 0))
      fail("router_aux_loss_coef must be a non-negative number, got " +
           std::to_string(router_aux_loss_coef));
    if (use_sliding_window)
      fail("use_sliding_window is not supported for " + model_type +
           (mixtral ? " (its sliding_window applies to every layer; 0 = none)"
                    : " (Qwen3-MoE checkpoints attend fully; set it to false)"));
    if (!layer_types.empty()) fail("layer_types is not supported for " + model_type);
  }
  if (model_type == "llama" && (sliding_window || use_sliding_window || !layer_types.empty()))
    fail(
        "llama has no sliding-window attention (sliding_window, use_sliding_window, "
        "layer_types): use mistral, qwen2 or qwen3");
  if (model_type == "mistral" && use_sliding_window)
    fail(
        "use_sliding_window is not an option of mistral: its sliding_window applies to every "
        "layer (0 = none)");
  if (use_sliding_window && sliding_window == 0)
    fail("use_sliding_window needs a positive sliding_window");
  if (!layer_types.empty()) {
    if (static_cast<int64_t>(layer_types.size()) != num_hidden_layers)
      fail("layer_types lists " + std::to_string(layer_types.size()) + " layers, but there are " +
           std::to_string(num_hidden_layers) + " (num_hidden_layers)");
    for (const std::string& t : layer_types) {
      if (t != "full_attention" && t != "sliding_attention")
        fail("layer_types: '" + text_excerpt(t) +
             "' is not a layer type (full_attention or sliding_attention)");
      if (t == "sliding_attention" && sliding_window == 0)
        fail("layer_types has sliding_attention layers but no sliding_window");
    }
  }
  // Every size product the model forms must fit: an overflowed element count allocates too
  // little and is written past its end.
  struct Product {
    const char* what;
    Shape factors;
  };
  const Product products[] = {
      {"vocab_size x hidden_size (model.embed_tokens.weight)", {vocab_size, hidden_size}},
      {"num_attention_heads x head_dim (q_proj outputs)", {num_attention_heads, head_dim}},
      {"num_attention_heads x head_dim x hidden_size (q_proj.weight)",
       {num_attention_heads, head_dim, hidden_size}},
      {"num_key_value_heads x head_dim x hidden_size (k_proj.weight)",
       {num_key_value_heads, head_dim, hidden_size}},
      {"intermediate_size x hidden_size (mlp.gate_proj.weight)", {intermediate_size, hidden_size}},
      {"num_experts x expert width x hidden_size (the experts of a layer)",
       {std::max<int64_t>(num_experts, 1), std::max<int64_t>(expert_intermediate_size(), 1),
        hidden_size}},
      {"max_position_embeddings x head_dim (RoPE tables)", {max_position_embeddings, head_dim}},
  };
  for (const Product& p : products)
    if (checked_numel(p.factors) < 0)
      fail(std::string(p.what) + " = " + shape_str(p.factors) +
           " is more elements than a tensor can hold (2^60); check the sizes");
  if (num_parameters() < 0 || num_active_parameters() < 0)
    fail("the parameter count of " + std::to_string(num_hidden_layers) +
         " layers overflows; check num_hidden_layers and the sizes");
}

void DecoderConfig::check_batch(int64_t micro_batch_size, int64_t seq_len) const {
  // The largest activations of one micro-batch: the logits and the MLP's hidden states.
  for (int64_t width : {vocab_size, intermediate_size, num_attention_heads * head_dim})
    if (checked_numel({micro_batch_size, seq_len, width}) < 0)
      throw std::invalid_argument(
          "training.micro_batch_size " + std::to_string(micro_batch_size) + " x training.seq_len " +
          std::to_string(seq_len) + " x " + std::to_string(width) +
          " (a layer width of the model) is more elements than a tensor can hold (2^60)");
}

namespace {
// The parameter count of `c`: all parameters, or (active) those one token computes with (a
// sparse layer's router and num_experts_per_tok of its experts). -1 when it overflows int64.
int64_t count_parameters(const DecoderConfig& c, bool active) {
  using Wide = __int128;
  // Sizes past 2^40 are no model's; they would overflow even 128-bit products below.
  for (int64_t v : {c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                    c.intermediate_size, c.expert_intermediate_size(), c.num_experts,
                    c.num_experts_per_tok, c.vocab_size})
    if (v > (int64_t{1} << 40) || v < 0) return -1;
  const Wide H = c.hidden_size, D = c.head_dim, Hq = c.num_attention_heads,
             Hkv = c.num_key_value_heads;
  const Wide qkv_out = (Hq + 2 * Hkv) * D;
  const Wide extra =
      (c.qkv_bias() ? qkv_out : 0) + (c.o_proj_bias() ? H : 0) + (c.qk_norm() ? 2 * D : 0);
  const Wide attn = H * D * 2 * (Hq + Hkv);
  const Wide dense_mlp = 3 * H * Wide(c.intermediate_size);
  const Wide experts_used = active ? c.num_experts_per_tok : c.num_experts;
  const Wide sparse_mlp =
      Wide(c.num_experts) * H + experts_used * 3 * H * Wide(c.expert_intermediate_size());
  const Wide sparse_layers = c.num_sparse_layers(),
             dense_layers = c.num_hidden_layers - sparse_layers;
  const Wide n = H + Wide(c.vocab_size) * H * (c.tie_word_embeddings ? 1 : 2) +
                 dense_layers * (attn + extra + 2 * H + dense_mlp) +
                 sparse_layers * (attn + extra + 2 * H + sparse_mlp);
  return n > std::numeric_limits<int64_t>::max() || n < 0 ? -1 : static_cast<int64_t>(n);
}
}  // namespace

int64_t DecoderConfig::num_parameters() const { return count_parameters(*this, false); }

int64_t DecoderConfig::num_active_parameters() const { return count_parameters(*this, true); }

double DecoderConfig::flops_per_token(int64_t seq_len) const {
  // Same formula as the PyTorch reference (tools/reference/llama_shapes.py; docs/algorithms.md).
  // Active parameters: a token runs through its experts only (the MFU of a mixture of experts).
  double matmul_params = static_cast<double>(num_active_parameters() - vocab_size * hidden_size);
  if (tie_word_embeddings) matmul_params += static_cast<double>(vocab_size * hidden_size);
  return 6.0 * matmul_params +
         12.0 * static_cast<double>(num_hidden_layers * seq_len * hidden_size);
}

DecoderConfig decoder_config(const ModelConfig& m) {
  if (m.hidden_act != "silu")
    throw std::invalid_argument("model.hidden_act '" + text_excerpt(m.hidden_act) +
                                "' is not supported (only silu)");
  if (m.mlp_bias) throw std::invalid_argument("model.mlp_bias true is not supported");
  if (m.attention_dropout != 0)
    throw std::invalid_argument("model.attention_dropout must be 0 (no dropout in accel-train)");
  DecoderConfig c;
  c.model_type = m.name;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_hidden_layers = m.num_hidden_layers;
  c.num_attention_heads = m.num_attention_heads;
  c.num_key_value_heads = m.num_key_value_heads ? m.num_key_value_heads : m.num_attention_heads;
  c.head_dim = m.head_dim ? m.head_dim : m.hidden_size / m.num_attention_heads;
  c.vocab_size = m.vocab_size;
  c.max_position_embeddings = m.max_position_embeddings;
  c.rope_theta = m.rope_theta;
  c.rope_scaling = m.rope_scaling;
  c.rms_norm_eps = m.rms_norm_eps;
  c.initializer_range = m.initializer_range;
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.attention_bias = m.attention_bias;
  c.sliding_window = m.sliding_window;
  c.use_sliding_window = m.use_sliding_window;
  c.max_window_layers = m.max_window_layers;
  c.layer_types = m.layer_types;
  c.num_experts = m.num_experts;
  c.num_experts_per_tok = m.num_experts_per_tok;
  c.moe_intermediate_size = m.moe_intermediate_size;
  c.norm_topk_prob = m.norm_topk_prob;
  c.decoder_sparse_step = m.decoder_sparse_step;
  c.mlp_only_layers = m.mlp_only_layers;
  c.router_aux_loss_coef = m.router_aux_loss_coef;
  c.output_router_logits = m.output_router_logits;
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("model: ") + e.what());
  }
  return c;
}

ModelConfig model_section(const DecoderConfig& c) {
  ModelConfig m;
  m.name = c.model_type;
  m.hidden_size = c.hidden_size;
  m.intermediate_size = c.intermediate_size;
  m.num_hidden_layers = c.num_hidden_layers;
  m.num_attention_heads = c.num_attention_heads;
  m.num_key_value_heads = c.num_key_value_heads;
  m.head_dim = c.head_dim;
  m.vocab_size = c.vocab_size;
  m.max_position_embeddings = c.max_position_embeddings;
  m.rope_theta = c.rope_theta;
  m.rope_scaling = c.rope_scaling;
  m.rms_norm_eps = c.rms_norm_eps;
  m.initializer_range = c.initializer_range;
  m.tie_word_embeddings = c.tie_word_embeddings;
  m.attention_bias = c.attention_bias;
  m.sliding_window = c.sliding_window;
  m.use_sliding_window = c.use_sliding_window;
  m.max_window_layers = c.max_window_layers;
  m.layer_types = c.layer_types;
  m.num_experts = c.num_experts;
  m.num_experts_per_tok = c.num_experts_per_tok;
  m.moe_intermediate_size = c.moe_intermediate_size;
  m.norm_topk_prob = c.norm_topk_prob;
  m.decoder_sparse_step = c.decoder_sparse_step;
  m.mlp_only_layers = c.mlp_only_layers;
  m.router_aux_loss_coef = c.router_aux_loss_coef;
  m.output_router_logits = c.output_router_logits;
  return m;
}

DecoderConfig read_hf_model_config(const std::string& path) {
  nlohmann::json j;
  try {
    j = read_json_file(path);
  } catch (const JsonError& e) {
    throw std::runtime_error(std::string(e.what()) + " (a Hugging Face config.json)");
  }
  if (!j.is_object()) throw std::runtime_error(path + ": config.json must hold a JSON object");
  // Every field is checked before it is used (head_dim divides by num_attention_heads).
  auto integer = [&](const char* key) -> int64_t {
    const nlohmann::json& v = j[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX))
      throw std::invalid_argument(path + ": field '" + key + "' must be an integer, got " +
                                  json_excerpt(v));
    return v.get<int64_t>();
  };
  auto need = [&](const char* key) -> int64_t {
    if (!j.contains(key)) throw std::runtime_error(path + ": missing required field '" + key + "'");
    return integer(key);
  };
  auto given = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  auto flag = [&](const char* key) {
    if (!given(key)) return false;
    if (!j[key].is_boolean())
      throw std::invalid_argument(path + ": field '" + key + "' must be true or false, got " +
                                  json_excerpt(j[key]));
    return j[key].get<bool>();
  };
  auto refuse = [&](const std::string& key, const std::string& why) {
    throw std::invalid_argument(path + ": " + key + " " + json_excerpt(j[key]) + " " + why);
  };
  try {
    DecoderConfig c;
    if (given("model_type")) {
      if (!j["model_type"].is_string()) refuse("model_type", "must be a string");
      c.model_type = j["model_type"].get<std::string>();
      if (std::find(std::begin(kModelTypes), std::end(kModelTypes), c.model_type) ==
          std::end(kModelTypes))
        refuse("model_type",
               "is not supported (supported: \"llama\", \"qwen2\", \"qwen3\", \"mistral\", "
               "\"qwen3_moe\", \"mixtral\")");
    }
    const std::string& type = c.model_type;
    // Options these families do not compute: refused rather than loaded as something else.
    if (given("hidden_act") && j["hidden_act"] != "silu")
      refuse("hidden_act", "is not supported (only \"silu\")");
    if (flag("mlp_bias")) refuse("mlp_bias", "is not supported (MLP projections without biases)");
    for (const char* key : {"qk_layernorm", "use_qk_norm", "qk_norm"})
      if (flag(key))
        refuse(key, "is not supported for " + type +
                        " (per-head q/k RMSNorm is Qwen3's, model_type qwen3)");
    if (given("partial_rotary_factor") && j["partial_rotary_factor"] != 1.0)
      refuse("partial_rotary_factor", "is not supported (RoPE over the whole head only)");
    if (given("attention_dropout") &&
        (!j["attention_dropout"].is_number() || j["attention_dropout"].get<double>() != 0.0))
      refuse("attention_dropout", "is not supported (accel-train has no dropout; set it to 0)");
    if (flag("attention_bias")) {
      if (type == "mistral" || type == "mixtral")
        refuse("attention_bias", "is not supported for " + type);
      // Qwen2's class ignores the field: q/k/v always have biases there.
      if (type != "qwen2") c.attention_bias = true;
    }

    c.hidden_size = need("hidden_size");
    c.intermediate_size = need("intermediate_size");
    c.num_hidden_layers = need("num_hidden_layers");
    c.num_attention_heads = need("num_attention_heads");
    c.num_key_value_heads =
        given("num_key_value_heads") ? integer("num_key_value_heads") : c.num_attention_heads;
    c.vocab_size = need("vocab_size");
    if (given("head_dim"))
      c.head_dim = integer("head_dim");
    else
      c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
    c.max_position_embeddings =
        given("max_position_embeddings") ? integer("max_position_embeddings") : 2048;
    c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
    c.initializer_range = j.value("initializer_range", 0.02);
    c.tie_word_embeddings = flag("tie_word_embeddings");

    // RoPE: transformers 5's rope_parameters (theta inside), or rope_theta + rope_scaling. Files
    // written for both (ours) carry both spellings, which must agree.
    bool theta_given = false;
    if (given("rope_theta")) {
      if (!j["rope_theta"].is_number()) refuse("rope_theta", "must be a number");
      c.rope_theta = j["rope_theta"].get<double>();
      theta_given = true;
    }
    if (given("rope_parameters")) {
      double theta = c.rope_theta;
      c.rope_scaling = parse_rope_scaling(j["rope_parameters"], path + ": rope_parameters", &theta);
      if (theta_given && j["rope_parameters"].contains("rope_theta") && theta != c.rope_theta)
        throw std::invalid_argument(path + ": rope_theta " + json_excerpt(j["rope_theta"]) +
                                    " and rope_parameters.rope_theta " +
                                    json_excerpt(j["rope_parameters"]["rope_theta"]) + " disagree");
      c.rope_theta = theta;
    }
    if (given("rope_scaling")) {
      RopeScaling legacy = parse_rope_scaling(j["rope_scaling"], path + ": rope_scaling", nullptr);
      if (given("rope_parameters") && legacy != c.rope_scaling)
        throw std::invalid_argument(path + ": rope_scaling " + json_excerpt(j["rope_scaling"]) +
                                    " and rope_parameters " + json_excerpt(j["rope_parameters"]) +
                                    " disagree");
      c.rope_scaling = legacy;
    }

    // Mixture of experts: the keys of Qwen3MoeConfig and MixtralConfig (absent ones take their
    // defaults), and refusals of what is not computed here.
    auto number = [&](const char* key) {
      if (!j[key].is_number()) refuse(key, "must be a number");
      return j[key].get<double>();
    };
    for (const char* key : {"shared_expert_intermediate_size", "num_shared_experts",
                            "n_shared_experts", "moe_shared_expert_intermediate_size"})
      if (given(key) && !(j[key].is_number() && j[key].get<double>() == 0))
        refuse(key, "is not supported (shared experts are not implemented)");
    if (c.is_moe()) {
      const bool mixtral = type == "mixtral";
      // The expert count's key: Mixtral's num_local_experts; Qwen3-MoE's num_experts, which
      // transformers 5.17 writes as num_local_experts (either is read; both must agree).
      if (given("num_experts") && given("num_local_experts") &&
          integer("num_experts") != integer("num_local_experts"))
        throw std::invalid_argument(path + ": num_experts " + json_excerpt(j["num_experts"]) +
                                    " and num_local_experts " +
                                    json_excerpt(j["num_local_experts"]) + " disagree");
      const char* count_key = mixtral ? "num_local_experts" : "num_experts";
      if (!given(count_key) && given(mixtral ? "num_experts" : "num_local_experts"))
        count_key = mixtral ? "num_experts" : "num_local_experts";
      c.num_experts = need(count_key);
      c.num_experts_per_tok = need("num_experts_per_tok");
      if (!mixtral) {
        c.moe_intermediate_size = need("moe_intermediate_size");
        c.norm_topk_prob = flag("norm_topk_prob");
        if (given("decoder_sparse_step")) c.decoder_sparse_step = integer("decoder_sparse_step");
        if (given("mlp_only_layers")) {
          if (!j["mlp_only_layers"].is_array())
            refuse("mlp_only_layers", "must be a list of layer indices");
          for (const auto& v : j["mlp_only_layers"]) {
            if (!v.is_number_integer())
              refuse("mlp_only_layers", "must be a list of integer layer indices");
            c.mlp_only_layers.push_back(v.get<int64_t>());
          }
        }
      }
      if (given("router_aux_loss_coef")) c.router_aux_loss_coef = number("router_aux_loss_coef");
      c.output_router_logits = flag("output_router_logits");
      if (given("router_jitter_noise") && number("router_jitter_noise") != 0.0)
        refuse("router_jitter_noise",
               "is not supported (routing without noise only; set it to 0.0)");
      if (!mixtral && flag("use_sliding_window"))
        refuse("use_sliding_window",
               "is not supported for qwen3_moe (full attention only; set it to false)");
    } else {
      for (const char* key : {"num_experts", "num_local_experts"})
        if (given(key) && !(j[key].is_number() && j[key].get<double>() == 0))
          refuse(key, "is a mixture-of-experts key, but model_type " + type +
                          " has no experts (qwen3_moe and mixtral do)");
    }

    // Sliding windows, as each family's Hugging Face config reads them.
    if (type == "mistral" || type == "mixtral") {
      if (given("sliding_window")) c.sliding_window = integer("sliding_window");
    } else if (type == "qwen2" || type == "qwen3" || type == "qwen3_moe") {
      c.use_sliding_window = flag("use_sliding_window");
      // Hugging Face drops the window unless use_sliding_window is set.
      if (c.use_sliding_window && given("sliding_window"))
        c.sliding_window = integer("sliding_window");
      if (given("max_window_layers")) c.max_window_layers = integer("max_window_layers");
      if (given("layer_types")) {
        if (!j["layer_types"].is_array()) refuse("layer_types", "must be a list of layer types");
        for (const auto& t : j["layer_types"]) {
          if (!t.is_string()) refuse("layer_types", "must be a list of strings");
          c.layer_types.push_back(t.get<std::string>());
        }
        // Without a window every layer is full attention, whatever the list says.
        bool any_sliding = false;
        for (const std::string& t : c.layer_types) any_sliding |= t == "sliding_attention";
        if (any_sliding && c.sliding_window == 0) c.layer_types.clear();
      }
    } else if (given("layer_types")) {
      for (const auto& t : j["layer_types"])
        if (t != "full_attention")
          refuse("layer_types", "is not supported for " + type + " (only full_attention layers)");
    }
    if (!c.layer_types.empty() &&
        c.layer_types.size() == static_cast<size_t>(c.num_hidden_layers)) {
      // A list that says what the family's rule says anyway is kept as the rule (one description
      // of a model, so that a written and re-read config compares equal).
      DecoderConfig by_rule = c;
      by_rule.layer_types.clear();
      bool same = true;
      for (int64_t i = 0; i < c.num_hidden_layers; ++i)
        same &= (by_rule.layer_window(i) != 0) == (c.layer_types[i] == "sliding_attention");
      if (same) c.layer_types.clear();
    }
    try {
      c.validate();
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(path + ": " + e.what());
    }
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": a field has the wrong type (" + e.what() + ")");
  }
}

nlohmann::json hf_model_config_json(const DecoderConfig& c, const std::string& torch_dtype) {
  nlohmann::json rope_parameters = c.rope_scaling.to_json();
  rope_parameters["rope_theta"] = c.rope_theta;
  nlohmann::json j = {
      {"architectures", {c.hf_class("ForCausalLM")}},
      {"model_type", c.model_type},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      // Both spellings: transformers 4.x reads rope_theta + rope_scaling, 5.x rope_parameters.
      {"rope_theta", c.rope_theta},
      {"rope_scaling", c.rope_scaling.is_default() ? nlohmann::json() : c.rope_scaling.to_json()},
      {"rope_parameters", rope_parameters},
      {"initializer_range", c.initializer_range},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"hidden_act", "silu"},
      {"attention_dropout", 0.0},
      {"dtype", torch_dtype},
  };
  if (c.model_type == "llama") {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = false;
  }
  if (c.model_type == "qwen3" || c.model_type == "qwen3_moe")
    j["attention_bias"] = c.attention_bias;
  if (c.model_type == "mistral" || c.model_type == "mixtral")
    j["sliding_window"] = c.sliding_window ? nlohmann::json(c.sliding_window) : nlohmann::json();
  if (c.model_type == "qwen3_moe") {
    // transformers 4.x reads num_experts, 5.17 writes num_local_experts: both, the same.
    j["num_experts"] = c.num_experts;
    j["num_local_experts"] = c.num_experts;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  if (c.model_type == "mixtral") {
    j["num_local_experts"] = c.num_experts;
    j["router_jitter_noise"] = 0.0;
  }
  if (c.is_moe()) {
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    j["output_router_logits"] = c.output_router_logits;
  }
  if (c.model_type == "qwen2" || c.model_type == "qwen3" || c.model_type == "qwen3_moe") {
    j["use_sliding_window"] = c.use_sliding_window;
    j["sliding_window"] = c.sliding_window ? nlohmann::json(c.sliding_window) : nlohmann::json();
    j["max_window_layers"] = c.max_window_layers;
    nlohmann::json types = nlohmann::json::array();
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      types.push_back(c.layer_window(i) ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  return j;
}

void write_hf_model_config(const DecoderConfig& c, const std::string& path,
                           const std::string& torch_dtype) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error(path + ": cannot write config.json");
  out << hf_model_config_json(c, torch_dtype).dump(2) << "\n";
}

namespace {
Tensor new_param(const Shape& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device, MemCategory::Params);
  t.set_requires_grad(true);
  return t;
}
}  // namespace

Linear::Linear(int64_t in, int64_t out, DType dtype, Device device, bool with_bias)
    : weight(register_parameter("weight", new_param({out, in}, dtype, device))) {
  if (with_bias) bias = &register_parameter("bias", new_param({out}, dtype, device));
}
Tensor Linear::forward(const Tensor& x, const Tensor& residual) {
  return with_forward_hooks(*this, [&] {
    if (!linear_fn) return linear(x, weight.value, bias ? bias->value : Tensor(), residual);
    Tensor y = linear_fn(x, weight.value);
    if (bias) y = add(y, bias->value);
    return residual.defined() ? add(residual, y) : y;
  });
}

Embedding::Embedding(int64_t num, int64_t dim, DType dtype, Device device)
    : weight(register_parameter("weight", new_param({num, dim}, dtype, device))) {}
Tensor Embedding::forward(const Tensor& ids) {
  return with_forward_hooks(*this, [&] { return embedding(weight.value, ids); });
}

RMSNorm::RMSNorm(int64_t dim, double eps, DType dtype, Device device, std::string type_name)
    : weight(register_parameter("weight", new_param({dim}, dtype, device))),
      eps(eps),
      type_name_(std::move(type_name)) {}
Tensor RMSNorm::forward(const Tensor& x) {
  return with_forward_hooks(*this, [&] { return rms_norm(x, weight.value, eps); });
}
std::pair<Tensor, Tensor> RMSNorm::add_forward(const Tensor& x, const Tensor& r) {
  return with_forward_hooks(*this, [&] { return add_rms_norm(x, r, weight.value, eps); });
}

SelfAttention::SelfAttention(const DecoderConfig& c, int64_t window, DType dtype, Device device,
                             DynamicRope* dynamic_rope)
    : q_proj(register_module(
          "q_proj", std::make_unique<Linear>(c.hidden_size, c.num_attention_heads * c.head_dim,
                                             dtype, device, c.qkv_bias()))),
      k_proj(register_module(
          "k_proj", std::make_unique<Linear>(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                             dtype, device, c.qkv_bias()))),
      v_proj(register_module(
          "v_proj", std::make_unique<Linear>(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                             dtype, device, c.qkv_bias()))),
      o_proj(register_module(
          "o_proj", std::make_unique<Linear>(c.num_attention_heads * c.head_dim, c.hidden_size,
                                             dtype, device, c.o_proj_bias()))),
      window(window),
      config(c),
      rope_(rope_frequencies(c.rope_scaling, c.rope_theta, c.head_dim, c.max_position_embeddings,
                             c.max_position_embeddings)),
      dynamic_rope_(dynamic_rope) {
  if (c.qk_norm()) {
    q_norm = &register_module("q_norm", std::make_unique<RMSNorm>(c.head_dim, c.rms_norm_eps, dtype,
                                                                  device, c.hf_class("RMSNorm")));
    k_norm = &register_module("k_norm", std::make_unique<RMSNorm>(c.head_dim, c.rms_norm_eps, dtype,
                                                                  device, c.hf_class("RMSNorm")));
  }
}

namespace {

// Attention of one new query position over the cached keys it sees (all of them, or the last
// `window`). q [B, 1, Hq, D], k and v [B, T, Hkv, D] -> [B, 1, Hq, D]; scores and softmax in fp32.
Tensor attend_one_position(const Tensor& q, Tensor k, Tensor v, int64_t window) {
  const int64_t B = q.size(0), Hq = q.size(2), D = q.size(3), Hkv = k.size(2), T = k.size(1);
  if (window > 0 && T > window) {
    // The query at position T - 1 sees keys T - window .. T - 1 (its own included).
    k = narrow(k, 1, T - window, window);
    v = narrow(v, 1, T - window, window);
  }
  // Query head h reads KV head h / (Hq / Hkv), as transformers' repeat_kv.
  Tensor qg = cast(reshape(q, {B, Hkv, Hq / Hkv, D}), DType::F32);
  Tensor kt = cast(permute(k, {0, 2, 3, 1}), DType::F32);  // [B, Hkv, D, T]
  Tensor vt = cast(permute(v, {0, 2, 1, 3}), DType::F32);  // [B, Hkv, T, D]
  Tensor p = softmax(mul(matmul(qg, kt), 1.0 / std::sqrt(static_cast<double>(D))), -1);
  return cast(reshape(matmul(p, vt), {B, 1, Hq, D}), q.dtype());
}

// The largest position of a forward, plus one (dynamic RoPE scaling sizes itself by it).
int64_t positions_needed(const Tensor& position_ids, int64_t past, int64_t seq) {
  if (!position_ids.defined()) return past + seq;
  int64_t largest = -1;
  for (double p : position_ids.to_vector()) largest = std::max(largest, static_cast<int64_t>(p));
  return largest + 1;
}

}  // namespace

Tensor SelfAttention::forward(const Tensor& x, KVCache::Layer* cache, const TokenLayout& layout) {
  return with_forward_hooks(*this, [&] {
    const int64_t B = x.size(0), S = x.size(1), D = config.head_dim;
    const std::string where = "[" + config.model_type + "] ";
    Tensor q, k, v;
    auto project = [&] {
      q = reshape(q_proj.forward(x), {B, S, config.num_attention_heads, D});
      k = reshape(k_proj.forward(x), {B, S, config.num_key_value_heads, D});
      v = reshape(v_proj.forward(x), {B, S, config.num_key_value_heads, D});
    };
    if (shared_input)
      shared_input(x, project);
    else
      project();
    if (q_norm) {
      q = q_norm->forward(q);
      k = k_norm->forward(k);
    }
    const int64_t past = cache ? cache->length() : 0;
    if (cache && (layout.segment_ids.defined() || layout.position_ids.defined()))
      throw std::invalid_argument(where +
                                  "a KV cache takes one document, not segment_ids or position_ids");
    // Dynamic scaling: transformers' rule over this model's forwards (the frequencies of the
    // longest sequence since the last reset; models/rope_scaling.h). The state is the model's: a
    // forward's first layer updates it, the later ones find it updated (the same length again
    // changes nothing, so a layer recomputed in backward gets its forward's frequencies).
    const RopeFrequencies& freqs =
        dynamic_rope_ ? dynamic_rope_->update(positions_needed(layout.position_ids, past, S))
                      : rope_;
    q = rope(q, freqs, past, layout.position_ids);
    k = rope(k, freqs, past, layout.position_ids);
    Tensor a;
    if (past == 0) {
      AttentionMask mask;
      mask.window = window;
      mask.segment_ids = layout.segment_ids;
      a = attention(q, k, v, mask);
    } else {
      if (S != 1)
        throw std::invalid_argument(where + "a KV cache holding " + std::to_string(past) +
                                    " positions takes one new position at a time, got " +
                                    std::to_string(S));
      k = cat({cache->k, k}, 1);
      v = cat({cache->v, v}, 1);
      a = attend_one_position(q, k, v, window);
    }
    if (cache) {
      cache->k = k;
      cache->v = v;
    }
    return o_proj.forward(reshape(a, {B, S, config.num_attention_heads * D}));
  });
}

GatedMLP::GatedMLP(const DecoderConfig& c, DType dtype, Device device)
    : gate_proj(register_module(
          "gate_proj",
          std::make_unique<Linear>(c.hidden_size, c.intermediate_size, dtype, device))),
      up_proj(register_module(
          "up_proj", std::make_unique<Linear>(c.hidden_size, c.intermediate_size, dtype, device))),
      down_proj(register_module(
          "down_proj",
          std::make_unique<Linear>(c.intermediate_size, c.hidden_size, dtype, device))),
      type_name_(c.hf_class("MLP")) {}

GatedMLP::GatedMLP(const DecoderConfig& c, int64_t intermediate_size, DType dtype, Device device,
                   const std::array<const char*, 3>& names, std::string type_name)
    : gate_proj(register_module(
          names[0], std::make_unique<Linear>(c.hidden_size, intermediate_size, dtype, device))),
      up_proj(register_module(
          names[1], std::make_unique<Linear>(c.hidden_size, intermediate_size, dtype, device))),
      down_proj(register_module(
          names[2], std::make_unique<Linear>(intermediate_size, c.hidden_size, dtype, device))),
      type_name_(std::move(type_name)) {}

Tensor GatedMLP::forward(const Tensor& x, const Tensor& residual) {
  return with_forward_hooks(*this, [&] {
    if (fused_fn) {
      Tensor y = fused_fn(x, residual);
      if (y.defined()) return y;
    }
    Tensor gate, up;
    auto project = [&] {
      gate = gate_proj.forward(x);
      up = up_proj.forward(x);
    };
    if (shared_input)
      shared_input(x, project);
    else
      project();
    return down_proj.forward(swiglu(gate, up), residual);
  });
}

SparseMoeBlock::SparseMoeBlock(const DecoderConfig& c, DType dtype, Device device,
                               const ExpertParallelContext* ep)
    : gate(register_module("gate",
                           std::make_unique<Linear>(c.hidden_size, c.num_experts, dtype, device))),
      experts_list(register_module("experts", std::make_unique<ModuleList>())),
      config(c),
      ep_(ep && ep->ep_size > 1 ? std::make_shared<const ExpertParallelContext>(*ep) : nullptr) {
  if (ep_ && (ep_->num_experts != c.num_experts || ep_->expert_begin < 0 ||
              ep_->expert_end > c.num_experts || ep_->num_local_experts() < 1))
    throw std::invalid_argument(
        "[" + c.model_type + "] the expert-parallel context splits " +
        std::to_string(ep_->num_experts) + " experts (holding " +
        std::to_string(ep_->expert_begin) + ".." + std::to_string(ep_->expert_end - 1) +
        "), but the model has " + std::to_string(c.num_experts) +
        ": make_expert_parallel needs the model's expert count (model.num_experts)");
  const std::string type =
      c.model_type == "mixtral" ? "MixtralBlockSparseTop2MLP" : c.hf_class("MLP");
  const int64_t begin = ep_ ? ep_->expert_begin : 0, end = ep_ ? ep_->expert_end : c.num_experts;
  for (int64_t e = begin; e < end; ++e)  // under the global index: experts.<e>
    experts.push_back(&experts_list.append_as(
        e, std::make_unique<GatedMLP>(c, c.expert_intermediate_size(), dtype, device,
                                      projection_names(), type)));
}

std::array<const char*, 3> SparseMoeBlock::projection_names() const {
  // The checkpoints' per-expert names.
  if (config.model_type == "mixtral") return {"w1", "w3", "w2"};
  return {"gate_proj", "up_proj", "down_proj"};
}

Tensor SparseMoeBlock::run_experts(const Tensor& xs, const std::vector<int64_t>& rows) {
  std::vector<Tensor> gate_w, up_w, down_w;
  for (GatedMLP* e : experts) {
    gate_w.push_back(e->gate_proj.weight.value);
    up_w.push_back(e->up_proj.weight.value);
    down_w.push_back(e->down_proj.weight.value);
  }
  auto project = [&](const Tensor& x, const std::vector<Tensor>& w, int projection) {
    return experts_linear_fn ? experts_linear_fn(x, w, rows, projection)
                             : grouped_linear(x, w, rows);
  };
  Tensor h = swiglu(project(xs, gate_w, 0), project(xs, up_w, 1));
  return project(h, down_w, 2);
}

Tensor SparseMoeBlock::forward(const Tensor& x, RouterStats* stats) {
  return with_forward_hooks(*this, [&] {
    // The experts' weights go to grouped GEMMs directly: anything that would act through their
    // Linear modules (a linear_fn, a per-module hook) would be skipped, so it is refused.
    for (GatedMLP* e : experts)
      for (Linear* l : {&e->gate_proj, &e->up_proj, &e->down_proj})
        if (l->linear_fn || l->has_forward_hooks() || e->fused_fn || e->has_forward_hooks())
          throw std::logic_error(
              "[" + config.model_type +
              "] an expert's linear layer has a conversion or a forward hook, which the experts' "
              "grouped GEMMs would skip (a conversion of the experts goes through the block's "
              "experts_linear_fn, as fp8 training's does); convert or hook whole decoder layers "
              "instead");
    const Shape shape = x.shape();
    const int64_t H = x.size(-1);
    Tensor flat = reshape(x, {-1, H});
    // transformers: router logits in the activations' dtype, softmax and top-k in fp32, the
    // routing weights cast back to the activations' dtype. (An f64 model, for the tests' finite
    // differences, keeps f64.)
    const DType router_dtype = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
    Tensor probs = softmax(cast(gate.forward(flat), router_dtype), -1);
    auto [top, chosen] = topk(probs, config.num_experts_per_tok);
    if (config.renormalizes_topk()) top = div(top, sum(top, {-1}, true));
    Tensor weights = cast(top, x.dtype());
    MoeRouting routing = moe_routing(chosen, config.num_experts);
    Tensor xs = moe_permute(flat, routing);  // sorted by global expert, so by owner too
    Tensor ys;
    if (!ep_) {
      ys = run_experts(xs, routing.expert_counts);
    } else {
      // To the experts' owners; the rows arrive by sender, then local expert. A top-1 routing
      // by local expert regroups them (stable: sender order within an expert, which is the
      // single process's token order when ranks hold consecutive shares of the batch), so each
      // expert runs one GEMM and gets a gradient (zeros without rows) in every backward.
      const ExpertDispatch d = plan_expert_dispatch(*ep_, routing.expert_counts);
      Tensor rx = all_to_all_rows(xs, d.send_rows, d.recv_rows, *ep_->ep_group);
      const int64_t L = ep_->num_local_experts();
      std::vector<int64_t> local;
      local.reserve(static_cast<size_t>(rx.size(0)));
      for (size_t g = 0; g < d.recv_expert_rows.size(); ++g)
        local.insert(local.end(), static_cast<size_t>(d.recv_expert_rows[g]),
                     static_cast<int64_t>(g) % L);
      const int64_t R = rx.size(0);
      MoeRouting by_expert =
          moe_routing(Tensor::from_vector(local, {R, 1}, DType::I64, x.device()), L);
      Tensor ry = run_experts(moe_permute(rx, by_expert), by_expert.expert_counts);
      ry = moe_unpermute(ry, Tensor::ones({R, 1}, ry.dtype(), ry.device()), by_expert);
      ys = all_to_all_rows(ry, d.recv_rows, d.send_rows, *ep_->ep_group);
    }
    Tensor y = moe_unpermute(ys, weights, routing);
    if (stats) {
      stats->expert_counts = routing.expert_counts;
      stats->prob_sum = sum(probs, {0});
      stats->tokens = flat.size(0);
    }
    return reshape(y, shape);
  });
}

DecoderLayer::DecoderLayer(const DecoderConfig& c, int64_t layer_index, DType dtype, Device device,
                           DynamicRope* dynamic_rope, const ExpertParallelContext* ep)
    : self_attn(register_module(
          "self_attn", std::make_unique<SelfAttention>(c, c.layer_window(layer_index), dtype,
                                                       device, dynamic_rope))),
      mlp(c.layer_is_sparse(layer_index)
              ? nullptr
              : &register_module("mlp", std::make_unique<GatedMLP>(c, dtype, device))),
      moe(c.layer_is_sparse(layer_index)
              ? &register_module(c.sparse_block_name(),
                                 std::make_unique<SparseMoeBlock>(c, dtype, device, ep))
              : nullptr),
      input_layernorm(register_module(
          "input_layernorm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device,
                                                       c.hf_class("RMSNorm")))),
      post_attention_layernorm(
          register_module("post_attention_layernorm",
                          std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device,
                                                    c.hf_class("RMSNorm")))),
      type_name_(c.hf_class("DecoderLayer")) {}

Tensor DecoderLayer::forward(const Tensor& x, KVCache::Layer* cache, const TokenLayout& layout,
                             RouterStats* router_stats) {
  return with_forward_hooks(*this, [&] {
    // h = x + attn(norm(x)); the residual add is fused into the post-attention norm, and the
    // MLP's into its down projection.
    auto [h, normed] = post_attention_layernorm.add_forward(
        x, self_attn.forward(input_layernorm.forward(x), cache, layout));
    return moe ? add(h, moe->forward(normed, router_stats)) : mlp->forward(normed, h);
  });
}

DecoderModel::DecoderModel(const DecoderConfig& c, DType dtype, Device device,
                           DynamicRope* dynamic_rope, const ExpertParallelContext* ep)
    : embed_tokens(register_module(
          "embed_tokens", std::make_unique<Embedding>(c.vocab_size, c.hidden_size, dtype, device))),
      layers_list(register_module("layers", std::make_unique<ModuleList>())),
      norm(register_module("norm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype,
                                                             device, c.hf_class("RMSNorm")))),
      type_name_(c.hf_class("Model")) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    layers.push_back(
        &layers_list.append(std::make_unique<DecoderLayer>(c, i, dtype, device, dynamic_rope, ep)));
}

namespace {
const DecoderConfig& validated(const DecoderConfig& c) {
  c.validate();
  return c;
}
}  // namespace

CausalLM::CausalLM(const DecoderConfig& c, DType dtype, Device device, uint64_t seed,
                   const ExpertParallelContext* ep)
    : config(validated(c)),
      dynamic_rope_(c.extends_past_max_positions()
                        ? std::make_unique<DynamicRope>(c.rope_scaling, c.rope_theta, c.head_dim,
                                                        c.max_position_embeddings)
                        : nullptr),
      model(register_module(
          "model", std::make_unique<DecoderModel>(c, dtype, device, dynamic_rope_.get(), ep))),
      ep_(ep && ep->ep_size > 1 ? std::make_shared<const ExpertParallelContext>(*ep) : nullptr) {
  if (!c.tie_word_embeddings)
    lm_head = &register_module(
        "lm_head", std::make_unique<Linear>(c.hidden_size, c.vocab_size, dtype, device));
  finalize();
  // Each parameter draws from its own slice of the Philox stream, at its offset in the model
  // with every expert: initialization depends neither on the device nor on which experts a
  // rank holds (an expert-parallel rank skips the slices of the experts it lacks).
  std::map<std::string, std::pair<int64_t, uint64_t>> expert_lists;  // prefix -> (E, span)
  for (DecoderLayer* layer : model.layers)
    if (layer->moe) {
      uint64_t span = 0;  // one expert's slices
      for (Parameter* p : layer->moe->experts.front()->parameters())
        span += 2 * static_cast<uint64_t>(p->value.numel());
      expert_lists[layer->moe->experts_list.full_name() + "."] = {c.num_experts, span};
    }
  uint64_t offset = 0;
  std::string list;         // the expert list being walked
  uint64_t list_start = 0;  // its offset
  int64_t expert = -1;      // the expert being walked, and the offset within it
  uint64_t within = 0;
  NoGradGuard no_grad;
  for (Parameter* p : parameters()) {
    const Tensor& t = p->value;
    uint64_t at = offset;
    const int64_t e = expert_index_of(p->name);
    const size_t cut = e >= 0 ? p->name.find(".experts.") + 9 : std::string::npos;
    auto found =
        cut == std::string::npos ? expert_lists.end() : expert_lists.find(p->name.substr(0, cut));
    if (found != expert_lists.end()) {
      if (found->first != list) {  // the list's first held expert
        list = found->first;
        list_start = offset;
        offset = list_start + static_cast<uint64_t>(found->second.first) * found->second.second;
        expert = -1;
      }
      if (e != expert) expert = e, within = 0;
      at = list_start + static_cast<uint64_t>(e) * found->second.second + within;
      within += 2 * static_cast<uint64_t>(t.numel());
    } else {
      offset += 2 * static_cast<uint64_t>(t.numel());
    }
    const bool is_bias =
        p->name.size() >= 5 && p->name.compare(p->name.size() - 5, 5, ".bias") == 0;
    if (is_bias) {
      t.fill_(0.0);
    } else if (t.dim() == 1) {
      t.fill_(1.0);
    } else {
      t.copy_(rand_normal(t.shape(), seed, at, DType::F32, t.device(), 0.0, c.initializer_range));
    }
  }
}

Tensor CausalLM::final_hidden(const Tensor& ids, KVCache* cache, const TokenLayout& layout) {
  const std::string where = "[" + config.model_type + "] ";
  if (ids.dim() != 2) throw std::invalid_argument(where + "ids must be [B, S], got " + ids.str());
  const int64_t past = cache ? cache->length() : 0;
  if (past + ids.size(1) > config.max_position_embeddings && !config.extends_past_max_positions())
    throw std::invalid_argument(where + "sequence length " + std::to_string(past + ids.size(1)) +
                                " exceeds max_position_embeddings " +
                                std::to_string(config.max_position_embeddings));
  if (cache) cache->layers.resize(model.layers.size());
  router_stats_.assign(model.layers.size(), RouterStats());
  const bool checkpointed = checkpointing_ != ActivationCheckpointing::None;
  const CheckpointMode mode = checkpointing_ == ActivationCheckpointing::Selective
                                  ? CheckpointMode::Selective
                                  : CheckpointMode::Full;
  Tensor x = model.embed_tokens.forward(ids);
  for (size_t i = 0; i < model.layers.size(); ++i) {
    DecoderLayer* layer = model.layers[i];
    RouterStats* stats = layer->moe ? &router_stats_[i] : nullptr;
    if (cache) {
      x = layer->forward(x, &cache->layers[i], {}, stats);
    } else if (checkpointed && stats) {
      // checkpoint() has one output: the layer's output and its router probability sums travel
      // in one tensor of the router's dtype (fp32: exact for bf16 / f16 outputs), so that both
      // stay differentiable. The
      // expert counts are constants, written again (the same) when backward recomputes the layer.
      const Shape shape = x.shape();
      const DType dtype = x.dtype();
      Tensor packed = checkpoint(
          [layer, layout, stats](const std::vector<Tensor>& in) {
            RouterStats fresh;
            Tensor y = layer->forward(in[0], nullptr, layout, &fresh);
            stats->expert_counts = fresh.expert_counts;
            stats->tokens = fresh.tokens;
            return cat({reshape(cast(y, fresh.prob_sum.dtype()), {-1}), fresh.prob_sum}, 0);
          },
          {x}, mode);
      const int64_t n = shape_numel(shape);
      x = cast(reshape(narrow(packed, 0, 0, n), shape), dtype);
      stats->prob_sum = narrow(packed, 0, n, config.num_experts);
    } else if (checkpointed) {
      x = checkpoint(
          [layer, layout](const std::vector<Tensor>& in) {
            return layer->forward(in[0], nullptr, layout);
          },
          {x}, mode);
    } else {
      x = layer->forward(x, nullptr, layout, stats);
    }
  }
  return model.norm.forward(x);
}

Tensor CausalLM::forward(const Tensor& ids, KVCache* cache, const TokenLayout& layout) {
  return with_forward_hooks(*this, [&] {
    Tensor x = final_hidden(ids, cache, layout);
    if (lm_head) return lm_head->forward(x);
    const Tensor& embed = model.embed_tokens.weight.value;
    return tied_head_fn ? tied_head_fn(x, embed) : linear(x, embed);
  });
}

Tensor CausalLM::forward_loss(const Tensor& ids, const Tensor& targets, const TokenLayout& layout,
                              double grad_scale) {
  return with_forward_hooks(*this, [&] {
    Tensor x = final_hidden(ids, nullptr, layout);
    // The head's GEMMs inside the chunked loss: the conversion's (head_loss_fn) or the compute
    // dtype's.
    auto fused = [&](const Tensor& weight) {
      return head_loss_fn ? head_loss_fn(x, weight, targets, grad_scale)
                          : linear_cross_entropy(x, weight, targets, -100, 0, grad_scale);
    };
    Tensor lm_loss;
    if (!lm_head) {
      // A tied head converted without a fused loss keeps its own GEMM and the plain loss, as a
      // Linear head does below.
      const Tensor& embed = model.embed_tokens.weight.value;
      lm_loss =
          tied_head_fn && !head_loss_fn ? loss(tied_head_fn(x, embed), targets) : fused(embed);
    } else if (lm_head->linear_fn && !head_loss_fn) {
      lm_loss = loss(lm_head->forward(x), targets);
    } else {
      // The head's hooks run as in Linear::forward (FSDP gathers its weight there).
      lm_loss = with_forward_hooks(*lm_head, [&] { return fused(lm_head->weight.value); });
    }
    return add_router_aux_loss(lm_loss);
  });
}

int64_t CausalLM::dynamic_rope_max_seq_len_cached() const {
  return dynamic_rope_ ? dynamic_rope_->max_seq_len_cached() : -1;
}

void CausalLM::restore_dynamic_rope(int64_t max_seq_len_cached) {
  if (dynamic_rope_) dynamic_rope_->restore(max_seq_len_cached);
}

Tensor CausalLM::router_aux_loss() const {
  // transformers' load_balancing_loss_func over the concatenated sparse layers' T token rows:
  // num_experts * sum_e (slots routed to e / T) * (summed probability of e / T).
  const int64_t E = config.num_experts;
  Tensor prob_total;
  std::vector<double> counts(static_cast<size_t>(std::max<int64_t>(E, 0)), 0.0);
  int64_t rows = 0;
  for (const RouterStats& s : router_stats_) {
    if (!s.prob_sum.defined()) continue;
    prob_total = prob_total.defined() ? add(prob_total, s.prob_sum) : s.prob_sum;
    for (int64_t e = 0; e < E; ++e) counts[static_cast<size_t>(e)] += s.expert_counts[e];
    rows += s.tokens;
  }
  if (!prob_total.defined() || rows == 0) return Tensor();
  std::vector<double> scale(counts.size());
  const double T = static_cast<double>(rows);
  for (size_t e = 0; e < counts.size(); ++e)
    scale[e] = static_cast<double>(E) * counts[e] / (T * T);
  return sum(
      mul(prob_total, Tensor::from_vector(scale, {E}, prob_total.dtype(), prob_total.device())));
}

Tensor CausalLM::add_router_aux_loss(const Tensor& lm_loss) const {
  if (!config.output_router_logits) return lm_loss;
  Tensor aux = router_aux_loss();
  if (!aux.defined()) return lm_loss;
  return add(lm_loss, mul(cast(aux, lm_loss.dtype()), config.router_aux_loss_coef));
}

std::vector<std::vector<int64_t>> CausalLM::expert_counts() const {
  std::vector<std::vector<int64_t>> out;
  for (const RouterStats& s : router_stats_) out.push_back(s.expert_counts);
  return out;
}

Tensor CausalLM::loss(const Tensor& logits, const Tensor& targets) {
  const int64_t V = logits.size(-1);
  return cross_entropy(reshape(logits, {-1, V}), reshape(targets, {-1}));
}

Tensor shift_labels(const Tensor& labels) {
  std::vector<double> v = labels.to_vector();
  const int64_t B = labels.size(0), S = labels.size(1);
  std::vector<int64_t> out(static_cast<size_t>(B * S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t)
      out[b * S + t] = t + 1 < S ? static_cast<int64_t>(v[b * S + t + 1]) : -100;
  return Tensor::from_vector(out, {B, S}, DType::I64, labels.device());
}

bool is_loadable_weight_dtype(const std::string& safetensors_dtype) {
  return safetensors_dtype == "F32" || safetensors_dtype == "BF16" || safetensors_dtype == "F16";
}

void check_offered_weights(Module& model, const std::map<std::string, OfferedWeight>& offered,
                           const std::string& source, const std::string& advice,
                           bool allow_tied_lm_head) {
  std::set<std::string> needed;
  for (Parameter* p : model.parameters()) {
    needed.insert(p->name);
    auto it = offered.find(p->name);
    if (it == offered.end())
      throw std::runtime_error(source + ": checkpoint has no tensor '" + p->name +
                               "' that the model needs; " + advice);
    const OfferedWeight& w = it->second;
    if (w.shape != p->value.shape())
      throw std::runtime_error(w.file + ": tensor '" + p->name + "' has shape " +
                               shape_str(w.shape) + " but the model expects " +
                               shape_str(p->value.shape()) + "; " + advice);
    if (!is_loadable_weight_dtype(w.dtype))
      throw std::runtime_error(w.file + ": tensor '" + p->name + "' has dtype " + w.dtype +
                               ", but a weight must be F32, BF16 or F16 (the 16-bit ones are "
                               "widened to fp32); other dtypes are not converted. The file was "
                               "not written as this model's weights, or it was altered");
  }
  for (const auto& [name, w] : offered)
    if (!needed.count(name) && !(allow_tied_lm_head && name == "lm_head.weight"))
      throw std::runtime_error(w.file + ": tensor '" + name + "' does not belong to this model; " +
                               advice);
}

namespace {

// Where a per-expert parameter lies in transformers 5's fused layout (save_pretrained with
// save_original_format=False): expert `expert`'s rows [row_begin, row_begin + rows) of the
// [E, R, C] tensor `source`; expert -1: all of `source` (a renamed tensor).
struct FusedExpertSlice {
  std::string source;
  int64_t expert = -1, row_begin = 0, rows = 0;
};

// Rewrites `offered` so that fused expert tensors (model.layers.{i}.mlp.experts.gate_up_proj
// [E, 2I, H], gate rows first, and .down_proj [E, H, I]; Mixtral's router as mlp.gate) appear
// under the per-expert names the model's parameters carry; returns where each one comes from.
std::map<std::string, FusedExpertSlice> unfuse_expert_tensors(
    Module& model, std::map<std::string, OfferedWeight>& offered) {
  std::set<std::string> params;
  for (Parameter* p : model.parameters()) params.insert(p->name);
  std::map<std::string, FusedExpertSlice> out;
  std::map<std::string, OfferedWeight> added;
  std::vector<std::string> replaced;
  const std::string experts = ".mlp.experts.";
  for (const auto& [name, w] : offered) {
    const size_t at = name.find(experts);
    const std::string prefix = at == std::string::npos ? "" : name.substr(0, at);
    const std::string kind = at == std::string::npos ? "" : name.substr(at + experts.size());
    if (kind == "gate_up_proj" || kind == "down_proj") {
      if (w.shape.size() != 3) continue;  // check_offered_weights names it
      // The model's naming of expert 0 tells the family (Qwen3-MoE or Mixtral).
      const bool mixtral = params.count(prefix + ".block_sparse_moe.experts.0.w1.weight") > 0;
      const std::string base = prefix + (mixtral ? ".block_sparse_moe.experts." : experts);
      if (!params.count(base + "0." + (mixtral ? "w2" : "down_proj") + ".weight"))
        continue;  // no experts there: check_offered_weights names the stray tensor
      const int64_t E = w.shape[0], R = w.shape[1], C = w.shape[2];
      for (int64_t e = 0; e < E; ++e) {
        const std::string ex = base + std::to_string(e) + ".";
        if (kind == "gate_up_proj") {
          out[ex + (mixtral ? "w1" : "gate_proj") + ".weight"] = {name, e, 0, R / 2};
          out[ex + (mixtral ? "w3" : "up_proj") + ".weight"] = {name, e, R / 2, R - R / 2};
          added[ex + (mixtral ? "w1" : "gate_proj") + ".weight"] = {w.file, w.dtype, {R / 2, C}};
          added[ex + (mixtral ? "w3" : "up_proj") + ".weight"] = {w.file, w.dtype, {R - R / 2, C}};
        } else {
          out[ex + (mixtral ? "w2" : "down_proj") + ".weight"] = {name, e, 0, R};
          added[ex + (mixtral ? "w2" : "down_proj") + ".weight"] = {w.file, w.dtype, {R, C}};
        }
      }
      replaced.push_back(name);
    } else if (name.size() > 16 && name.compare(name.size() - 16, 16, ".mlp.gate.weight") == 0) {
      const std::string target = name.substr(0, name.size() - 16) + ".block_sparse_moe.gate.weight";
      if (!params.count(target) || params.count(name)) continue;
      out[target] = {name, -1, 0, 0};
      added[target] = w;
      replaced.push_back(name);
    }
  }
  for (const std::string& n : replaced) offered.erase(n);
  for (auto& [n, w] : added) offered[n] = w;
  return out;
}

}  // namespace

void load_hf_weights(Module& model, const std::string& dir) {
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;  // by file
  std::map<std::string, SafetensorsReader*> reader_of;                // tensor name -> its file
  auto open = [&](const std::string& file) -> SafetensorsReader* {
    auto& r = readers[file];
    if (!r) r = std::make_unique<SafetensorsReader>(file);
    return r.get();
  };
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index)) {
    std::map<std::string, std::string> file_of;
    nlohmann::json j;
    try {
      j = read_json_file(index.string());
      for (auto& [name, file] : j.at("weight_map").items())
        file_of[name] = (fs::path(dir) / file.get<std::string>()).string();
    } catch (const std::exception& e) {
      throw std::runtime_error(index.string() + ": bad index (" + e.what() +
                               "); expected {\"weight_map\": {tensor: file}}");
    }
    for (const auto& [name, file] : file_of) {
      SafetensorsReader* r = open(file);
      if (!r->contains(name))
        throw std::runtime_error(index.string() + ": lists tensor '" + name + "' in " + file +
                                 ", which does not hold it");
      reader_of[name] = r;
    }
  } else if (fs::exists(single)) {
    SafetensorsReader* r = open(single.string());
    for (const std::string& n : r->names()) reader_of[n] = r;
  } else {
    throw std::runtime_error(dir + ": no model.safetensors or model.safetensors.index.json");
  }
  std::map<std::string, OfferedWeight> offered;
  for (const auto& [name, r] : reader_of)
    offered[name] = {r->path(), r->info(name).dtype_name, r->info(name).shape};
  const std::map<std::string, FusedExpertSlice> fused = unfuse_expert_tensors(model, offered);
  // An expert-parallel model reads its own experts only; check_offered_weights still demands
  // every one of them.
  const auto* lm = dynamic_cast<const CausalLM*>(&model);
  if (const ExpertParallelContext* ep = lm ? lm->expert_parallel() : nullptr)
    for (auto it = offered.begin(); it != offered.end();) {
      const int64_t e = expert_index_of(it->first);
      if (e >= 0 && e < ep->num_experts && !ep->holds(e))
        it = offered.erase(it);
      else
        ++it;
    }
  check_offered_weights(model, offered, dir,
                        "check the folder's config.json (the model it describes) against its "
                        "weights",
                        /*allow_tied_lm_head=*/true);
  NoGradGuard no_grad;
  std::map<std::string, Tensor> fused_loaded;  // fused tensors, each loaded once
  auto load_checked = [&](const std::string& name) {
    SafetensorsReader* r = reader_of.at(name);
    Tensor t = r->load(name, MemCategory::Other);
    if (has_non_finite(t))
      throw std::runtime_error(r->path() + ": tensor '" + name +
                               "' holds NaN or Inf values; the weights are damaged (or come from "
                               "a run that diverged): load another checkpoint");
    return t;
  };
  for (Parameter* p : model.parameters()) {
    auto f = fused.find(p->name);
    if (f == fused.end()) {
      p->value.copy_(load_checked(p->name));
      continue;
    }
    const FusedExpertSlice& s = f->second;
    Tensor& whole = fused_loaded[s.source];
    if (!whole.defined()) whole = load_checked(s.source);
    if (s.expert < 0) {  // a renamed tensor (Mixtral's router)
      p->value.copy_(whole);
      continue;
    }
    Tensor slab = reshape(narrow(whole, 0, s.expert, 1), {whole.size(1), whole.size(2)});
    p->value.copy_(contiguous(narrow(slab, 0, s.row_begin, s.rows)));
  }
}

void save_hf_model(Module& model, const DecoderConfig& config, const std::string& dir) {
  const auto* lm = dynamic_cast<const CausalLM*>(&model);
  if (const ExpertParallelContext* ep = lm ? lm->expert_parallel() : nullptr)
    throw std::logic_error(
        "save_hf_model: this model holds experts " + std::to_string(ep->expert_begin) + ".." +
        std::to_string(ep->expert_end - 1) + " of " + std::to_string(ep->num_experts) +
        " only (expert parallelism); save the strategy's full_state_dict, which gathers them");
  fs::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  DType dtype = DType::F32;
  for (Parameter* p : model.parameters()) {
    tensors.push_back({p->name, p->value});
    dtype = p->value.dtype();
  }
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  write_hf_model_config(config, (fs::path(dir) / "config.json").string(),
                        dtype == DType::BF16  ? "bfloat16"
                        : dtype == DType::F16 ? "float16"
                                              : "float32");
}

}  // namespace accel
