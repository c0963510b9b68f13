#include "models/llama.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "runtime/safetensors.h"

namespace accel {
namespace fs = std::filesystem;

void LlamaConfig::validate() const {
  auto fail = [](const std::string& m) { throw std::invalid_argument("llama config: " + m); };
  if (hidden_size <= 0 || intermediate_size <= 0 || num_hidden_layers <= 0 || vocab_size <= 0)
    fail("hidden_size, intermediate_size, num_hidden_layers and vocab_size must be positive");
  if (num_attention_heads <= 0 || num_key_value_heads <= 0)
    fail("num_attention_heads and num_key_value_heads must be positive");
  if (num_attention_heads % num_key_value_heads != 0)
    fail("num_attention_heads (" + std::to_string(num_attention_heads) +
         ") must be a multiple of num_key_value_heads (" + std::to_string(num_key_value_heads) +
         ")");
  if (head_dim <= 0 || head_dim % 2 != 0) fail("head_dim must be positive and even for RoPE");
}

int64_t LlamaConfig::num_parameters() const {
  int64_t attn = hidden_size * head_dim * (2 * num_attention_heads + 2 * num_key_value_heads);
  int64_t mlp = 3 * hidden_size * intermediate_size;
  int64_t layer = attn + mlp + 2 * hidden_size;
  int64_t emb = vocab_size * hidden_size;
  return emb * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + hidden_size;
}

double LlamaConfig::flops_per_token(int64_t seq_len) const {
  // Same formula as the PyTorch reference (tools/reference/llama_shapes.py; docs/algorithms.md).
  double matmul_params = static_cast<double>(num_parameters() - vocab_size * hidden_size);
  if (tie_word_embeddings) matmul_params += static_cast<double>(vocab_size * hidden_size);
  return 6.0 * matmul_params +
         12.0 * static_cast<double>(num_hidden_layers * seq_len * hidden_size);
}

LlamaConfig read_hf_llama_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open Hugging Face config.json");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": not valid JSON (" + e.what() + ")");
  }
  auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) throw std::runtime_error(path + ": missing required field '" + key + "'");
    return j[key];
  };
  try {
    if (j.contains("model_type") && j["model_type"] != "llama")
      throw std::runtime_error(path + ": model_type is " + j["model_type"].dump() +
                               ", only \"llama\" is supported");
    LlamaConfig c;
    c.hidden_size = need("hidden_size").get<int64_t>();
    c.intermediate_size = need("intermediate_size").get<int64_t>();
    c.num_hidden_layers = need("num_hidden_layers").get<int64_t>();
    c.num_attention_heads = need("num_attention_heads").get<int64_t>();
    c.num_key_value_heads = j.value("num_key_value_heads", c.num_attention_heads);
    if (j.contains("num_key_value_heads") && j["num_key_value_heads"].is_null())
      c.num_key_value_heads = c.num_attention_heads;
    c.vocab_size = need("vocab_size").get<int64_t>();
    c.head_dim = c.hidden_size / c.num_attention_heads;
    if (j.contains("head_dim") && !j["head_dim"].is_null()) c.head_dim = j["head_dim"];
    c.max_position_embeddings = j.value("max_position_embeddings", int64_t{2048});
    c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
    c.initializer_range = j.value("initializer_range", 0.02);
    c.tie_word_embeddings = j.value("tie_word_embeddings", false);
    if (j.contains("rope_theta")) {
      c.rope_theta = j["rope_theta"].get<double>();
    } else if (j.contains("rope_parameters") && j["rope_parameters"].contains("rope_theta")) {
      const auto& rp = j["rope_parameters"];
      std::string type = rp.value("rope_type", std::string("default"));
      if (type != "default")
        throw std::runtime_error(path + ": rope_parameters.rope_type '" + type +
                                 "' is not supported (only 'default')");
      c.rope_theta = rp["rope_theta"].get<double>();
    }
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
      throw std::runtime_error(path + ": rope_scaling is not supported yet (found " +
                               j["rope_scaling"].dump() + ")");
    if (j.value("attention_bias", false) || j.value("mlp_bias", false))
      throw std::runtime_error(path + ": attention_bias/mlp_bias are not supported");
    c.validate();
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": a field has the wrong type (" + e.what() + ")");
  }
}

void write_hf_llama_config(const LlamaConfig& c, const std::string& path,
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

LlamaAttention::LlamaAttention(const LlamaConfig& c, DType dtype, Device device)
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

Tensor LlamaAttention::forward(const Tensor& x, KVCache::Layer* cache) {
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
    q = rope(q, config.rope_theta, past);
    k = rope(k, config.rope_theta, past);
    Tensor a;
    if (past == 0) {
      a = attention(q, k, v, /*causal=*/true);
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

LlamaMLP::LlamaMLP(const LlamaConfig& c, DType dtype, Device device)
    : gate_proj(register_module(
          "gate_proj",
          std::make_unique<Linear>(c.hidden_size, c.intermediate_size, dtype, device))),
      up_proj(register_module(
          "up_proj", std::make_unique<Linear>(c.hidden_size, c.intermediate_size, dtype, device))),
      down_proj(register_module(
          "down_proj",
          std::make_unique<Linear>(c.intermediate_size, c.hidden_size, dtype, device))) {}

Tensor LlamaMLP::forward(const Tensor& x) {
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

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& c, DType dtype, Device device)
    : self_attn(register_module("self_attn", std::make_unique<LlamaAttention>(c, dtype, device))),
      mlp(register_module("mlp", std::make_unique<LlamaMLP>(c, dtype, device))),
      input_layernorm(
          register_module("input_layernorm",
                          std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device))),
      post_attention_layernorm(register_module(
          "post_attention_layernorm",
          std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device))) {}

Tensor LlamaDecoderLayer::forward(const Tensor& x, KVCache::Layer* cache) {
  return with_forward_hooks(*this, [&] {
    // h = x + attn(norm(x)); the residual add is fused into the post-attention norm.
    auto [h, normed] = post_attention_layernorm.add_forward(
        x, self_attn.forward(input_layernorm.forward(x), cache));
    return add(h, mlp.forward(normed));
  });
}

LlamaModel::LlamaModel(const LlamaConfig& c, DType dtype, Device device)
    : embed_tokens(register_module(
          "embed_tokens", std::make_unique<Embedding>(c.vocab_size, c.hidden_size, dtype, device))),
      layers_list(register_module("layers", std::make_unique<ModuleList>())),
      norm(register_module(
          "norm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, dtype, device))) {
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    layers.push_back(&layers_list.append(std::make_unique<LlamaDecoderLayer>(c, dtype, device)));
}

LlamaForCausalLM::LlamaForCausalLM(const LlamaConfig& c, DType dtype, Device device, uint64_t seed)
    : config(c), model(register_module("model", std::make_unique<LlamaModel>(c, dtype, device))) {
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

Tensor LlamaForCausalLM::forward(const Tensor& ids, KVCache* cache) {
  if (ids.dim() != 2) throw std::invalid_argument("[llama] ids must be [B, S], got " + ids.str());
  const int64_t past = cache ? cache->length() : 0;
  if (past + ids.size(1) > config.max_position_embeddings)
    throw std::invalid_argument("[llama] sequence length " + std::to_string(past + ids.size(1)) +
                                " exceeds max_position_embeddings " +
                                std::to_string(config.max_position_embeddings));
  if (cache) cache->layers.resize(model.layers.size());
  return with_forward_hooks(*this, [&] {
    Tensor x = model.embed_tokens.forward(ids);
    for (size_t i = 0; i < model.layers.size(); ++i) {
      LlamaDecoderLayer* layer = model.layers[i];
      if (cache) {
        x = layer->forward(x, &cache->layers[i]);
      } else if (checkpoint_layers_) {
        x = checkpoint([layer](const std::vector<Tensor>& in) { return layer->forward(in[0]); },
                       {x});
      } else {
        x = layer->forward(x);
      }
    }
    x = model.norm.forward(x);
    if (lm_head) return lm_head->forward(x);
    return linear(x, model.embed_tokens.weight.value);
  });
}

Tensor LlamaForCausalLM::loss(const Tensor& logits, const Tensor& targets) {
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
    std::ifstream in(index);
    nlohmann::json j;
    try {
      in >> j;
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

void save_hf_model(Module& model, const LlamaConfig& config, const std::string& dir) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  DType dtype = DType::F32;
  for (Parameter* p : model.parameters()) {
    tensors.push_back({p->name, p->value});
    dtype = p->value.dtype();
  }
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  write_hf_llama_config(config, (fs::path(dir) / "config.json").string(),
                        dtype == DType::BF16  ? "bfloat16"
                        : dtype == DType::F16 ? "float16"
                                              : "float32");
}

}  // namespace accel
