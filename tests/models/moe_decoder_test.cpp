// The mixture-of-experts decoder (qwen3_moe, mixtral) without transformers: the sparse block
// against a per-token float64 loop, the load-balancing loss against its formula, gradients
// against finite differences, activation checkpointing, the Hugging Face folder round trip, the
// config.json reader's keys and refusals, the parameter counts and the class names.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>

#include "models/decoder.h"
#include "runtime/autograd.h"
#include "runtime/safetensors.h"

namespace accel {
namespace {

DecoderConfig tiny_moe(const std::string& type) {
  DecoderConfig c;
  c.model_type = type;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = type == "qwen3_moe" ? 12 : 8;
  c.vocab_size = 40;
  c.max_position_embeddings = 32;
  c.num_experts = 5;
  c.num_experts_per_tok = 2;
  if (type == "qwen3_moe") {
    c.moe_intermediate_size = 8;
    c.norm_topk_prob = true;
    c.mlp_only_layers = {1};
  }
  c.router_aux_loss_coef = 0.1;
  c.output_router_logits = true;
  return c;
}

Tensor some_ids(int64_t B, int64_t S, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < B * S; ++i)
    v.push_back(static_cast<int64_t>((seed * 2654435761u + 97 * i * i + 13 * i) % vocab));
  return Tensor::from_vector(v, {B, S});
}

// The routers draw wider than initializer_range, so that the top-k choices are far from ties.
void widen_routers(CausalLM& m, double scale) {
  NoGradGuard no_grad;
  for (Parameter* p : m.parameters())
    if (p->name.find(".gate.weight") != std::string::npos) p->value.copy_(mul(p->value, scale));
}

struct NaiveRouting {
  std::vector<double> probs;  // [N, E]
  std::vector<std::vector<int64_t>> chosen;
};

// softmax, top-k (ties to the lower index) in float64.
NaiveRouting naive_route(const std::vector<double>& x, const std::vector<double>& gw, int64_t N,
                         int64_t H, int64_t E, int64_t k) {
  NaiveRouting r;
  r.probs.assign(static_cast<size_t>(N * E), 0.0);
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> logit(E, 0.0);
    double mx = -1e300, z = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t c = 0; c < H; ++c) logit[e] += x[t * H + c] * gw[e * H + c];
      mx = std::max(mx, logit[e]);
    }
    for (int64_t e = 0; e < E; ++e) z += std::exp(logit[e] - mx);
    for (int64_t e = 0; e < E; ++e) r.probs[t * E + e] = std::exp(logit[e] - mx) / z;
    std::vector<int64_t> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t a, int64_t b) { return r.probs[t * E + a] > r.probs[t * E + b]; });
    idx.resize(static_cast<size_t>(k));
    r.chosen.push_back(idx);
  }
  return r;
}

TEST(MoeBlock, MatchesAPerTokenLoopOfTheExperts) {
  for (const char* type : {"qwen3_moe", "mixtral"}) {
    for (bool renorm : {true, false}) {
      if (std::string(type) == "mixtral" && !renorm) continue;  // Mixtral always renormalizes
      SCOPED_TRACE(std::string(type) + (renorm ? " renormalized" : " raw weights"));
      DecoderConfig c = tiny_moe(type);
      c.norm_topk_prob = renorm && c.model_type == "qwen3_moe";
      CausalLM model(c, DType::F32, Device::cpu(), 5);
      widen_routers(model, 20.0);
      SparseMoeBlock& block = *model.model.layers[0]->moe;
      const int64_t B = 2, S = 3, H = c.hidden_size, E = c.num_experts, k = 2;
      const int64_t I = c.expert_intermediate_size();
      std::vector<double> xv;
      for (int64_t i = 0; i < B * S * H; ++i) xv.push_back(std::sin(0.37 * i + 0.1));
      Tensor x = Tensor::from_vector(xv, {B, S, H});
      RouterStats stats;
      std::vector<double> got = block.forward(x, &stats).to_vector();
      const int64_t N = B * S;
      NaiveRouting r = naive_route(xv, block.gate.weight.value.to_vector(), N, H, E, k);
      std::vector<double> want(static_cast<size_t>(N * H), 0.0);
      std::vector<int64_t> counts(E, 0);
      for (int64_t t = 0; t < N; ++t) {
        double total = 0;
        for (int64_t e : r.chosen[t]) total += r.probs[t * E + e];
        for (int64_t e : r.chosen[t]) {
          ++counts[e];
          const double w = r.probs[t * E + e] / (renorm ? total : 1.0);
          GatedMLP& ex = *block.experts[e];
          const std::vector<double> g = ex.gate_proj.weight.value.to_vector(),
                                    u = ex.up_proj.weight.value.to_vector(),
                                    d = ex.down_proj.weight.value.to_vector();
          std::vector<double> act(I);
          for (int64_t i = 0; i < I; ++i) {
            double gi = 0, ui = 0;
            for (int64_t c2 = 0; c2 < H; ++c2) {
              gi += g[i * H + c2] * xv[t * H + c2];
              ui += u[i * H + c2] * xv[t * H + c2];
            }
            act[i] = gi / (1 + std::exp(-gi)) * ui;
          }
          for (int64_t h = 0; h < H; ++h) {
            double o = 0;
            for (int64_t i = 0; i < I; ++i) o += d[h * I + i] * act[i];
            want[t * H + h] += w * o;
          }
        }
      }
      ASSERT_EQ(got.size(), want.size());
      double scale = 0;
      for (double v : want) scale = std::max(scale, std::abs(v));
      ASSERT_GT(scale, 0);
      for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * scale) << i;
      EXPECT_EQ(stats.expert_counts, counts);
      EXPECT_EQ(stats.tokens, N);
      const std::vector<double> prob_sum = stats.prob_sum.to_vector();
      for (int64_t e = 0; e < E; ++e) {
        double s = 0;
        for (int64_t t = 0; t < N; ++t) s += r.probs[t * E + e];
        EXPECT_NEAR(prob_sum[e], s, 1e-5) << "expert " << e;
      }
    }
  }
}

// The router inputs of every sparse layer, captured through the gates' linear_fn.
struct GateCapture {
  std::vector<std::pair<Tensor, Tensor>> calls;  // (input rows, gate weight)
  void install(CausalLM& m) {
    for (DecoderLayer* l : m.model.layers)
      if (l->moe)
        l->moe->gate.linear_fn = [this](const Tensor& x, const Tensor& w) {
          calls.push_back({x.detach().clone(), w.detach().clone()});
          return linear(x, w);
        };
  }
};

TEST(MoeAuxLoss, IsTransformersLoadBalancingLossOverAllSparseLayers) {
  for (const char* type : {"qwen3_moe", "mixtral"}) {
    SCOPED_TRACE(type);
    DecoderConfig c = tiny_moe(type);
    CausalLM model(c, DType::F32, Device::cpu(), 7);
    widen_routers(model, 20.0);
    GateCapture cap;
    cap.install(model);
    Tensor ids = some_ids(2, 6, c.vocab_size, 3);
    Tensor targets = shift_labels(ids);
    Tensor logits = model.forward(ids);
    ASSERT_EQ(static_cast<int64_t>(cap.calls.size()), c.num_sparse_layers());
    // load_balancing_loss_func: concatenate the layers' rows, softmax, top-k one-hot, means.
    const int64_t E = c.num_experts, k = c.num_experts_per_tok, H = c.hidden_size;
    std::vector<double> slot_share(E, 0.0), prob_mean(E, 0.0);
    int64_t rows = 0;
    for (auto& [x, w] : cap.calls) {
      const int64_t N = x.numel() / H;
      NaiveRouting r = naive_route(x.to_vector(), w.to_vector(), N, H, E, k);
      for (int64_t t = 0; t < N; ++t) {
        for (int64_t e : r.chosen[t]) slot_share[e] += 1;
        for (int64_t e = 0; e < E; ++e) prob_mean[e] += r.probs[t * E + e];
      }
      rows += N;
    }
    double aux = 0;
    for (int64_t e = 0; e < E; ++e) aux += (slot_share[e] / rows) * (prob_mean[e] / rows);
    aux *= E;
    Tensor got = model.router_aux_loss();
    ASSERT_TRUE(got.defined());
    EXPECT_NEAR(got.item(), aux, 1e-5 * aux);
    // The loss adds coef x aux, in forward_loss and through add_router_aux_loss.
    const double ce = CausalLM::loss(logits, targets).item();
    EXPECT_NEAR(model.add_router_aux_loss(CausalLM::loss(logits, targets)).item(),
                ce + c.router_aux_loss_coef * aux, 1e-5);
    EXPECT_NEAR(model.forward_loss(ids, targets).item(), ce + c.router_aux_loss_coef * aux, 1e-4);
    // Without output_router_logits the loss is the cross-entropy alone (as transformers).
    DecoderConfig quiet = c;
    quiet.output_router_logits = false;
    CausalLM plain(quiet, DType::F32, Device::cpu(), 7);
    widen_routers(plain, 20.0);
    EXPECT_NEAR(plain.forward_loss(ids, targets).item(), ce, 1e-5);
    EXPECT_TRUE(plain.router_aux_loss().defined());  // still computed, just not added
  }
}

// Gradients of the whole loss (cross-entropy + coef x aux) by central differences in float64.
TEST(MoeGradients, MatchFiniteDifferences) {
  for (const char* type : {"qwen3_moe", "mixtral"}) {
    SCOPED_TRACE(type);
    DecoderConfig c = tiny_moe(type);
    c.num_hidden_layers = 2;
    c.mlp_only_layers.clear();
    c.router_aux_loss_coef = 0.5;  // large enough that the router's aux gradient shows
    CausalLM model(c, DType::F64, Device::cpu(), 11);
    widen_routers(model, 20.0);
    Tensor ids = some_ids(2, 5, c.vocab_size, 5);
    Tensor targets = shift_labels(ids);
    for (Parameter* p : model.parameters()) p->value.zero_grad();
    model.forward_loss(ids, targets).backward();
    auto loss_at = [&] {
      NoGradGuard no_grad;
      return model.forward_loss(ids, targets).item();
    };
    int checked = 0;
    for (Parameter* p : model.parameters()) {
      const bool wanted = p->name.find("gate.weight") != std::string::npos ||
                          p->name.find("experts.1.") != std::string::npos ||
                          p->name.find("q_proj") != std::string::npos ||
                          p->name.find("embed_tokens") != std::string::npos;
      if (!wanted) continue;
      ASSERT_TRUE(p->value.grad().defined()) << p->name;
      const std::vector<double> g = p->value.grad().to_vector();
      double* v = p->value.data<double>();
      const int64_t n = p->value.numel();
      for (int64_t i = 0; i < n; i += std::max<int64_t>(1, n / 6)) {
        const double orig = v[i], h = 1e-6;
        v[i] = orig + h;
        const double up = loss_at();
        v[i] = orig - h;
        const double down = loss_at();
        v[i] = orig;
        EXPECT_NEAR(g[i], (up - down) / (2 * h), 1e-6) << p->name << " element " << i;
        ++checked;
      }
    }
    EXPECT_GT(checked, 20);
  }
}

TEST(MoeCheckpointing, SameLossGradientsAndAuxAsWithout) {
  for (const char* type : {"qwen3_moe", "mixtral"}) {
    SCOPED_TRACE(type);
    DecoderConfig c = tiny_moe(type);
    CausalLM a(c, DType::F32, Device::cpu(), 9), b(c, DType::F32, Device::cpu(), 9);
    widen_routers(a, 20.0);
    widen_routers(b, 20.0);
    b.set_activation_checkpointing(ActivationCheckpointing::Full);
    Tensor ids = some_ids(2, 7, c.vocab_size, 8);
    Tensor targets = shift_labels(ids);
    Tensor la = a.forward_loss(ids, targets), lb = b.forward_loss(ids, targets);
    EXPECT_EQ(la.item(), lb.item());
    EXPECT_EQ(a.router_aux_loss().item(), b.router_aux_loss().item());
    la.backward();
    lb.backward();
    // Recomputation in backward must not add a second routing to the bookkeeping.
    EXPECT_EQ(a.router_aux_loss().item(), b.router_aux_loss().item());
    EXPECT_EQ(a.expert_counts(), b.expert_counts());
    auto pa = a.parameters(), pb = b.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_TRUE(pb[i]->value.grad().defined()) << pb[i]->name;
      const std::vector<double> ga = pa[i]->value.grad().to_vector(),
                                gb = pb[i]->value.grad().to_vector();
      for (size_t j = 0; j < ga.size(); ++j)
        ASSERT_NEAR(ga[j], gb[j], 1e-6 * (1 + std::abs(ga[j]))) << pa[i]->name;
    }
  }
}

std::string temp_dir(const std::string& tag) {
  auto d = std::filesystem::temp_directory_path() /
           ("accel_moe_" + tag + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

TEST(MoeHfFolder, SaveThenLoadRoundTripsWithPerExpertNames) {
  for (const char* type : {"qwen3_moe", "mixtral"}) {
    SCOPED_TRACE(type);
    DecoderConfig c = tiny_moe(type);
    CausalLM model(c, DType::F32, Device::cpu(), 13);
    const std::string dir = temp_dir(type);
    save_hf_model(model, c, dir);
    SafetensorsReader file(dir + "/model.safetensors");
    const bool mixtral = std::string(type) == "mixtral";
    for (const std::string& name :
         {std::string(mixtral ? "model.layers.0.block_sparse_moe.gate.weight"
                              : "model.layers.0.mlp.gate.weight"),
          std::string(mixtral ? "model.layers.2.block_sparse_moe.experts.4.w2.weight"
                              : "model.layers.2.mlp.experts.4.down_proj.weight"),
          std::string(mixtral ? "model.layers.1.block_sparse_moe.experts.0.w3.weight"
                              : "model.layers.1.mlp.gate_proj.weight")})  // qwen3: layer 1 dense
      EXPECT_TRUE(file.contains(name)) << name;
    DecoderConfig back = read_hf_model_config(dir + "/config.json");
    EXPECT_EQ(back.model_type, c.model_type);
    EXPECT_EQ(back.num_experts, c.num_experts);
    EXPECT_EQ(back.num_experts_per_tok, c.num_experts_per_tok);
    EXPECT_EQ(back.moe_intermediate_size, c.moe_intermediate_size);
    EXPECT_EQ(back.norm_topk_prob, c.norm_topk_prob);
    EXPECT_EQ(back.mlp_only_layers, c.mlp_only_layers);
    EXPECT_EQ(back.router_aux_loss_coef, c.router_aux_loss_coef);
    EXPECT_EQ(back.output_router_logits, c.output_router_logits);
    EXPECT_EQ(back.num_parameters(), c.num_parameters());
    CausalLM loaded(back, DType::F32, Device::cpu(), 99);
    load_hf_weights(loaded, dir);
    auto pa = model.parameters(), pb = loaded.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_EQ(pa[i]->name, pb[i]->name);
      EXPECT_EQ(pa[i]->value.to_vector(), pb[i]->value.to_vector()) << pa[i]->name;
    }
    std::filesystem::remove_all(dir);
  }
}

// transformers 5's fused layout (save_pretrained(save_original_format=False)): a layer's experts
// stacked into gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]; Mixtral's router
// under mlp.gate. The loader slices the experts back out.
TEST(MoeHfFolder, LoadsTransformers5FusedExperts) {
  for (const char* type : {"qwen3_moe", "mixtral"}) {
    SCOPED_TRACE(type);
    const bool mixtral = std::string(type) == "mixtral";
    DecoderConfig c = tiny_moe(type);
    CausalLM model(c, DType::F32, Device::cpu(), 21);
    const std::string dir = temp_dir(std::string("fused_") + type);
    write_hf_model_config(c, dir + "/config.json");
    std::map<std::string, Tensor> by_name;
    for (Parameter* p : model.parameters()) by_name[p->name] = p->value;
    std::vector<std::pair<std::string, Tensor>> tensors;
    const std::string block = mixtral ? ".block_sparse_moe." : ".mlp.";
    for (Parameter* p : model.parameters())
      if (p->name.find(".experts.") == std::string::npos &&
          p->name.find(block + "gate.weight") == std::string::npos)
        tensors.push_back({p->name, p->value});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      if (!c.layer_is_sparse(l)) continue;
      const std::string pre = "model.layers." + std::to_string(l);
      std::vector<Tensor> gate_up, down;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ex = pre + block + "experts." + std::to_string(e) + ".";
        gate_up.push_back(cat({by_name.at(ex + (mixtral ? "w1" : "gate_proj") + ".weight"),
                               by_name.at(ex + (mixtral ? "w3" : "up_proj") + ".weight")},
                              0));
        down.push_back(by_name.at(ex + (mixtral ? "w2" : "down_proj") + ".weight"));
      }
      tensors.push_back({pre + ".mlp.experts.gate_up_proj", contiguous(stack(gate_up, 0))});
      tensors.push_back({pre + ".mlp.experts.down_proj", contiguous(stack(down, 0))});
      tensors.push_back({pre + ".mlp.gate.weight", by_name.at(pre + block + "gate.weight")});
    }
    save_safetensors(dir + "/model.safetensors", tensors);
    CausalLM loaded(read_hf_model_config(dir + "/config.json"), DType::F32, Device::cpu(), 77);
    load_hf_weights(loaded, dir);
    auto pa = model.parameters(), pb = loaded.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_EQ(pa[i]->value.to_vector(), pb[i]->value.to_vector()) << pa[i]->name;
    std::filesystem::remove_all(dir);
  }
}

// A handwritten config.json; `edit` changes it before it is written.
std::string write_config(const std::string& dir, nlohmann::json j) {
  const std::string path = dir + "/config.json";
  std::ofstream(path) << j.dump(1);
  return path;
}

nlohmann::json qwen3_moe_json() {
  // Qwen3-30B-A3B's keys, shrunk.
  return {{"architectures", {"Qwen3MoeForCausalLM"}},
          {"model_type", "qwen3_moe"},
          {"hidden_size", 32},
          {"intermediate_size", 64},
          {"moe_intermediate_size", 16},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"vocab_size", 100},
          {"max_position_embeddings", 128},
          {"rope_theta", 1000000.0},
          {"rms_norm_eps", 1e-6},
          {"num_experts", 8},
          {"num_experts_per_tok", 2},
          {"norm_topk_prob", true},
          {"decoder_sparse_step", 2},
          {"mlp_only_layers", {3}},
          {"router_aux_loss_coef", 0.001},
          {"output_router_logits", false},
          {"use_sliding_window", false},
          {"sliding_window", nullptr},
          {"max_window_layers", 48},
          {"attention_bias", false},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false}};
}

nlohmann::json mixtral_json() {
  return {{"architectures", {"MixtralForCausalLM"}},
          {"model_type", "mixtral"},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"vocab_size", 100},
          {"max_position_embeddings", 128},
          {"rope_theta", 1000000.0},
          {"rms_norm_eps", 1e-5},
          {"num_local_experts", 8},
          {"num_experts_per_tok", 2},
          {"router_aux_loss_coef", 0.02},
          {"output_router_logits", true},
          {"router_jitter_noise", 0.0},
          {"sliding_window", nullptr},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false}};
}

TEST(MoeConfigFile, ReadsQwen3MoeAndMixtralKeys) {
  const std::string dir = temp_dir("config");
  DecoderConfig q = read_hf_model_config(write_config(dir, qwen3_moe_json()));
  EXPECT_EQ(q.model_type, "qwen3_moe");
  EXPECT_EQ(q.num_experts, 8);
  EXPECT_EQ(q.moe_intermediate_size, 16);
  EXPECT_TRUE(q.norm_topk_prob);
  EXPECT_EQ(q.decoder_sparse_step, 2);
  EXPECT_EQ(q.mlp_only_layers, (std::vector<int64_t>{3}));
  EXPECT_TRUE(q.qk_norm());
  // decoder_sparse_step 2: layers 1 and 3 would be sparse, 3 is listed dense.
  EXPECT_FALSE(q.layer_is_sparse(0));
  EXPECT_TRUE(q.layer_is_sparse(1));
  EXPECT_FALSE(q.layer_is_sparse(2));
  EXPECT_FALSE(q.layer_is_sparse(3));
  EXPECT_EQ(q.num_sparse_layers(), 1);
  CausalLM qm(q, DType::F32, Device::cpu(), 1);
  EXPECT_EQ(qm.model.layers[1]->moe->type_name(), "Qwen3MoeSparseMoeBlock");
  EXPECT_EQ(qm.model.layers[1]->type_name(), "Qwen3MoeDecoderLayer");
  EXPECT_EQ(qm.model.layers[1]->moe->experts[0]->type_name(), "Qwen3MoeMLP");
  EXPECT_EQ(qm.model.layers[0]->mlp->type_name(), "Qwen3MoeMLP");
  EXPECT_EQ(qm.type_name(), "Qwen3MoeForCausalLM");
  int64_t counted = 0;
  for (Parameter* p : qm.parameters()) counted += p->value.numel();
  EXPECT_EQ(counted, q.num_parameters());

  // transformers 5.17 writes Qwen3-MoE's expert count as num_local_experts.
  nlohmann::json q5 = qwen3_moe_json();
  q5.erase("num_experts");
  q5["num_local_experts"] = 8;
  EXPECT_EQ(read_hf_model_config(write_config(dir, q5)).num_experts, 8);

  DecoderConfig m = read_hf_model_config(write_config(dir, mixtral_json()));
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.expert_intermediate_size(), 48);
  EXPECT_TRUE(m.renormalizes_topk());
  EXPECT_TRUE(m.output_router_logits);
  EXPECT_EQ(m.router_aux_loss_coef, 0.02);
  EXPECT_EQ(m.num_sparse_layers(), 2);
  CausalLM mm(m, DType::F32, Device::cpu(), 1);
  EXPECT_EQ(mm.model.layers[0]->type_name(), "MixtralDecoderLayer");
  EXPECT_EQ(mm.model.layers[0]->moe->type_name(), "MixtralSparseMoeBlock");
  EXPECT_EQ(mm.model.layers[0]->moe->experts[0]->type_name(), "MixtralBlockSparseTop2MLP");
  counted = 0;
  for (Parameter* p : mm.parameters()) counted += p->value.numel();
  EXPECT_EQ(counted, m.num_parameters());
  // Active: attention, norms, the router and 2 of the 8 experts per layer.
  const int64_t H = 32, layer_attn = H * 8 * 2 * (4 + 2), expert = 3 * H * 48;
  EXPECT_EQ(m.num_active_parameters(),
            2 * 100 * H + H + 2 * (layer_attn + 2 * H + 8 * H + 2 * expert));
  EXPECT_EQ(m.num_parameters() - m.num_active_parameters(), 2 * 6 * expert);
  std::filesystem::remove_all(dir);
}

TEST(MoeConfigFile, RefusesWhatIsNotImplementedNamingTheKey) {
  const std::string dir = temp_dir("refuse");
  struct Case {
    nlohmann::json j;
    std::string key;
  };
  std::vector<Case> cases;
  auto with = [](nlohmann::json j, const std::string& k, nlohmann::json v) {
    j[k] = v;
    return j;
  };
  auto without = [](nlohmann::json j, const std::string& k) {
    j.erase(k);
    return j;
  };
  cases.push_back({with(mixtral_json(), "router_jitter_noise", 0.01), "router_jitter_noise"});
  cases.push_back({with(qwen3_moe_json(), "shared_expert_intermediate_size", 64),
                   "shared_expert_intermediate_size"});
  cases.push_back({with(qwen3_moe_json(), "num_experts_per_tok", 9), "num_experts_per_tok"});
  cases.push_back({with(qwen3_moe_json(), "mlp_only_layers", {7}), "mlp_only_layers"});
  cases.push_back({with(qwen3_moe_json(), "mlp_only_layers", "3"), "mlp_only_layers"});
  cases.push_back({with(qwen3_moe_json(), "use_sliding_window", true), "use_sliding_window"});
  cases.push_back({with(qwen3_moe_json(), "router_aux_loss_coef", "big"), "router_aux_loss_coef"});
  cases.push_back({without(qwen3_moe_json(), "num_experts"), "num_experts"});
  cases.push_back({with(qwen3_moe_json(), "num_local_experts", 16), "num_local_experts"});
  cases.push_back({without(mixtral_json(), "num_local_experts"), "num_local_experts"});
  cases.push_back(
      {with(with(qwen3_moe_json(), "model_type", "qwen3"), "num_experts", 8), "num_experts"});
  for (const Case& c : cases) {
    try {
      read_hf_model_config(write_config(dir, c.j));
      ADD_FAILURE() << "accepted a config with " << c.key << " = " << c.j[c.key];
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(c.key), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(MoeModelSection, YamlKeysReachTheDecoderAndBadOnesAreRefused) {
  ModelConfig m;
  m.name = "qwen3_moe";
  m.hidden_size = 32;
  m.num_attention_heads = 4;
  m.intermediate_size = 64;
  m.num_experts = 8;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 16;
  m.norm_topk_prob = true;
  m.output_router_logits = true;
  m.router_aux_loss_coef = 0.01;
  DecoderConfig c = decoder_config(m);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_TRUE(c.output_router_logits);
  ModelConfig back = model_section(c);
  EXPECT_EQ(back.num_experts, 8);
  EXPECT_EQ(back.moe_intermediate_size, 16);
  auto refused = [](ModelConfig bad, const std::string& key) {
    try {
      decoder_config(bad);
      ADD_FAILURE() << "accepted " << key;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("model: ", 0), 0u) << e.what();
    }
  };
  ModelConfig dense = m;
  dense.name = "qwen3";
  refused(dense, "num_experts");
  ModelConfig zero_experts = m;
  zero_experts.num_experts = 0;
  refused(zero_experts, "num_experts");
  ModelConfig mixtral_norm = m;
  mixtral_norm.name = "mixtral";
  mixtral_norm.moe_intermediate_size = 0;
  refused(mixtral_norm, "norm_topk_prob");
  ModelConfig no_width = m;
  no_width.moe_intermediate_size = 0;
  refused(no_width, "moe_intermediate_size");
}

// The real checkpoints' counts (total and active parameters), from their config.json shapes.
TEST(MoeParameterCounts, Qwen3_30B_A3BAndMixtral8x7B) {
  DecoderConfig q;
  q.model_type = "qwen3_moe";
  q.hidden_size = 2048;
  q.intermediate_size = 6144;
  q.moe_intermediate_size = 768;
  q.num_hidden_layers = 48;
  q.num_attention_heads = 32;
  q.num_key_value_heads = 4;
  q.head_dim = 128;
  q.vocab_size = 151936;
  q.num_experts = 128;
  q.num_experts_per_tok = 8;
  q.norm_topk_prob = true;
  q.validate();
  // Qwen's model card: 30.5B total, 3.3B activated.
  EXPECT_NEAR(q.num_parameters() / 1e9, 30.5, 0.1);
  EXPECT_NEAR(q.num_active_parameters() / 1e9, 3.3, 0.1);
  DecoderConfig m;
  m.model_type = "mixtral";
  m.hidden_size = 4096;
  m.intermediate_size = 14336;
  m.num_hidden_layers = 32;
  m.num_attention_heads = 32;
  m.num_key_value_heads = 8;
  m.head_dim = 128;
  m.vocab_size = 32000;
  m.num_experts = 8;
  m.num_experts_per_tok = 2;
  m.validate();
  // Mistral's announcement: 46.7B total, 12.9B used per token.
  EXPECT_NEAR(m.num_parameters() / 1e9, 46.7, 0.1);
  EXPECT_NEAR(m.num_active_parameters() / 1e9, 12.9, 0.1);
  // MFU counts what a token computes with.
  EXPECT_LT(m.flops_per_token(4096), 6.0 * m.num_parameters());
}

}  // namespace
}  // namespace accel
