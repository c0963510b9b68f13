// accel-checkpoint: tools for accel-train checkpoints (tools/trainer/checkpoint.h has the format).
//   inspect CKPT_DIR          step, world size, strategy, dtypes, global batch, data position, the
//                             files, and every tensor with its shape and which file holds which
//                             slice of it
//   verify CKPT_DIR           every file against the size and checksum recorded at save (exit 1
//                             naming each damaged or missing file)
//   reshard CKPT_DIR OUT_DIR --world-size M --strategy single|ddp|zero|fsdp
//                             rewrites the state as M ranks of that strategy would hold it
//                             (contiguous chunks for ZeRO, dim-0 rows for FSDP, whole tensors on
//                             rank 0 for single and DDP). accel-train resumes any checkpoint at any
//                             world size directly; reshard makes the files match the new layout so
//                             that each rank then reads one file
//   consolidate CKPT_DIR OUT_DIR [--dtype fp32|bf16|fp16]
//                             a Hugging Face model folder (model.safetensors + config.json) that
//                             transformers loads and accel-train takes as model.init_from: the
//                             master weights from the state (format 2), the checkpoint's
//                             model.safetensors, or for a format-1 sharded checkpoint the
//                             "group<i>.master" chunks through its manifest's layout
#include <CLI/CLI.hpp>
#include <algorithm>
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
#include "tools/trainer/checkpoint.h"
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

// Format 2 with state: the master weights, whole, through the index.
bool has_state_index(const nlohmann::json& state) {
  return state.contains("format_version") && state.value("optimizer_saved", true) &&
         state.contains("state");
}

Named masters_from_state(const std::string& ckpt) {
  LoadedCheckpoint ck = load_checkpoint(ckpt);
  CheckpointStateReader reader(ck);
  Named out;
  for (const auto& [name, p] : ck.params) {
    Tensor t = Tensor::empty(p.shape, DType::F32, Device::cpu(), MemCategory::Params);
    reader.read(name, "master", 0, t);
    out.push_back({name, t});
  }
  return out;
}

int consolidate(const std::string& ckpt, const std::string& out_dir, const std::string& dtype) {
  const fs::path dir(ckpt);
  nlohmann::json state = read_json(dir / "trainer_state.json");
  nlohmann::json manifest = state.value("extra", nlohmann::json());
  const bool v1_sharded =
      !state.contains("format_version") && manifest.is_object() && manifest.value("sharded", false);
  const bool sharded =
      v1_sharded || (has_state_index(state) && !fs::exists(dir / "model.safetensors"));
  Named weights;
  if (has_state_index(state)) {
    weights = masters_from_state(ckpt);
  } else if (v1_sharded) {
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
      sharded ? (" (" + std::to_string(state.value("world_size", 0)) + " shards)").c_str() : "",
      out_dir.c_str());
  return 0;
}

std::string shape_text(const Shape& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// trainer_state.json's mode (none, full, selective); checkpoints from before the modes hold a
// boolean (true: full).
std::string activation_checkpointing_of(const nlohmann::json& st) {
  const nlohmann::json v = st.value("activation_checkpointing", nlohmann::json(false));
  if (v.is_string()) return v.get<std::string>();
  return v.is_boolean() && v.get<bool>() ? "full" : "none";
}

int inspect(const std::string& ckpt) {
  const fs::path dir(ckpt);
  const nlohmann::json st = read_json(dir / "trainer_state.json");
  std::printf("checkpoint %s (format version %d)\n", ckpt.c_str(), st.value("format_version", 1));
  std::printf("  step %lld (optimizer steps %lld), saved by %s x %d processes\n",
              static_cast<long long>(st.value("step", int64_t{0})),
              static_cast<long long>(st.value("optimizer_steps", int64_t{0})),
              st.value("strategy", std::string("?")).c_str(), st.value("world_size", 0));
  // Checkpoints written before optimizer.master_weights kept fp32 masters.
  std::printf(
      "  mixed_precision %s, compute dtype %s, master dtype %s, state dtype %s, "
      "activation_checkpointing %s\n",
      st.value("mixed_precision", std::string("?")).c_str(),
      st.value("compute_dtype", std::string("?")).c_str(),
      st.value("master_dtype", std::string("F32")).c_str(),
      st.value("state_dtype", std::string("?")).c_str(), activation_checkpointing_of(st).c_str());
  if (st.contains("global_batch"))
    std::printf("  global batch %s\n", st["global_batch"].dump().c_str());
  std::printf("  data position %s, loss scaler %s, rng %s\n",
              st.value("data_position", nlohmann::json()).dump().c_str(),
              st.value("loss_scaler", nlohmann::json{{"scale", st.value("loss_scale", 1.0)}})
                  .dump()
                  .c_str(),
              st.value("rng", nlohmann::json()).dump().c_str());
  if (st.contains("files")) {
    std::printf("  files:\n");
    for (const auto& [name, e] : st["files"].items())
      std::printf("    %-36s %12llu bytes  checksum %s\n", name.c_str(),
                  static_cast<unsigned long long>(e.value("bytes", uint64_t{0})),
                  e.value("checksum", std::string("?")).c_str());
  }
  if (!has_state_index(st)) {
    std::printf("  no layout-independent state (%s)\n", st.value("optimizer_saved", true)
                                                            ? "format version 1"
                                                            : "saved without optimizer state");
    return 0;
  }
  LoadedCheckpoint ck = load_checkpoint(ckpt);
  std::string kinds;
  for (const std::string& k : ck.kinds)
    kinds += (kinds.empty() ? "" : ", ") + k + " " + ck.dtype_of(k);
  std::printf("  state: %s\n  tensors (%zu): name [shape]: file[begin:end) kinds\n", kinds.c_str(),
              ck.params.size());
  for (const auto& [name, p] : ck.params) {
    std::printf("    %s %s:", name.c_str(), shape_text(p.shape).c_str());
    for (const CheckpointSlice& s : p.slices) {
      std::string k;
      for (const auto& [kind, key] : s.keys) k += " " + kind;
      std::printf(" %s[%lld:%lld)%s;", s.file.c_str(), static_cast<long long>(s.begin),
                  static_cast<long long>(s.end), k.c_str());
    }
    std::printf("\n");
  }
  return 0;
}

int verify(const std::string& ckpt) {
  const std::vector<std::string> problems = verify_checkpoint(ckpt);
  for (const std::string& p : problems)
    std::fprintf(stderr, "accel-checkpoint verify: %s\n", p.c_str());
  if (!problems.empty()) {
    std::fprintf(stderr, "accel-checkpoint verify: %s is damaged (%zu problem%s)\n", ckpt.c_str(),
                 problems.size(), problems.size() == 1 ? "" : "s");
    return 1;
  }
  const nlohmann::json st = read_json(fs::path(ckpt) / "trainer_state.json");
  std::printf("%s: ok, %zu files match the checksums recorded at save\n", ckpt.c_str(),
              st.at("files").size());
  return 0;
}

// The ranges of every parameter (index order) that rank r of `world` holds under `strategy`.
std::vector<std::pair<int64_t, int64_t>> ranges_for(const std::string& strategy, int world, int r,
                                                    const std::vector<Shape>& shapes) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t total = 0;
  for (const Shape& s : shapes) total += shape_numel(s);
  const int64_t chunk = (total + world - 1) / world;  // ZeRO: contiguous chunks of the whole
  int64_t at = 0;
  for (const Shape& s : shapes) {
    const int64_t n = shape_numel(s);
    int64_t b = 0, e = 0;
    if (strategy == "single" || strategy == "ddp") {
      e = r == 0 ? n : 0;
    } else if (strategy == "zero") {
      b = std::clamp(r * chunk - at, int64_t{0}, n);
      e = std::clamp((r + 1) * chunk - at, int64_t{0}, n);
    } else {  // fsdp: dim-0 rows, ceil(d0 / world) per rank
      const int64_t rows = s.empty() ? 1 : s[0], row = rows ? n / rows : 0;
      const int64_t per = (rows + world - 1) / world;
      b = std::min(rows, r * per) * row;
      e = std::min(rows, (r + 1) * per) * row;
    }
    out.push_back({b, e});
    at += n;
  }
  return out;
}

int reshard(const std::string& ckpt, const std::string& out_dir, int world,
            const std::string& strategy) {
  if (strategy == "single" && world != 1)
    throw std::runtime_error("--strategy single holds one process; pass --world-size 1");
  LoadedCheckpoint ck = load_checkpoint(ckpt);
  if (fs::exists(out_dir))
    throw std::runtime_error(out_dir +
                             ": exists; reshard writes a new folder (remove it or pick another)");
  CheckpointStateReader reader(ck);
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  for (const auto& [name, p] : ck.params) {
    names.push_back(name);
    shapes.push_back(p.shape);
  }
  const std::string tmp = out_dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  // The model and run files as they are (the weights in model.safetensors stay loadable).
  for (const auto& e : fs::directory_iterator(ck.dir)) {
    const std::string n = e.path().filename().string();
    if (!e.is_regular_file() || n == "trainer_state.json" || n.rfind("optimizer.rank", 0) == 0)
      continue;
    fs::copy_file(e.path(), fs::path(tmp) / n);
  }
  CheckpointSnapshot first;
  for (int r = 0; r < world; ++r) {
    CheckpointSnapshot s;
    s.rank = r;
    s.world_size = world;
    s.state = ck.state;
    s.state.world_size = world;
    s.kinds = ck.kinds;
    s.kind_dtypes = ck.dtypes;  // every kind stays in its stored dtype
    s.model_files = false;
    const auto ranges = ranges_for(strategy, world, r, shapes);
    for (size_t i = 0; i < names.size(); ++i) {
      const auto [b, e] = ranges[i];
      if (e <= b) continue;
      ParamStateSlice p;
      p.name = names[i];
      p.shape = shapes[i];
      p.begin = b;
      p.end = e;
      for (const std::string& kind : ck.kinds) {
        // Each kind stays in the dtype it was stored in (bf16 moments stay bf16).
        const DType dt = ck.dtype_of(kind) == "BF16" ? DType::BF16 : DType::F32;
        Tensor t = Tensor::empty({e - b}, dt, Device::cpu(), MemCategory::Other);
        reader.read(names[i], kind, b, t);
        p.tensors.push_back({kind, t});
      }
      s.slices.push_back(std::move(p));
    }
    write_checkpoint_part(tmp, s);
    if (r == 0) {
      s.slices.clear();
      first = std::move(s);
    }
  }
  const nlohmann::json& src = ck.trainer_state;
  for (const char* key : {"mixed_precision", "compute_dtype", "master_dtype", "state_dtype",
                          "activation_checkpointing", "bucket_cap_mb", "global_batch", "rng",
                          "loss_scaler", "fp8_state_file"})
    if (src.contains(key)) first.info[key] = src[key];
  first.info["strategy"] = strategy;
  first.info["resharded_from"] = {{"strategy", src.value("strategy", std::string("?"))},
                                  {"world_size", ck.state.world_size}};
  finish_checkpoint(tmp, out_dir, first, /*keep_last=*/0, /*timeout_s=*/10);
  std::fprintf(stderr, "accel-checkpoint: resharded %s (%s x %d) into %s (%s x %d)\n", ckpt.c_str(),
               src.value("strategy", std::string("?")).c_str(), ck.state.world_size,
               out_dir.c_str(), strategy.c_str(), world);
  return 0;
}

}  // namespace
}  // namespace accel

int main(int argc, char** argv) {
  CLI::App app{"accel-checkpoint: tools for accel-train checkpoints"};
  app.require_subcommand(1);
  std::string ckpt, out, dtype = "fp32", strategy;
  int world = 0;
  CLI::App* cons = app.add_subcommand(
      "consolidate",
      "write a Hugging Face model folder (model.safetensors + config.json) from a "
      "checkpoint, rebuilding sharded weights");
  cons->add_option("CKPT_DIR", ckpt, "checkpoint folder (…/checkpoints/step_N)")->required();
  cons->add_option("OUT_DIR", out, "output folder")->required();
  cons->add_option("--dtype", dtype, "dtype of the written weights")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  CLI::App* insp = app.add_subcommand(
      "inspect", "print step, world size, strategy, dtypes and every tensor's slices");
  insp->add_option("CKPT_DIR", ckpt, "checkpoint folder")->required();
  CLI::App* ver =
      app.add_subcommand("verify", "check every file against the checksum recorded at save");
  ver->add_option("CKPT_DIR", ckpt, "checkpoint folder")->required();
  CLI::App* resh = app.add_subcommand(
      "reshard", "rewrite the state for another world size and strategy (offline)");
  resh->add_option("CKPT_DIR", ckpt, "checkpoint folder")->required();
  resh->add_option("OUT_DIR", out, "new checkpoint folder (must not exist)")->required();
  resh->add_option("--world-size", world, "processes of the new layout")
      ->required()
      ->check(CLI::Range(1, 1 << 20));
  resh->add_option("--strategy", strategy, "layout: single, ddp, zero (ZeRO-1/2/3) or fsdp")
      ->required()
      ->check(CLI::IsMember({"single", "ddp", "zero", "fsdp"}));
  if (auto code = accel::parse_command_line(app, argc, argv)) return *code;
  try {
    if (cons->parsed()) return accel::consolidate(ckpt, out, dtype);
    if (insp->parsed()) return accel::inspect(ckpt);
    if (ver->parsed()) return accel::verify(ckpt);
    return accel::reshard(ckpt, out, world, strategy);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-checkpoint: %s\n", e.what());
    return 1;
  }
}
