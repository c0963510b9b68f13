#include "models/decoder.h"

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

void DecoderConfig::validate() const {
  auto fail = [](const std::string& m) { throw std::invalid_argument("llama config: " + m); };
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
  if (!(std::isfinite(rms_norm_eps) && rms_norm_eps > 0))
    fail("rms_norm_eps must be a positive number, got " + std::to_string(rms_norm_eps));
  if (!(std::isfinite(initializer_range) && initializer_range >= 0))
    fail("initializer_range must be a non-negative number, got " +
         std::to_string(initializer_range));
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
  int64_t attn = 0, mlp = 0, layer = 0, emb = 0, layers = 0, n = 0, body = 0;
  bool bad = __builtin_mul_overflow(hidden_size * head_dim,
                                    2 * (num_attention_heads + num_key_value_heads), &attn) ||
             __builtin_mul_overflow(3 * hidden_size, intermediate_size, &mlp) ||
             __builtin_add_overflow(attn, mlp + 2 * hidden_size, &layer) ||
             __builtin_mul_overflow(vocab_size * hidden_size, tie_word_embeddings ? 1 : 2, &emb) ||
             __builtin_mul_overflow(num_hidden_layers, layer, &layers) ||
             __builtin_add_overflow(layers, hidden_size, &body) ||
             __builtin_add_overflow(emb, body, &n);
  return bad ? -1 : n;
}

double DecoderConfig::flops_per_token(int64_t seq_len) const {
  // Same formula as the PyTorch reference (tools/reference/llama_shapes.py; docs/algorithms.md).
  double matmul_params = static_cast<double>(num_parameters() - vocab_size * hidden_size);
  if (tie_word_embeddings) matmul_params += static_cast<double>(vocab_size * hidden_size);
  return 6.0 * matmul_params +
         12.0 * static_cast<double>(num_hidden_layers * seq_len * hidden_size);
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
  try {
    if (j.contains("model_type") && j["model_type"] != "llama")
      throw std::runtime_error(path + ": model_type is " + json_excerpt(j["model_type"]) +
                               ", only \"llama\" is supported");
    DecoderConfig c;
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
    c.tie_word_embeddings = j.value("tie_word_embeddings", false);
    if (j.contains("rope_theta")) {
      c.rope_theta = j["rope_theta"].get<double>();
    } else if (j.contains("rope_parameters") && j["rope_parameters"].contains("rope_theta")) {
      const auto& rp = j["rope_parameters"];
      std::string type = rp.value("rope_type", std::string("default"));
      if (type != "default")
        throw std::runtime_error(path + ": rope_parameters.rope_type '" + text_excerpt(type) +
                                 "' is not supported (only 'default')");
      c.rope_theta = rp["rope_theta"].get<double>();
    }
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
      throw std::runtime_error(path + ": rope_scaling is not supported yet (found " +
                               json_excerpt(j["rope_scaling"]) + ")");
    if (j.value("attention_bias", false) || j.value("mlp_bias", false))
      throw std::runtime_error(path + ": attention_bias/mlp_bias are not supported");
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

void write_hf_model_config(const DecoderConfig& c, const std::string& path,
                           const std::string& torch_dtype) {
  nlohmann::json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
      {"initializer_range", c.initializer_range},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"attention_dropout", 0.0},
      {"dtype", torch_dtype},
  };
  std::ofstream out(path);
  if (!out) throw std::runtime_error(path + ": cannot write config.json");
  out << j.dump(2) << "\n";
}

namespace {
Tensor new_param(const Shape& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device, MemCategory::Params);
  t.set_requires_grad(true);
  return t;
}
}  // namespace

Linear::Linear(int64_t in, int64_t out, DType dtype, Device device)
    : weight(register_parameter("weight", new_param({out, in}, dtype, device))) {}
Tensor Linear::forward(const Tensor& x) {
  return with_forward_hooks(
      *this, [&] { return linear_fn ? linear_fn(x, weight.value) : linear(x, weight.value); });
}

Embedding::Embedding(int64_t num, int64_t dim, DType dtype, Device device)
    : weight(register_parameter("weight", new_param({num, dim}, dtype, device))) {}
Tensor Embedding::forward(const Tensor& ids) {
  return with_forward_hooks(*this, [&] { return embedding(weight.value, ids); });
}

RMSNorm::RMSNorm(int64_t dim, double eps, DType dtype, Device device)
    : weight(register_parameter("weight", new_param({dim}, dtype, device))), eps(eps) {}
Tensor RMSNorm::forward(const Tensor& x) {
  return with_forward_hooks(*this, [&] { return rms_norm(x, weight.value, eps); });
}
std::pair<Tensor, Tensor> RMSNorm::add_forward(const Tensor& x, const Tensor& r) {
  return with_forward_hooks(*this, [&] { return add_rms_norm(x, r, weight.value, eps); });
}

SelfAttention::SelfAttention(const DecoderConfig& c, DType dtype, Device device)
    : q_proj(register_module(
          "q_proj", std::make_unique<Linear>(c.hidden_size, c.num_attention_heads * c.head_dim,
                                             dtype, device))),
      k_proj(register_module(
          "k_proj", std::make_unique<Linear>(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                             dtype, device))),
      v_proj(register_module(
          "v_proj", std::make_unique<Linear>(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                             dtype, device))),
      o_proj(register_module("o_proj", std::make_unique<Linear>(c.num_attention_heads * c.head_dim,
                                                                c.hidden_size, dtype, device))),
      config(c) {}

namespace {

// Attention of one new query position over every cached key (all visible: they precede it).
// q [B, 1, Hq, D], k and v [B, T, Hkv, D] -> [B, 1, Hq, D]; scores and softmax in fp32.
Tensor attend_one_position(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t B = q.size(0), Hq = q.size(2), D = q.size(3), Hkv = k.size(2);
  // Query head h reads KV head h / (Hq / Hkv), as transformers' repeat_kv.
  Tensor qg = cast(reshape(q, {B, Hkv, Hq / Hkv, D}), DType::F32);
  Tensor kt = cast(permute(k, {0, 2, 3, 1}), DType::F32);  // [B, Hkv, D, T]
  Tensor vt = cast(permute(v, {0, 2, 1, 3}), DType::F32);  // [B, Hkv, T, D]
  Tensor p = softmax(mul(matmul(qg, kt), 1.0 / std::sqrt(static_cast<double>(D))), -1);
  return cast(reshape(matmul(p, vt), {B, 1, Hq, D}), q.dtype());
}

}  // namespace

Tensor SelfAttention::forward(const Tensor& x, KVCache::Layer* cache, const TokenLayout& layout) {
  return with_forward_hooks(*this, [&] {
    const int64_t B = x.size(0), S = x.size(1), D = config.head_dim;
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
    const int64_t past = cache ? cache->length() : 0;
    if (layout.position_ids.defined())
      throw std::invalid_argument("[llama] position_ids are not supported yet");
    if (cache && layout.segment_ids.defined())
      throw std::invalid_argument("[llama] a KV cache takes one document, not segment_ids");
    q = rope(q, config.rope_theta, past);
    k = rope(k, config.rope_theta, past);
    Tensor a;
    if (past == 0) {
      AttentionMask mask;
      mask.segment_ids = layout.segment_ids;
      a = attention(q, k, v, mask);
    } else {
      if (S != 1)
        throw std::invalid_argument("[llama] a KV cache holding " + std::to_string(past) +
                                    " positions takes one new position at a time, got " +
                                    std::to_string(S));
      k = cat({cache->k, k}, 1);
      v = cat({cache->v, v}, 1);
      a = attend_one_position(q, k, v);
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
          std::make_unique<Linear>(c.intermediate_size, c.hidden_size, dtype, device))) {}

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

DecoderLayer::DecoderLayer(const DecoderConfig& c, DType dtype, Device device)
    : self_attn(register_module("self_attn", std::make_unique<SelfAttention>(c, dtype, device))),
      mlp(register_module("mlp", std::make_unique<GatedMLP>(c, dtype, device))),
      input_layernorm(
          register_module("input_layernorm",
                          std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device))),
      post_attention_layernorm(register_module(
          "post_attention_layernorm",
          std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device))) {}

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
      norm(register_module(
          "norm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device))) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    layers.push_back(&layers_list.append(std::make_unique<DecoderLayer>(c, dtype, device)));
}

CausalLM::CausalLM(const DecoderConfig& c, DType dtype, Device device, uint64_t seed)
    : config(c), model(register_module("model", std::make_unique<DecoderModel>(c, dtype, device))) {
  c.validate();
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
    if (t.dim() == 1) {
      t.fill_(1.0);
    } else {
      t.copy_(
          rand_normal(t.shape(), seed, offset, DType::F32, t.device(), 0.0, c.initializer_range));
    }
    offset += 2 * static_cast<uint64_t>(t.numel());
  }
}

Tensor CausalLM::final_hidden(const Tensor& ids, KVCache* cache, const TokenLayout& layout) {
  if (ids.dim() != 2) throw std::invalid_argument("[llama] ids must be [B, S], got " + ids.str());
  const int64_t past = cache ? cache->length() : 0;
  if (past + ids.size(1) > config.max_position_embeddings)
    throw std::invalid_argument("[llama] sequence length " + std::to_string(past + ids.size(1)) +
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
