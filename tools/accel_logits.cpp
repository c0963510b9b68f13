// accel-logits --model DIR --batch BATCH.safetensors --out LOGITS.safetensors [--device D]
// The fp32 logits of a Hugging Face folder or accel-train checkpoint for a batch of token ids,
// for comparing this runtime with another implementation of the same model
// (tools/reference/check_hf_roundtrip.py runs it beside transformers' from_pretrained).
// BATCH holds input_ids (integer [B, S]); LOGITS gets logits (F32 [B, S, vocab]).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include "models/decoder.h"
#include "runtime/device.h"
#include "runtime/safetensors.h"
#include "tools/cli.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"accel-logits: a model folder's fp32 logits for a batch of token ids"};
  std::string model_dir, batch, out, device_name = "cpu";
  app.add_option("--model,-m", model_dir, "Hugging Face folder or checkpoints/step_N")->required();
  app.add_option("--batch", batch, "safetensors file with input_ids [B, S]")->required();
  app.add_option("--out,-o", out, "safetensors file to write logits [B, S, vocab] into")
      ->required();
  app.add_option("--device", device_name, "cpu or cuda (fp32 either way)")->capture_default_str();
  if (auto code = accel::parse_command_line(app, argc, argv)) return *code;
  try {
    if (device_name != "cpu" && device_name != "cuda")
      throw std::invalid_argument("--device must be cpu or cuda, got " + device_name);
    if (device_name == "cuda" && !accel::cuda::available())
      throw std::invalid_argument("--device cuda but no CUDA device is usable here");
    const accel::Device device =
        device_name == "cuda" ? accel::Device::cuda(0) : accel::Device::cpu();
    const fs::path dir(model_dir);
    if (!fs::exists(dir / "config.json"))
      throw std::invalid_argument(model_dir + " has no config.json (expected a model folder)");
    const accel::DecoderConfig mc = accel::read_hf_model_config((dir / "config.json").string());
    accel::CausalLM model(mc, accel::DType::F32, device, 0);
    accel::load_hf_weights(model, model_dir);
    accel::SafetensorsReader reader(batch);
    if (!reader.contains("input_ids")) throw std::invalid_argument(batch + ": no tensor input_ids");
    accel::Tensor ids = reader.load("input_ids").to(device);
    accel::NoGradGuard no_grad;
    accel::Tensor logits = model.forward(ids).to(accel::Device::cpu());
    accel::save_safetensors(out, {{"logits", logits}}, {{"model", model_dir}});
    std::fprintf(stderr, "accel-logits: %s (%s) on %s: logits %s -> %s\n", model_dir.c_str(),
                 mc.hf_class("ForCausalLM").c_str(), device.str().c_str(),
                 accel::shape_str(logits.shape()).c_str(), out.c_str());
    return 0;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "accel-logits: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-logits: error: %s\n", e.what());
    return 1;
  }
}
