// The decoder against fixtures made by Hugging Face transformers for each family and option
// (tools/reference/make_hf_fixture.py; tests/data/hf/README.md): logits, loss, every parameter
// gradient, and the losses of five AdamW steps, all in fp32.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/decoder.h"
#include "ops/optimizer.h"
#include "runtime/safetensors.h"

namespace accel {
namespace {

std::string fixture_dir(const std::string& name) {
  return std::string(ACCEL_TEST_DATA_DIR) + "/hf/" + name;
}

// max |a - b| / max |b|: a relative error over the whole tensor, robust to tiny elements.
double rel_error(const Tensor& a, const Tensor& b) {
  std::vector<double> va = a.to_vector(), vb = b.to_vector();
  EXPECT_EQ(va.size(), vb.size());
  double diff = 0, ref = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    ref = std::max(ref, std::abs(vb[i]));
  }
  return diff / std::max(ref, 1e-30);
}

// (fixture, device): the same fixture on the CPU and, where one is present, on the GPU.
class DecoderFixture : public ::testing::TestWithParam<std::tuple<const char*, bool>> {};

TEST_P(DecoderFixture, LogitsLossGradientsAndAdamWMatchTransformers) {
  const std::string name = std::get<0>(GetParam());
  const std::string dir = fixture_dir(name);
  const bool on_gpu = std::get<1>(GetParam());
  if (on_gpu && !cuda::available()) GTEST_SKIP() << "no CUDA device: GPU fixture test skipped";
  ASSERT_TRUE(std::filesystem::exists(dir + "/config.json"))
      << dir << " is missing: generate it with tools/reference/make_hf_fixture.py (tests/data/hf/"
      << "README.md)";
  const Device device = on_gpu ? Device::cuda(0) : Device::cpu();
  DecoderConfig cfg = read_hf_model_config(dir + "/config.json");
  CausalLM model(cfg, DType::F32, device, /*seed=*/123);
  load_hf_weights(model, dir);

  SafetensorsReader batch(dir + "/batch.safetensors");
  SafetensorsReader expected(dir + "/expected.safetensors");
  Tensor ids = batch.load("input_ids").to(device);
  Tensor targets = shift_labels(ids);

  Tensor logits = model.forward(ids);
  EXPECT_LT(rel_error(logits, expected.load("logits")), 1e-4);
  // Mixture-of-experts fixtures: the loss includes router_aux_loss_coef x the load-balancing
  // loss, which they also hold on its own.
  ASSERT_EQ(expected.contains("aux_loss"), cfg.is_moe() && cfg.output_router_logits);
  if (expected.contains("aux_loss")) {
    Tensor aux = model.router_aux_loss();
    ASSERT_TRUE(aux.defined());
    const double want = expected.load("aux_loss").item();
    EXPECT_NEAR(aux.item(), want, 1e-4 * std::abs(want));
  }
  Tensor loss = model.add_router_aux_loss(CausalLM::loss(logits, targets));
  EXPECT_NEAR(loss.item(), expected.load("loss").item(),
              1e-4 * std::abs(expected.load("loss").item()));
  loss.backward();
  int checked = 0;
  for (Parameter* p : model.parameters()) {
    ASSERT_TRUE(expected.contains("grad." + p->name)) << p->name;
    ASSERT_TRUE(p->value.grad().defined()) << p->name << " got no gradient";
    EXPECT_LT(rel_error(p->value.grad(), expected.load("grad." + p->name)), 1e-4) << p->name;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(model.parameters().size()));

  // Five AdamW steps on the same batch, from the same initial weights.
  std::ifstream in(dir + "/train.json");
  nlohmann::json train;
  in >> train;
  load_hf_weights(model, dir);
  std::vector<Tensor> params;
  std::vector<std::string> names;
  for (Parameter* p : model.parameters()) {
    p->value.zero_grad();
    params.push_back(p->value);
    names.push_back(p->name);
  }
  const auto& o = train["optimizer"];
  OptimizerOptions opts;
  opts.beta1 = o["betas"][0];
  opts.beta2 = o["betas"][1];
  opts.eps = o["eps"];
  opts.weight_decay = o["weight_decay"];
  Optimizer opt(opts, params, names);
  for (size_t step = 0; step < train["losses_before_each_step"].size(); ++step) {
    Tensor l = model.add_router_aux_loss(CausalLM::loss(model.forward(ids), targets));
    double want = train["losses_before_each_step"][step];
    EXPECT_NEAR(l.item(), want, 1e-4) << "step " << step;
    l.backward();
    std::vector<Tensor> grads;
    for (const Tensor& p : params) grads.push_back(p.grad());
    opt.step(grads, o["lr"].get<double>());
    for (const Tensor& p : params) p.zero_grad();
  }
}

// Every fixture make_hf_fixture.py --all writes (its FIXTURES table).
INSTANTIATE_TEST_SUITE_P(
    HuggingFace, DecoderFixture,
    ::testing::Combine(::testing::Values("llama_default", "llama_tied_mha", "llama_gqa4_theta",
                                         "llama31_rope", "llama_rope_linear", "llama_rope_dynamic",
                                         "llama_rope_yarn", "qwen2_bias_tied", "qwen2_sliding",
                                         "qwen3_qknorm_head_dim", "mistral_window", "qwen3_moe",
                                         "mixtral"),
                       ::testing::Values(false, true)),
    [](const ::testing::TestParamInfo<DecoderFixture::ParamType>& info) {
      return std::string(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_cuda" : "_cpu");
    });

// Dynamic RoPE over a sequence of forwards of varying length on one instance, against the
// transformers instance make_hf_fixture.py ran them on (rope_sequence.safetensors): the logits of
// each forward and the frequency state after it (tests/models/dynamic_rope_test.cpp checks the
// rule by hand).
TEST(DecoderFixtureDynamicRope, SequenceOfForwardsMatchesTransformers) {
  const std::string dir = fixture_dir("llama_rope_dynamic");
  const std::string file = dir + "/rope_sequence.safetensors";
  if (!std::filesystem::exists(file))
    GTEST_SKIP() << file << " is not there yet: make it with python3 "
                 << "tools/reference/make_hf_fixture.py llama_rope_dynamic (needs transformers)";
  DecoderConfig cfg = read_hf_model_config(dir + "/config.json");
  CausalLM model(cfg, DType::F32, Device::cpu(), /*seed=*/123);
  load_hf_weights(model, dir);
  SafetensorsReader batch(dir + "/batch.safetensors");
  SafetensorsReader seq(file);
  const Tensor ids = batch.load("input_ids");
  const std::vector<double> lengths = seq.load("lengths").to_vector(),
                            cached = seq.load("max_seq_len_cached").to_vector();
  NoGradGuard no_grad;
  for (size_t k = 0; k < lengths.size(); ++k) {
    const int64_t n = static_cast<int64_t>(lengths[k]);
    SCOPED_TRACE("forward " + std::to_string(k) + " of length " + std::to_string(n));
    const Tensor logits = model.forward(contiguous(narrow(ids, 1, 0, n)));
    EXPECT_LT(rel_error(logits, seq.load("logits." + std::to_string(k))), 1e-4);
    if (cached[k] >= 0) {
      EXPECT_EQ(model.dynamic_rope_max_seq_len_cached(), cached[k]);
    }
    const std::vector<double> want = seq.load("inv_freq." + std::to_string(k)).to_vector();
    const std::vector<float>& got =
        model.model.layers[0]->self_attn.dynamic_rope()->current().inv_freq;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)  // float32 pow: libm and torch may differ by an ulp
      EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << "inv_freq " << i;
  }
}

TEST(LlamaConfigFile, RopeThetaFromEitherSpelling) {
  DecoderConfig c = read_hf_model_config(fixture_dir("llama_gqa4_theta") + "/config.json");
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 2);
}

TEST(LlamaWeights, ShapeMismatchNamesTensorAndBothShapes) {
  DecoderConfig cfg = read_hf_model_config(fixture_dir("llama_default") + "/config.json");
  cfg.intermediate_size = 96;
  CausalLM model(cfg, DType::F32, Device::cpu(), 0);
  try {
    load_hf_weights(model, fixture_dir("llama_default"));
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("model.layers.0.mlp.gate_proj.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("[128, 64]"), std::string::npos) << m;
    EXPECT_NE(m.find("[96, 64]"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace accel

namespace accel {
namespace {

// A Hugging Face folder sharded into two files with model.safetensors.index.json loads to the
// same weights as the single file.
TEST(LlamaWeights, ShardedIndexLoadsLikeTheSingleFile) {
  namespace fs = std::filesystem;
  const std::string src = fixture_dir("llama_default");
  fs::path dir = fs::temp_directory_path() / ("accel_sharded_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(src + "/config.json", dir / "config.json");
  SafetensorsReader whole(src + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> a, b;
  nlohmann::json index = {{"metadata", {{"total_size", 0}}},
                          {"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (const std::string& n : whole.names()) {
    bool first = i++ % 2 == 0;
    (first ? a : b).push_back({n, whole.load(n)});
    index["weight_map"][n] =
        first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  save_safetensors((dir / "model-00001-of-00002.safetensors").string(), a);
  save_safetensors((dir / "model-00002-of-00002.safetensors").string(), b);
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();

  DecoderConfig cfg = read_hf_model_config(src + "/config.json");
  CausalLM from_index(cfg, DType::F32, Device::cpu(), 1),
      from_file(cfg, DType::F32, Device::cpu(), 2);
  load_hf_weights(from_index, dir.string());
  load_hf_weights(from_file, src);
  auto pa = from_index.parameters(), pb = from_file.parameters();
  for (size_t k = 0; k < pa.size(); ++k)
    EXPECT_EQ(pa[k]->value.to_vector(), pb[k]->value.to_vector()) << pa[k]->name;
  // A weight_map entry pointing at a missing file names it.
  index["weight_map"][whole.names()[0]] = "model-missing.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  try {
    load_hf_weights(from_index, dir.string());
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model-missing.safetensors"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace accel
