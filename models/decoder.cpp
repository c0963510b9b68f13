#include "models/decoder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
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
  if (model_type == "mistral") return sliding_window;
  if (model_type == "qwen2" || model_type == "qwen3")
    return use_sliding_window && i >= max_window_layers ? sliding_window : 0;
  return 0;
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
         "' is not supported (supported: llama, qwen2, qwen3, mistral)");
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
  if (attention_bias && (model_type == "qwen2" || model_type == "mistral"))
    fail("attention_bias is not an option of " + model_type +
         (model_type == "qwen2" ? " (its q/k/v projections always have biases, o_proj none)"
                                : " (no biases)"));
  if (sliding_window < 0)
    fail("sliding_window must not be negative, got " + std::to_string(sliding_window));
  if (max_window_layers < 0)
    fail("max_window_layers must not be negative, got " + std::to_string(max_window_layers));
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
      {"max_position_embeddings x head_dim (RoPE tables)", {max_position_embeddings, head_dim}},
  };
  for (const Product& p : products)
    if (checked_numel(p.factors) < 0)
      fail(std::string(p.what) + " = " + shape_str(p.factors) +
           " is more elements than a tensor can hold (2^60); check the sizes");
  if (num_parameters() < 0)
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

int64_t DecoderConfig::num_parameters() const {
  // Overflow-checked: validate() relies on a negative result for sizes that do not fit.
  int64_t attn = 0, extra = 0, mlp = 0, layer = 0, emb = 0, layers = 0, n = 0, body = 0;
  // Biases and q/k norms: at most (Hq + 2 Hkv) D + hidden + 2 D per layer.
  int64_t heads = 0, qkv_out = 0;
  bool bad = __builtin_add_overflow(num_attention_heads, 2 * num_key_value_heads, &heads) ||
             __builtin_mul_overflow(heads, head_dim, &qkv_out);
  if (!bad) {
    extra = (qkv_bias() ? qkv_out : 0) + (o_proj_bias() ? hidden_size : 0) +
            (qk_norm() ? 2 * head_dim : 0);
  }
  bad = bad ||
        __builtin_mul_overflow(hidden_size * head_dim,
                               2 * (num_attention_heads + num_key_value_heads), &attn) ||
        __builtin_mul_overflow(3 * hidden_size, intermediate_size, &mlp) ||
        __builtin_add_overflow(attn, mlp + 2 * hidden_size + extra, &layer) ||
        __builtin_mul_overflow(vocab_size * hidden_size, tie_word_embeddings ? 1 : 2, &emb) ||
        __builtin_mul_overflow(num_hidden_layers, layer, &layers) ||
        __builtin_add_overflow(layers, hidden_size, &body) || __builtin_add_overflow(emb, body, &n);
  return bad ? -1 : n;
}

double DecoderConfig::flops_per_token(int64_t seq_len) const {
  // Same formula as the PyTorch reference (tools/reference/llama_shapes.py; docs/algorithms.md).
  double matmul_params = static_cast<double>(num_parameters() - vocab_size * hidden_size);
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
               "is not supported (supported: \"llama\", \"qwen2\", \"qwen3\", \"mistral\")");
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
      if (type == "mistral") refuse("attention_bias", "is not supported for mistral");
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

    // Sliding windows, as each family's Hugging Face config reads them.
    if (type == "mistral") {
      if (given("sliding_window")) c.sliding_window = integer("sliding_window");
    } else if (type == "qwen2" || type == "qwen3") {
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
          refuse("layer_types", "is not supported for llama (only full_attention layers)");
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
  if (c.model_type == "qwen3") j["attention_bias"] = c.attention_bias;
  if (c.model_type == "mistral")
    j["sliding_window"] = c.sliding_window ? nlohmann::json(c.sliding_window) : nlohmann::json();
  if (c.model_type == "qwen2" || c.model_type == "qwen3") {
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
Tensor Linear::forward(const Tensor& x) {
  return with_forward_hooks(*this, [&] {
    if (!linear_fn) return linear(x, weight.value, bias ? bias->value : Tensor());
    Tensor y = linear_fn(x, weight.value);
    return bias ? add(y, bias->value) : y;
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

SelfAttention::SelfAttention(const DecoderConfig& c, int64_t window, DType dtype, Device device)
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
                             c.max_position_embeddings)) {
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
    const RopeFrequencies* freqs = &rope_;
    RopeFrequencies longer;
    if (config.extends_past_max_positions()) {
      const int64_t needed = positions_needed(layout.position_ids, past, S);
      if (needed > config.max_position_embeddings) {
        longer = rope_frequencies(config.rope_scaling, config.rope_theta, D,
                                  config.max_position_embeddings, needed);
        freqs = &longer;
      }
    }
    q = rope(q, *freqs, past, layout.position_ids);
    k = rope(k, *freqs, past, layout.position_ids);
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

Tensor GatedMLP::forward(const Tensor& x) {
  return with_forward_hooks(*this, [&] {
    if (fused_fn) {
      Tensor y = fused_fn(x);
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
    return down_proj.forward(swiglu(gate, up));
  });
}

DecoderLayer::DecoderLayer(const DecoderConfig& c, int64_t layer_index, DType dtype, Device device)
    : self_attn(register_module("self_attn", std::make_unique<SelfAttention>(
                                                 c, c.layer_window(layer_index), dtype, device))),
      mlp(register_module("mlp", std::make_unique<GatedMLP>(c, dtype, device))),
      input_layernorm(register_module(
          "input_layernorm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device,
                                                       c.hf_class("RMSNorm")))),
      post_attention_layernorm(
          register_module("post_attention_layernorm",
                          std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device,
                                                    c.hf_class("RMSNorm")))),
      type_name_(c.hf_class("DecoderLayer")) {}

Tensor DecoderLayer::forward(const Tensor& x, KVCache::Layer* cache, const TokenLayout& layout) {
  return with_forward_hooks(*this, [&] {
    // h = x + attn(norm(x)); the residual add is fused into the post-attention norm.
    auto [h, normed] = post_attention_layernorm.add_forward(
        x, self_attn.forward(input_layernorm.forward(x), cache, layout));
    return add(h, mlp.forward(normed));
  });
}

DecoderModel::DecoderModel(const DecoderConfig& c, DType dtype, Device device)
    : embed_tokens(register_module(
          "embed_tokens", std::make_unique<Embedding>(c.vocab_size, c.hidden_size, dtype, device))),
      layers_list(register_module("layers", std::make_unique<ModuleList>())),
      norm(register_module("norm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype,
                                                             device, c.hf_class("RMSNorm")))),
      type_name_(c.hf_class("Model")) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    layers.push_back(&layers_list.append(std::make_unique<DecoderLayer>(c, i, dtype, device)));
}

namespace {
const DecoderConfig& validated(const DecoderConfig& c) {
  c.validate();
  return c;
}
}  // namespace

CausalLM::CausalLM(const DecoderConfig& c, DType dtype, Device device, uint64_t seed)
    : config(validated(c)),
      model(register_module("model", std::make_unique<DecoderModel>(c, dtype, device))) {
  if (!c.tie_word_embeddings)
    lm_head = &register_module(
        "lm_head", std::make_unique<Linear>(c.hidden_size, c.vocab_size, dtype, device));
  finalize();
  // Each parameter draws from its own slice of the Philox stream, so initialization does not
  // depend on the device or on which parameters a rank holds.
  uint64_t offset = 0;
  NoGradGuard no_grad;
  for (Parameter* p : parameters()) {
    const Tensor& t = p->value;
    const bool is_bias =
        p->name.size() >= 5 && p->name.compare(p->name.size() - 5, 5, ".bias") == 0;
    if (is_bias) {
      t.fill_(0.0);
    } else if (t.dim() == 1) {
      t.fill_(1.0);
    } else {
      t.copy_(
          rand_normal(t.shape(), seed, offset, DType::F32, t.device(), 0.0, c.initializer_range));
    }
    offset += 2 * static_cast<uint64_t>(t.numel());
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
  Tensor x = model.embed_tokens.forward(ids);
  for (size_t i = 0; i < model.layers.size(); ++i) {
    DecoderLayer* layer = model.layers[i];
    if (cache) {
      x = layer->forward(x, &cache->layers[i]);
    } else if (checkpoint_layers_) {
      x = checkpoint(
          [layer, layout](const std::vector<Tensor>& in) {
            return layer->forward(in[0], nullptr, layout);
          },
          {x});
    } else {
      x = layer->forward(x, nullptr, layout);
    }
  }
  return model.norm.forward(x);
}

Tensor CausalLM::forward(const Tensor& ids, KVCache* cache, const TokenLayout& layout) {
  return with_forward_hooks(*this, [&] {
    Tensor x = final_hidden(ids, cache, layout);
    if (lm_head) return lm_head->forward(x);
    return linear(x, model.embed_tokens.weight.value);
  });
}

Tensor CausalLM::forward_loss(const Tensor& ids, const Tensor& targets, const TokenLayout& layout) {
  return with_forward_hooks(*this, [&] {
    Tensor x = final_hidden(ids, nullptr, layout);
    if (!lm_head) return linear_cross_entropy(x, model.embed_tokens.weight.value, targets);
    if (lm_head->linear_fn) return loss(lm_head->forward(x), targets);
    // The head's hooks run as in Linear::forward (FSDP gathers its weight there).
    return with_forward_hooks(
        *lm_head, [&] { return linear_cross_entropy(x, lm_head->weight.value, targets); });
  });
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
  check_offered_weights(model, offered, dir,
                        "check the folder's config.json (the model it describes) against its "
                        "weights",
                        /*allow_tied_lm_head=*/true);
  NoGradGuard no_grad;
  for (Parameter* p : model.parameters()) {
    SafetensorsReader* r = reader_of.at(p->name);
    Tensor t = r->load(p->name, MemCategory::Other);
    if (has_non_finite(t))
      throw std::runtime_error(r->path() + ": tensor '" + p->name +
                               "' holds NaN or Inf values; the weights are damaged (or come from "
                               "a run that diverged): load another checkpoint");
    p->value.copy_(t);
  }
}

void save_hf_model(Module& model, const DecoderConfig& config, const std::string& dir) {
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
