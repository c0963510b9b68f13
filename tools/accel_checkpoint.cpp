// accel-checkpoint consolidate CKPT_DIR OUT_DIR [--dtype fp32|bf16|fp16]
//
// Turns a training checkpoint (checkpoints/step_N written by accel-train) into a Hugging Face
// model folder: OUT_DIR/model.safetensors + config.json, which transformers loads and which
// accel-train takes as model.init_from at any world size. For a sharded checkpoint (ZeRO and FSDP:
// the manifest in trainer_state.json "extra" and the fp32 master shards "group<i>.master" in every
// rank's optimizer.rank<R>.safetensors) the weights are rebuilt from the shards through the
// manifest's layout (ZeRO's contiguous chunks or FSDP's dim-0 rows); otherwise the checkpoint's
// model.safetensors is converted.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "models/decoder.h"
#include "parallel/sharding.h"
#include "runtime/json.h"
#include "runtime/safetensors.h"
#include "tools/cli.h"
#include "tools/trainer/model_folder.h"

namespace fs = std::filesystem;

namespace accel {
namespace {

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error(p.string() + ": cannot open (is this a checkpoint folder?)");
  try {
    return read_json_file(p.string());
  } catch (const JsonError& e) {
    throw std::runtime_error(e.what());
  }
}

using Named = std::vector<std::pair<std::string, Tensor>>;

// Weights rebuilt from every rank's master chunks.
Named from_shards(const fs::path& dir, const nlohmann::json& manifest, int world) {
  const fs::path state_file = dir / "trainer_state.json";
  std::vector<std::unique_ptr<SafetensorsReader>> ranks;
  for (int r = 0; r < world; ++r) {
    fs::path f = dir / ("optimizer.rank" + std::to_string(r) + ".safetensors");
    if (!fs::exists(f))
      throw std::runtime_error(f.string() + ": missing; a sharded checkpoint of " +
                               std::to_string(world) + " ranks needs one file per rank");
    ranks.push_back(std::make_unique<SafetensorsReader>(f.string()));
  }
  Named out;
  try {
    for (const nlohmann::json& g : manifest.at("groups")) {
      const std::string name = g.at("name");
      // The manifest's layout (contiguous chunks for ZeRO, dim-0 rows for FSDP;
      // parallel/sharding.h) maps each rank's shard back to the parameters.
      FlatLayout l;
      try {
        l = FlatLayout::from_json(g);
      } catch (const std::runtime_error& e) {
        throw std::runtime_error("group " + name + ": " + e.what());
      }
      if (l.world != world)
        throw std::runtime_error("group " + name + ": laid out over " + std::to_string(l.world) +
                                 " ranks, the manifest's world_size is " + std::to_string(world));
      const int64_t shard = l.shard_numel;
      Tensor full = Tensor::zeros({l.flat_numel}, DType::F32);
      for (int r = 0; r < world; ++r) {
        const std::string key = name + ".master";
        if (!ranks[r]->contains(key))
          throw std::runtime_error(ranks[r]->path() + ": no tensor '" + key +
                                   "' (the manifest lists it; was the file replaced?)");
        Tensor chunk = ranks[r]->load(key);
        if (chunk.numel() != shard || chunk.dtype() != DType::F32)
          throw std::runtime_error(ranks[r]->path() + ": '" + key + "' is " + chunk.str() +
                                   ", the manifest says f32 [" + std::to_string(shard) + "]");
        l.insert_shard(flat_view(chunk, 0, {shard}), r, full);
      }
      for (const FlatSlot& s : l.slots) {
        Tensor view = Tensor::from_storage(full.storage(), DType::F32, s.shape,
                                           contiguous_strides(s.shape), s.offset);
        out.push_back({s.name, view.clone(MemCategory::Params)});
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(state_file.string() + ": malformed shard manifest under \"extra\" (" +
                             e.what() + ")");
  }
  return out;
}

int consolidate(const std::string& ckpt, const std::string& out_dir, const std::string& dtype) {
  const fs::path dir(ckpt);
  nlohmann::json state = read_json(dir / "trainer_state.json");
  nlohmann::json manifest = state.value("extra", nlohmann::json());
  const bool sharded = manifest.is_object() && manifest.value("sharded", false);
  Named weights;
  if (sharded) {
    int world = manifest.value("world_size", state.value("world_size", 0));
    if (world < 1) throw std::runtime_error(ckpt + ": the manifest has no world_size");
    weights = from_shards(dir, manifest, world);
  } else {
    fs::path model = dir / "model.safetensors";
    if (!fs::exists(model))
      throw std::runtime_error(ckpt +
                               ": no model.safetensors and no shard manifest; nothing to "
                               "consolidate");
    SafetensorsReader r(model.string());
    for (const std::string& n : r.names()) {
      // The same rule as accel-train's loading: float weights only, never value-converted.
      if (!is_loadable_weight_dtype(r.info(n).dtype_name))
        throw std::runtime_error(model.string() + ": tensor '" + n + "' has dtype " +
                                 r.info(n).dtype_name +
                                 ", but a weight must be F32, BF16 or F16; it is not converted");
      weights.push_back({n, r.load(n)});
    }
  }
  for (const auto& [name, t] : weights)
    if (has_non_finite(t))
      throw std::runtime_error(ckpt + ": tensor '" + name +
                               "' holds NaN or Inf values; the checkpoint is damaged (or was "
                               "saved after the run diverged): consolidate an earlier one");
  DType target = dtype == "bf16" ? DType::BF16 : dtype == "fp16" ? DType::F16 : DType::F32;
  for (auto& [name, t] : weights)
    if (t.dtype() != target) {
      Tensor c = Tensor::empty(t.shape(), target);
      c.copy_(t);
      t = c;
    }
  if (!fs::exists(dir / "config.json"))
    throw std::runtime_error(ckpt + ": no config.json (the model shape); copy it from the run");
  fs::create_directories(out_dir);
  save_safetensors((fs::path(out_dir) / "model.safetensors").string(), weights, {{"format", "pt"}});
  if (fs::absolute(dir / "config.json") != fs::absolute(fs::path(out_dir) / "config.json"))
    fs::copy_file(dir / "config.json", fs::path(out_dir) / "config.json",
                  fs::copy_options::overwrite_existing);
  // generation_config.json and the tokenizer files the run saved beside the weights.
  copy_model_folder_extras(dir.string(), out_dir);
  if (!fs::exists(fs::path(out_dir) / "tokenizer.json"))
    std::fprintf(stderr,
                 "accel-checkpoint: note: %s has no tokenizer.json (a byte-tokenizer or synthetic-"
                 "data run, or an older checkpoint); pass --tokenizer byte (or the tokenizer.json "
                 "it was trained with) to accel-generate\n",
                 ckpt.c_str());
  std::fprintf(
      stderr, "accel-checkpoint: wrote %zu tensors (%s) from %s%s to %s\n", weights.size(),
      dtype_name(target), ckpt.c_str(),
      sharded ? (" (" + std::to_string(manifest.value("world_size", 0)) + " shards)").c_str() : "",
      out_dir.c_str());
  return 0;
}

}  // namespace
}  // namespace accel

int main(int argc, char** argv) {
  CLI::App app{"accel-checkpoint: tools for accel-train checkpoints"};
  app.require_subcommand(1);
  CLI::App* cons = app.add_subcommand(
      "consolidate",
      "write a Hugging Face model folder (model.safetensors + config.json) from a "
      "checkpoint, rebuilding sharded (ZeRO) weights");
  std::string ckpt, out, dtype = "fp32";
  cons->add_option("CKPT_DIR", ckpt, "checkpoint folder (…/checkpoints/step_N)")->required();
  cons->add_option("OUT_DIR", out, "output folder")->required();
  cons->add_option("--dtype", dtype, "dtype of the written weights")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  if (auto code = accel::parse_command_line(app, argc, argv)) return *code;
  try {
    return accel::consolidate(ckpt, out, dtype);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-checkpoint: %s\n", e.what());
    return 1;
  }
}
