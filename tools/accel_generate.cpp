// accel-generate --model DIR [--prompt TEXT ...] [--max-new-tokens N] [--temperature T]
//                [--top-k K] [--top-p P] [--repetition-penalty R] [--seed S] [--device D]
// Samples text from a Hugging Face Llama folder or an accel-train checkpoint (a checkpoint is
// such a folder). Prompts come from --prompt, else one per line of standard input.
#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "runtime/device.h"  // cuda::available
#include "tools/cli.h"
#include "tools/trainer/generate.h"

namespace fs = std::filesystem;

namespace {

struct Usage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The tokenizer: --tokenizer, else the folder's tokenizer.json, else the data.tokenizer of the
// accel-train config.yaml saved beside the weights.
std::string tokenizer_spec(const std::string& given, const fs::path& dir) {
  if (!given.empty()) return given;
  if (fs::exists(dir / "tokenizer.json")) return (dir / "tokenizer.json").string();
  if (fs::exists(dir / "config.yaml")) {
    YAML::Node cfg = YAML::LoadFile((dir / "config.yaml").string());
    if (cfg["data"] && cfg["data"]["tokenizer"]) return cfg["data"]["tokenizer"].as<std::string>();
  }
  throw Usage("no tokenizer for " + dir.string() +
              ": the folder has no tokenizer.json or config.yaml; pass --tokenizer "
              "byte|PATH/tokenizer.json");
}

// config.json's eos_token_id (a number or a list: the first), if any.
std::optional<uint32_t> eos_token(const fs::path& dir) {
  std::ifstream f(dir / "config.json");
  nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("eos_token_id")) return std::nullopt;
  const nlohmann::json& e = j["eos_token_id"];
  if (e.is_number_unsigned()) return e.get<uint32_t>();
  if (e.is_array() && !e.empty() && e[0].is_number_unsigned()) return e[0].get<uint32_t>();
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "accel-generate: sample text from a Llama model folder or an accel-train checkpoint"};
  std::string model_dir, tokenizer, device_name = "auto";
  std::vector<std::string> prompts;
  accel::SamplingOptions o;
  o.temperature = 0.8;
  bool ignore_eos = false;
  app.add_option("--model,-m", model_dir, "Hugging Face folder or checkpoints/step_N")->required();
  app.add_option("--prompt,-p", prompts, "prompt (repeatable); default: lines of standard input");
  app.add_option("--tokenizer", tokenizer, "byte or a tokenizer.json (default: the folder's)");
  app.add_option("--max-new-tokens,-n", o.max_new_tokens, "tokens to generate per prompt")
      ->capture_default_str();
  app.add_option("--temperature,-t", o.temperature, "0 is greedy")->capture_default_str();
  app.add_option("--top-k", o.top_k, "keep the k most likely tokens (0: all)")
      ->capture_default_str();
  app.add_option("--top-p", o.top_p, "nucleus sampling (1: off)")->capture_default_str();
  app.add_option("--repetition-penalty", o.repetition_penalty, "> 1 discourages repeats")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "sampling seed")->capture_default_str();
  app.add_option("--device", device_name, "auto, cpu or cuda")->capture_default_str();
  app.add_flag("--ignore-eos", ignore_eos, "keep going after the end-of-text token");
  if (auto code = accel::parse_command_line(app, argc, argv)) return *code;
  try {
    o.validate();
    const fs::path dir(model_dir);
    if (!fs::exists(dir / "config.json"))
      throw Usage(model_dir + " has no config.json (expected a Hugging Face model folder or an " +
                  "accel-train checkpoints/step_N folder)");
    if (device_name != "auto" && device_name != "cpu" && device_name != "cuda")
      throw Usage("--device must be auto, cpu or cuda, got " + device_name);
    if (device_name == "cuda" && !accel::cuda::available())
      throw Usage("--device cuda but no CUDA device is usable here; use --device cpu");
    const bool on_gpu =
        device_name == "cuda" || (device_name == "auto" && accel::cuda::available());
    const accel::Device device = on_gpu ? accel::Device::cuda(0) : accel::Device::cpu();
    const accel::DecoderConfig mc = accel::read_hf_model_config((dir / "config.json").string());
    // bf16 on the GPU (its attention kernels), fp32 on the CPU.
    accel::CausalLM model(mc, on_gpu ? accel::DType::BF16 : accel::DType::F32, device, 0);
    accel::load_hf_weights(model, model_dir);
    std::unique_ptr<accel::Tokenizer> tok = accel::make_tokenizer(tokenizer_spec(tokenizer, dir));
    if (tok->vocab_size() > mc.vocab_size)
      throw Usage("the tokenizer (" + tok->description() + ") has more ids than the model's " +
                  "vocab_size " + std::to_string(mc.vocab_size) +
                  ": pass the tokenizer it was trained with");
    if (!ignore_eos) {
      const std::optional<uint32_t> eos = eos_token(dir);  // config.json read once
      o.stop_token = eos ? eos : tok->end_of_text_id();
    }
    std::fprintf(stderr, "accel-generate: %s, %.1fM parameters on %s, %s\n", model_dir.c_str(),
                 static_cast<double>(mc.num_parameters()) / 1e6, device.str().c_str(),
                 tok->description().c_str());
    if (prompts.empty())
      for (std::string line; std::getline(std::cin, line);) prompts.push_back(line);
    for (const std::string& prompt : prompts) {
      std::vector<uint32_t> ids = tok->encode(prompt);
      if (ids.empty()) throw Usage("the prompt '" + prompt.substr(0, 80) + "' has no tokens");
      std::cout << prompt << std::flush;
      accel::TextStream stream(*tok);
      accel::generate(model, ids, o, device, [&](uint32_t id) {
        if (o.stop_token && id == *o.stop_token) return;
        std::cout << stream.add(id) << std::flush;
      });
      std::cout << stream.finish() << "\n" << std::flush;
    }
    return 0;
  } catch (const Usage& e) {
    std::fprintf(stderr, "accel-generate: %s\n", e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "accel-generate: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-generate: error: %s\n", e.what());
    return 1;
  }
}
