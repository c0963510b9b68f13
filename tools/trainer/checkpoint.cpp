#include "tools/trainer/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <stdexcept>

#include "models/fp8_linear.h"
#include "runtime/json.h"
#include "runtime/safetensors.h"

namespace accel {
namespace fs = std::filesystem;

namespace {
std::string optimizer_file(int rank) {
  return "optimizer.rank" + std::to_string(rank) + ".safetensors";
}

std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(root)) return out;
  static const std::regex name("step_([0-9]+)");
  for (const auto& e : fs::directory_iterator(root)) {
    std::smatch m;
    std::string n = e.path().filename().string();
    if (e.is_directory() && std::regex_match(n, m, name) &&
        fs::exists(e.path() / "trainer_state.json"))
      out.push_back({std::stoll(m[1]), e.path()});
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p);
  out << text;
  if (!out.flush()) throw std::runtime_error(p.string() + ": write failed (disk full?)");
}
}  // namespace

std::string save_checkpoint(const std::string& output_dir, const TrainerState& state,
                            const std::vector<std::pair<std::string, Tensor>>& full_weights,
                            const LlamaConfig& model_config,
                            const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                            const std::string& config_yaml, const CheckpointWriter& w,
                            int64_t keep_last) {
  fs::path root = fs::path(output_dir) / "checkpoints";
  fs::path final_dir = root / ("step_" + std::to_string(state.step));
  fs::path tmp = root / ("step_" + std::to_string(state.step) + ".tmp");
  if (w.rank == 0) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  if (w.barrier) w.barrier();
  save_safetensors((tmp / optimizer_file(w.rank)).string(), optimizer_state,
                   {{"format", "accel-optimizer"}, {"rank", std::to_string(w.rank)}});
  if (w.rank == 0) {
    // A strategy that keeps weights only in its shards (ZeRO-3) hands none over; the folder
    // then holds no model.safetensors (accel-checkpoint consolidate writes one).
    if (!full_weights.empty())
      save_safetensors((tmp / "model.safetensors").string(), full_weights, {{"format", "pt"}});
    write_hf_llama_config(model_config, (tmp / "config.json").string());
    write_text(tmp / "config.yaml", config_yaml);
  }
  const bool fp8_state = fp8_has_checkpoint_state(w.fp8);
  if (fp8_state) {
    check_fp8_state_replicated(*w.fp8, w.group);  // every rank (one all-reduce)
    if (w.rank == 0) save_fp8_state(*w.fp8, (tmp / kFp8StateFile).string());
  }
  if (w.barrier) w.barrier();
  if (w.rank == 0) {
    nlohmann::json j = {{"step", state.step},
                        {"optimizer_steps", state.optimizer_steps},
                        {"seed", state.seed},
                        {"world_size", w.world_size},
                        {"data_position", state.data_position},
                        {"loss_scale", state.loss_scale},
                        {"extra", state.extra}};
    std::vector<std::string> files;
    for (int r = 0; r < w.world_size; ++r) files.push_back(optimizer_file(r));
    j["optimizer_files"] = files;
    if (fp8_state) j["fp8_state_file"] = kFp8StateFile;
    write_text(tmp / "trainer_state.json", j.dump(1) + "\n");
    fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);
    if (keep_last > 0) {
      auto all = complete_checkpoints(root);
      for (size_t i = 0; i + keep_last < all.size(); ++i) fs::remove_all(all[i].second);
    }
  }
  if (w.barrier) w.barrier();
  return final_dir.string();
}

std::optional<std::string> find_checkpoint(const std::string& output_dir, const std::string& spec) {
  if (spec == "auto") {
    auto all = complete_checkpoints(fs::path(output_dir) / "checkpoints");
    if (all.empty()) return std::nullopt;
    return all.back().second.string();
  }
  if (!fs::is_directory(spec))
    throw std::runtime_error("--resume " + spec + ": no such checkpoint folder");
  if (!fs::exists(fs::path(spec) / "trainer_state.json"))
    throw std::runtime_error("--resume " + spec +
                             ": not a complete checkpoint (no trainer_state.json); it may be a "
                             "save that was interrupted");
  return spec;
}

LoadedCheckpoint load_checkpoint(const std::string& dir, int rank, int world_size) {
  LoadedCheckpoint c;
  c.dir = dir;
  nlohmann::json j;
  try {
    j = read_json_file((fs::path(dir) / "trainer_state.json").string());
    c.state.step = j.at("step");
    c.state.optimizer_steps = j.at("optimizer_steps");
    c.state.seed = j.at("seed");
    c.state.world_size = j.at("world_size");
    c.state.data_position = j.at("data_position");
    c.state.loss_scale = j.value("loss_scale", 1.0);
    c.state.extra = j.value("extra", nlohmann::json::object());
  } catch (const std::exception& e) {
    throw std::runtime_error(dir + "/trainer_state.json: unreadable (" + e.what() + ")");
  }
  if (c.state.world_size != world_size)
    throw std::runtime_error(dir + ": saved with " + std::to_string(c.state.world_size) +
                             " processes, resuming with " + std::to_string(world_size) +
                             "; resume with the same num_processes, or start a new run with "
                             "model.init_from pointing at this folder (weights only; for a "
                             "sharded checkpoint without model.safetensors run `accel-checkpoint "
                             "consolidate` first)");
  const fs::path model_file = fs::path(dir) / "model.safetensors";
  if (fs::exists(model_file) || c.state.extra.is_null() || !c.state.extra.value("sharded", false)) {
    SafetensorsReader model(model_file.string());
    for (const std::string& n : model.names()) c.weights.push_back({n, model.load(n)});
  }
  SafetensorsReader opt((fs::path(dir) / optimizer_file(rank)).string());
  for (const std::string& n : opt.names())
    c.optimizer_state.push_back({n, opt.load(n, MemCategory::OptimizerState)});
  const fs::path fp8_file = fs::path(dir) / kFp8StateFile;
  if (j.contains("fp8_state_file") && !fs::exists(fp8_file))
    throw std::runtime_error(dir + ": trainer_state.json lists " + kFp8StateFile +
                             " but the file is missing; copy it back from where the checkpoint "
                             "came from, or resume from another checkpoint");
  if (fs::exists(fp8_file)) c.fp8_state_file = fp8_file.string();
  return c;
}

void check_same_shard_layout(const std::string& dir, const nlohmann::json& saved,
                             const nlohmann::json& now) {
  if (!saved.is_object() || !saved.contains("groups") || !now.is_object()) return;
  if (saved["groups"] == now.value("groups", nlohmann::json())) return;
  throw std::runtime_error(
      dir +
      ": its shards are laid out differently from this run's (trainer_state.json \"extra\" "
      "groups: strategy " +
      saved.value("strategy", std::string("?")) + " then, " +
      now.value("strategy", std::string("?")) +
      " now; the units, buckets, parameter offsets or "
      "the shard layout differ, e.g. an FSDP checkpoint from before FSDP sharded on dim 0). "
      "Resume with the configuration and accel-train it was saved with, or run `accel-checkpoint "
      "consolidate` on it and start a new run with model.init_from pointing at the result");
}

std::string restore_fp8_state(Fp8Training* fp8, const LoadedCheckpoint& ck) {
  if (!fp8_has_checkpoint_state(fp8)) {
    if (ck.fp8_state_file.empty()) return "";
    return ck.fp8_state_file + ": fp8 delayed-scaling state ignored: this run " +
           (fp8 ? "uses " +
                      std::string(fp8->recipe().scaling == Fp8Scaling::MxBlock
                                      ? "MXFP8 block scaling"
                                      : "dynamic scaling (backend AO)") +
                      ", which keeps no state"
                : std::string("does not train in fp8"));
  }
  if (ck.fp8_state_file.empty())
    throw std::runtime_error(
        ck.dir + ": the checkpoint has no " + kFp8StateFile +
        ", but this run uses fp8 delayed scaling (fp8_config.backend TE), whose amax histories "
        "and scales a resumed run needs to continue with the same numbers. It was saved by a run "
        "without delayed scaling (or by an accel-train that did not save it). Resume with the "
        "configuration it was saved with, or start a new run with model.init_from pointing at "
        "this folder (weights only; the fp8 scaling then starts afresh)");
  return load_fp8_state(*fp8, ck.fp8_state_file);
}

}  // namespace accel
