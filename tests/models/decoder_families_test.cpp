// The decoder's family options without transformers at hand: RoPE scaling rules against their
// defining properties, config.json refusals, Hugging Face names of parameters and modules, the
// round trip through save_hf_model, per-token positions, and the KV cache under a sliding window.
// (The numbers against transformers itself: decoder_fixture_test.cpp.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "models/decoder.h"
#include "models/rope_scaling.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

using testing::error_of;

// A tiny model of `family` with that family's options switched on.
DecoderConfig tiny(const std::string& family) {
  DecoderConfig c;
  c.model_type = family;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 64;
  c.max_position_embeddings = 64;
  if (family == "llama") {
    c.rope_theta = 500000;
    c.rope_scaling.rope_type = "llama3";
    c.rope_scaling.factor = 8;
    c.rope_scaling.low_freq_factor = 1;
    c.rope_scaling.high_freq_factor = 4;
    c.rope_scaling.original_max_position_embeddings = 16;
  } else if (family == "qwen2") {
    c.tie_word_embeddings = true;
    c.use_sliding_window = true;
    c.sliding_window = 3;
    c.max_window_layers = 1;
  } else if (family == "qwen3") {
    c.head_dim = 16;  // not hidden / heads
    c.attention_bias = true;
    c.rope_scaling.rope_type = "yarn";
    c.rope_scaling.factor = 4;
    c.rope_scaling.original_max_position_embeddings = 16;
  } else if (family == "mistral") {
    c.sliding_window = 4;
  }
  return c;
}

void expect_same_config(const DecoderConfig& a, const DecoderConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_TRUE(a.rope_scaling == b.rope_scaling)
      << a.rope_scaling.to_json().dump() << " vs " << b.rope_scaling.to_json().dump();
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.initializer_range, b.initializer_range);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.use_sliding_window, b.use_sliding_window);
  EXPECT_EQ(a.max_window_layers, b.max_window_layers);
  EXPECT_EQ(a.layer_types, b.layer_types);
  for (int64_t i = 0; i < a.num_hidden_layers; ++i) EXPECT_EQ(a.layer_window(i), b.layer_window(i));
}

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / (name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// ---- RoPE scaling ----------------------------------------------------------------------------

TEST(RopeScaling, LinearDividesTheDefaultFrequencies) {
  RopeScaling s;
  s.rope_type = "linear";
  s.factor = 2.5;
  const RopeFrequencies d = default_rope_frequencies(10000, 16);
  const RopeFrequencies f = rope_frequencies(s, 10000, 16, 64, 64);
  for (size_t i = 0; i < d.inv_freq.size(); ++i) EXPECT_EQ(f.inv_freq[i], d.inv_freq[i] / 2.5f);
  EXPECT_EQ(f.attention_scaling, 1.0);
}

TEST(RopeScaling, Llama3KeepsHighDividesLowAndSmoothsBetween) {
  // Llama 3.2's values with an original context of 64: wavelengths below 16 stay, above 64 are
  // divided by 32, and the band between is interpolated (head_dim 16 spans all three).
  RopeScaling s;
  s.rope_type = "llama3";
  s.factor = 32;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position_embeddings = 64;
  const double theta = 500000;
  const RopeFrequencies d = default_rope_frequencies(theta, 16);
  const RopeFrequencies f = rope_frequencies(s, theta, 16, 256, 256);
  int kept = 0, divided = 0, smoothed = 0;
  for (size_t i = 0; i < d.inv_freq.size(); ++i) {
    const double wavelen = 2 * M_PI / d.inv_freq[i];
    if (wavelen < 16) {
      EXPECT_EQ(f.inv_freq[i], d.inv_freq[i]) << i;
      ++kept;
    } else if (wavelen > 64) {
      EXPECT_EQ(f.inv_freq[i], d.inv_freq[i] / 32.0f) << i;
      ++divided;
    } else {
      const double smooth = (64 / wavelen - 1) / (4 - 1);
      EXPECT_NEAR(f.inv_freq[i], (1 - smooth) * d.inv_freq[i] / 32 + smooth * d.inv_freq[i],
                  1e-6 * d.inv_freq[i])
          << i;
      ++smoothed;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(smoothed, 0);
}

TEST(RopeScaling, YarnRampsFromExtrapolationToInterpolationAndScalesAttention) {
  RopeScaling s;
  s.rope_type = "yarn";
  s.factor = 4;
  s.original_max_position_embeddings = 16;
  const double theta = 10000;
  const int64_t dim = 16;
  const RopeFrequencies d = default_rope_frequencies(theta, dim);
  const RopeFrequencies f = rope_frequencies(s, theta, dim, 64, 64);
  EXPECT_NEAR(f.attention_scaling, 0.1 * std::log(4.0) + 1.0, 1e-15);
  // The correction range from beta_fast 32 and beta_slow 1, floored and ceiled.
  auto corr = [&](double rot) {
    return dim * std::log(16 / (rot * 2 * M_PI)) / (2 * std::log(theta));
  };
  const double low = std::max(0.0, std::floor(corr(32))), high = std::min(15.0, std::ceil(corr(1)));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double ramp = std::min(1.0, std::max(0.0, (i - low) / (high - low)));
    const double want = d.inv_freq[i] / 4 * ramp + d.inv_freq[i] * (1 - ramp);
    EXPECT_NEAR(f.inv_freq[i], want, 1e-6 * d.inv_freq[i]) << i;
  }
  EXPECT_EQ(f.inv_freq[0], d.inv_freq[0]);  // the fastest dimension is not interpolated
  // An explicit attention_factor wins; mscale / mscale_all_dim give their ratio.
  s.attention_factor = 0.5;
  EXPECT_EQ(rope_frequencies(s, theta, dim, 64, 64).attention_scaling, 0.5);
  s.attention_factor = 0;
  s.mscale = 2;
  s.mscale_all_dim = 1;
  EXPECT_NEAR(rope_frequencies(s, theta, dim, 64, 64).attention_scaling,
              (0.2 * std::log(4.0) + 1) / (0.1 * std::log(4.0) + 1), 1e-15);
}

TEST(RopeScaling, DynamicRaisesTheBaseOnlyPastMaxPositions) {
  RopeScaling s;
  s.rope_type = "dynamic";
  s.factor = 2;
  const RopeFrequencies d = default_rope_frequencies(10000, 8);
  const RopeFrequencies within = rope_frequencies(s, 10000, 8, 32, 20);
  EXPECT_EQ(within.inv_freq, d.inv_freq);
  const RopeFrequencies longer = rope_frequencies(s, 10000, 8, 32, 64);
  const double base = 10000 * std::pow(2.0 * 64 / 32 - 1, 8.0 / 6.0);
  for (size_t i = 0; i < d.inv_freq.size(); ++i)
    EXPECT_NEAR(longer.inv_freq[i], std::pow(base, -2.0 * i / 8), 1e-6 * d.inv_freq[i]) << i;
  // The model accepts sequences past max_position_embeddings with dynamic scaling only.
  DecoderConfig c = tiny("llama");
  c.rope_scaling = s;
  c.max_position_embeddings = 4;
  CausalLM m(c, DType::F32, Device::cpu(), 1);
  EXPECT_NO_THROW(m.forward(Tensor::zeros({1, 6}, DType::I64)));
  c.rope_scaling = RopeScaling();
  CausalLM plain(c, DType::F32, Device::cpu(), 1);
  EXPECT_NE(error_of([&] {
              plain.forward(Tensor::zeros({1, 6}, DType::I64));
            }).find("exceeds max_position_embeddings"),
            std::string::npos);
}

// ---- config.json ------------------------------------------------------------------------------

nlohmann::json qwen3_json() {
  return {{"model_type", "qwen3"},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"vocab_size", 64},
          {"max_position_embeddings", 64},
          {"rope_theta", 1000000.0},
          {"rope_scaling", nullptr},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", true}};
}

std::string read_error(const nlohmann::json& j) {
  const fs::path d = temp_dir("accel_cfg");
  std::ofstream(d / "config.json") << j.dump();
  std::string e = error_of([&] { read_hf_model_config((d / "config.json").string()); });
  fs::remove_all(d);
  return e;
}

TEST(HfConfigFile, UnsupportedFamiliesAndOptionsAreRefusedNamingTheKey) {
  EXPECT_EQ(read_error(qwen3_json()), "");
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* says;
  };
  const Case cases[] = {
      {"model_type", "gemma2", "model_type \"gemma2\" is not supported"},
      {"hidden_act", "gelu", "hidden_act \"gelu\" is not supported"},
      {"mlp_bias", true, "mlp_bias true is not supported"},
      {"attention_dropout", 0.1, "attention_dropout 0.1 is not supported"},
      {"partial_rotary_factor", 0.5, "partial_rotary_factor 0.5"},
      {"rope_scaling",
       {{"rope_type", "longrope"}, {"long_factor", {1.0}}},
       "rope_type 'longrope' is not supported"},
      {"rope_scaling", {{"type", "su"}}, "rope_type 'su' is not supported"},
      {"rope_scaling",
       {{"rope_type", "linear"}, {"factor", 2}, {"low_freq_factor", 1}},
       "key 'low_freq_factor' is not part of rope_type linear"},
      {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8}}, "needs original_max_position"},
      {"rope_parameters",
       {{"rope_type", "dynamic"}, {"rope_theta", 5.0}, {"factor", 2.0}},
       "disagree"},  // beside a top-level rope_theta 1e6
      {"layer_types", {"full_attention", "chunked_attention"}, "not a layer type"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = qwen3_json();
    j[c.key] = c.value;
    if (std::string(c.key) == "layer_types") {
      j["use_sliding_window"] = true;
      j["sliding_window"] = 4;
    }
    const std::string e = read_error(j);
    EXPECT_NE(e.find(c.says), std::string::npos) << c.key << ": " << e;
  }
  // q/k layer norms on a family without them; attention_bias on mistral.
  nlohmann::json j = qwen3_json();
  j["model_type"] = "llama";
  j["use_qk_norm"] = true;
  EXPECT_NE(read_error(j).find("use_qk_norm true is not supported for llama"), std::string::npos);
  j = qwen3_json();
  j["model_type"] = "mistral";
  j["attention_bias"] = true;
  EXPECT_NE(read_error(j).find("attention_bias true is not supported for mistral"),
            std::string::npos);
}

TEST(HfConfigFile, BothRopeSpellingsReadAlike) {
  nlohmann::json old_style = qwen3_json(), new_style = qwen3_json();
  old_style["rope_scaling"] = {
      {"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}};
  new_style.erase("rope_theta");
  new_style.erase("rope_scaling");
  new_style["rope_parameters"] = {{"rope_type", "yarn"},
                                  {"factor", 4.0},
                                  {"original_max_position_embeddings", 16},
                                  {"rope_theta", 1000000.0}};
  const fs::path d = temp_dir("accel_rope_spellings");
  std::ofstream(d / "a.json") << old_style.dump();
  std::ofstream(d / "b.json") << new_style.dump();
  const DecoderConfig a = read_hf_model_config((d / "a.json").string());
  const DecoderConfig b = read_hf_model_config((d / "b.json").string());
  fs::remove_all(d);
  EXPECT_EQ(a.rope_scaling.rope_type, "yarn");
  EXPECT_EQ(a.rope_theta, 1000000.0);
  expect_same_config(a, b);
}

TEST(HfConfigFile, SlidingWindowLayersFollowEachFamilysRule) {
  DecoderConfig q = tiny("qwen2");  // window 3 from layer 1 on
  EXPECT_EQ(q.layer_window(0), 0);
  EXPECT_EQ(q.layer_window(1), 3);
  q.use_sliding_window = false;
  q.sliding_window = 0;
  EXPECT_EQ(q.layer_window(1), 0);
  q.sliding_window = 5;
  q.layer_types = {"sliding_attention", "full_attention"};
  EXPECT_EQ(q.layer_window(0), 5);
  EXPECT_EQ(q.layer_window(1), 0);
  const DecoderConfig m = tiny("mistral");
  EXPECT_EQ(m.layer_window(0), 4);
  EXPECT_EQ(m.layer_window(1), 4);
  DecoderConfig l = tiny("llama");
  l.sliding_window = 4;
  EXPECT_NE(error_of([&] { l.validate(); }).find("llama has no sliding-window attention"),
            std::string::npos);
  // Qwen2's use_sliding_window false drops the window, as Hugging Face's config does.
  nlohmann::json j = qwen3_json();
  j["model_type"] = "qwen2";
  j.erase("head_dim");
  j["sliding_window"] = 4096;
  j["use_sliding_window"] = false;
  j["max_window_layers"] = 1;
  const fs::path d = temp_dir("accel_qwen2_window");
  std::ofstream(d / "config.json") << j.dump();
  const DecoderConfig r = read_hf_model_config((d / "config.json").string());
  fs::remove_all(d);
  EXPECT_EQ(r.layer_window(0), 0);
  EXPECT_EQ(r.layer_window(1), 0);
}

// ---- modules and names --------------------------------------------------------------------------

TEST(DecoderFamilies, ModulesCarryTheFamilysHuggingFaceNames) {
  struct Want {
    const char* family;
    const char* layer;
    std::set<std::string> extra;  // parameters beyond Llama's
  };
  const Want wants[] = {
      {"llama", "LlamaDecoderLayer", {}},
      {"qwen2",
       "Qwen2DecoderLayer",
       {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias"}},
      {"qwen3",
       "Qwen3DecoderLayer",
       {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias"}},
      {"mistral", "MistralDecoderLayer", {}},
  };
  for (const Want& w : wants) {
    const DecoderConfig c = tiny(w.family);
    CausalLM m(c, DType::F32, Device::cpu(), 3);
    EXPECT_EQ(m.model.layers[0]->type_name(), w.layer);
    EXPECT_EQ(m.type_name(), c.hf_class("ForCausalLM"));
    EXPECT_EQ(m.model.layers[0]->self_attn.type_name(), c.hf_class("Attention"));
    EXPECT_EQ(m.model.norm.type_name(), c.hf_class("RMSNorm"));
    std::set<std::string> names;
    int64_t count = 0;
    for (Parameter* p : m.parameters()) {
      names.insert(p->name);
      count += p->value.numel();
      // Biases start at zero, norms at one (Hugging Face's _init_weights).
      if (p->name.find(".bias") != std::string::npos) {
        for (double v : p->value.to_vector()) EXPECT_EQ(v, 0.0) << p->name;
      }
    }
    for (const std::string& n : w.extra) EXPECT_TRUE(names.count(n)) << w.family << ": " << n;
    EXPECT_EQ(names.count("lm_head.weight"), c.tie_word_embeddings ? 0u : 1u) << w.family;
    EXPECT_EQ(count, c.num_parameters()) << w.family;
    if (c.model_type == "qwen3") {
      EXPECT_EQ(m.model.layers[0]->self_attn.q_norm->weight.value.numel(), c.head_dim);
    }
  }
}

TEST(DecoderFamilies, SaveHfModelReadsBackEqual) {
  for (const char* family : {"llama", "qwen2", "qwen3", "mistral"}) {
    SCOPED_TRACE(family);
    const DecoderConfig c = tiny(family);
    CausalLM m(c, DType::F32, Device::cpu(), 7);
    const fs::path d = temp_dir(std::string("accel_roundtrip_") + family);
    save_hf_model(m, c, d.string());
    const nlohmann::json j = nlohmann::json::parse(std::ifstream(d / "config.json"));
    EXPECT_EQ(j["model_type"], family);
    EXPECT_EQ(j["architectures"][0], c.hf_class("ForCausalLM"));
    // RoPE in both spellings.
    EXPECT_EQ(j["rope_theta"], c.rope_theta);
    EXPECT_EQ(j["rope_parameters"]["rope_theta"], c.rope_theta);
    EXPECT_EQ(j["rope_parameters"]["rope_type"], c.rope_scaling.rope_type);
    if (c.rope_scaling.is_default()) {
      EXPECT_TRUE(j["rope_scaling"].is_null());
    } else {
      EXPECT_EQ(j["rope_scaling"]["rope_type"], c.rope_scaling.rope_type);
    }
    const DecoderConfig back = read_hf_model_config((d / "config.json").string());
    expect_same_config(c, back);
    CausalLM loaded(back, DType::F32, Device::cpu(), 8);
    load_hf_weights(loaded, d.string());
    auto pa = m.parameters(), pb = loaded.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t k = 0; k < pa.size(); ++k) {
      EXPECT_EQ(pa[k]->name, pb[k]->name);
      EXPECT_EQ(pa[k]->value.to_vector(), pb[k]->value.to_vector()) << pa[k]->name;
    }
    fs::remove_all(d);
  }
}

TEST(DecoderFamilies, ModelSectionRoundTrip) {
  for (const char* family : {"llama", "qwen2", "qwen3", "mistral"}) {
    SCOPED_TRACE(family);
    const DecoderConfig c = tiny(family);
    expect_same_config(decoder_config(model_section(c)), c);
  }
  ModelConfig m;
  m.name = "mistral";
  m.attention_bias = true;
  EXPECT_NE(error_of([&] { decoder_config(m); }).find("attention_bias"), std::string::npos);
}

// ---- positions and the KV cache ---------------------------------------------------------------

TEST(DecoderFamilies, PositionIdsShiftedByAConstantGiveTheSameLogits) {
  // RoPE attention depends on relative positions only: every token moved by 7 positions gives the
  // same logits and gradients (up to rounding) as positions 0 .. S-1.
  const DecoderConfig c = tiny("qwen3");
  CausalLM m(c, DType::F32, Device::cpu(), 11);
  const int64_t B = 2, S = 6;
  std::vector<int64_t> ids, shifted;
  for (int64_t i = 0; i < B * S; ++i) {
    ids.push_back((i * 7 + 3) % c.vocab_size);
    shifted.push_back(i % S + 7);
  }
  Tensor x = Tensor::from_vector(ids, {B, S}, DType::I64);
  TokenLayout layout;
  layout.position_ids = Tensor::from_vector(shifted, {B, S}, DType::I64);
  Tensor plain = m.forward(x), moved = m.forward(x, nullptr, layout);
  std::vector<double> a = plain.to_vector(), b = moved.to_vector();
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    ref = std::max(ref, std::abs(a[i]));
  }
  EXPECT_LT(diff, 1e-5 * ref);
  // ... and they do enter the model: positions 0, 2, 4, ... differ.
  for (int64_t i = 0; i < B * S; ++i) shifted[i] = 2 * (i % S);
  layout.position_ids = Tensor::from_vector(shifted, {B, S}, DType::I64);
  std::vector<double> spread = m.forward(x, nullptr, layout).to_vector();
  double change = 0;
  for (size_t i = 0; i < a.size(); ++i) change = std::max(change, std::abs(a[i] - spread[i]));
  EXPECT_GT(change, 1e-3 * ref);
}

TEST(DecoderFamilies, KvCacheGenerationMatchesTheFullForwardUnderAWindow) {
  // Mistral with a window of 4 over 9 positions: one token at a time through the cache gives the
  // full forward's logits at every position (attend_one_position keeps the last 4 keys).
  for (const char* family : {"mistral", "qwen2"}) {
    SCOPED_TRACE(family);
    const DecoderConfig c = tiny(family);
    CausalLM m(c, DType::F32, Device::cpu(), 5);
    const int64_t S = 9;
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < S; ++i) ids.push_back((i * 11 + 2) % c.vocab_size);
    NoGradGuard no_grad;
    const std::vector<double> full =
        m.forward(Tensor::from_vector(ids, {1, S}, DType::I64)).to_vector();
    KVCache cache;
    for (int64_t t = 0; t < S; ++t) {
      const std::vector<double> step =
          m.forward(Tensor::from_vector(std::vector<int64_t>{ids[t]}, {1, 1}, DType::I64), &cache)
              .to_vector();
      for (int64_t v = 0; v < c.vocab_size; ++v)
        ASSERT_NEAR(step[v], full[t * c.vocab_size + v], 1e-4) << "position " << t;
    }
  }
}

}  // namespace
}  // namespace accel
