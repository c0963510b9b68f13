#include "tools/trainer/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>

#include "parallel/strategy.h"
#include "runtime/json.h"
#include "runtime/safetensors.h"

namespace accel {
namespace fs = std::filesystem;

namespace {
std::string optimizer_file(int rank) {
  return "optimizer.rank" + std::to_string(rank) + ".safetensors";
}

// The largest step a checkpoint may claim: far beyond any run, small enough that no step
// arithmetic (step + 1, counts of tokens) can overflow.
constexpr int64_t kMaxStep = 1'000'000'000'000'000;

// N of a folder named step_N; nullopt for other names. A number past kMaxStep is no folder this
// program wrote: refused when `strict`, else skipped (pruning never deletes what it cannot read).
std::optional<int64_t> step_of(const fs::path& dir, bool strict) {
  static const std::regex name("step_([0-9]+)");
  std::smatch m;
  const std::string n = (dir.has_filename() ? dir : dir.parent_path()).filename().string();
  if (!std::regex_match(n, m, name)) return std::nullopt;
  const std::string digits = m[1];
  int64_t v = 0;
  for (char c : digits) {
    if (v > (kMaxStep - (c - '0')) / 10) {
      if (!strict) return std::nullopt;
      throw std::invalid_argument(
          dir.string() + ": not a checkpoint of accel-train (its step number is out of range, " +
          "at most " + std::to_string(kMaxStep) + "); rename or remove that folder");
    }
    v = v * 10 + (c - '0');
  }
  return v;
}

std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& root, bool strict) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    if (!e.is_directory() || !fs::exists(e.path() / "trainer_state.json")) continue;
    if (std::optional<int64_t> step = step_of(e.path(), strict)) out.push_back({*step, e.path()});
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A JSON value for an error message, cut short: a hostile file must not flood the log.
std::string short_json(const nlohmann::json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 40) + "..." : s;
}

// trainer_state.json's integer `key`, in [lo, hi].
int64_t state_int(const nlohmann::json& j, const char* key, int64_t lo, int64_t hi,
                  const std::string& file) {
  const nlohmann::json& v = j.at(key);
  // A non-negative number parses as unsigned: compare it as such until it is known to fit.
  const bool fits = v.is_number_integer() &&
                    (v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(hi) &&
                                                  static_cast<int64_t>(v.get<uint64_t>()) >= lo
                                            : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi);
  if (!fits)
    throw std::runtime_error(file + ": \"" + key + "\" is " + short_json(v) +
                             ", expected an integer from " + std::to_string(lo) + " to " +
                             std::to_string(hi) +
                             "; the file was altered or damaged: resume from another checkpoint");
  return v.get<int64_t>();
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p);
  out << text;
  if (!out.flush()) throw std::runtime_error(p.string() + ": write failed (disk full?)");
}
}  // namespace

std::string save_checkpoint(const std::string& output_dir, const TrainerState& state,
                            const std::vector<std::pair<std::string, Tensor>>& full_weights,
                            const DecoderConfig& model_config,
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
  if (!w.save_optimizer && w.rank == 0 && full_weights.empty())
    throw std::logic_error(
        "checkpoint.save_optimizer is false, but this strategy keeps the weights only in its "
        "optimizer shards: the checkpoint would hold no weights (the config check should have "
        "refused this)");
  if (w.save_optimizer)
    save_safetensors((tmp / optimizer_file(w.rank)).string(), optimizer_state,
                     {{"format", "accel-optimizer"}, {"rank", std::to_string(w.rank)}});
  if (w.rank == 0) {
    // A strategy that keeps weights only in its shards (ZeRO-3) hands none over; the folder
    // then holds no model.safetensors (accel-checkpoint consolidate writes one).
    if (!full_weights.empty())
      save_safetensors((tmp / "model.safetensors").string(), full_weights, {{"format", "pt"}});
    write_hf_model_config(model_config, (tmp / "config.json").string());
    write_text(tmp / "config.yaml", config_yaml);
  }
  const nlohmann::json extra_files = w.save_extra ? w.save_extra(tmp.string()) : nlohmann::json();
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
    for (int r = 0; r < w.world_size && w.save_optimizer; ++r) files.push_back(optimizer_file(r));
    j["optimizer_files"] = files;
    j["optimizer_saved"] = w.save_optimizer;
    if (extra_files.is_object()) j.update(extra_files);
    write_text(tmp / "trainer_state.json", j.dump(1) + "\n");
    fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);
    if (keep_last > 0) {
      // The oldest beyond keep_last go, counting the new one; the new one always stays, even
      // where newer steps exist (a resume from an older step that moved none of them aside).
      std::vector<std::pair<int64_t, fs::path>> others;
      for (auto& c : complete_checkpoints(root, /*strict=*/false))
        if (c.second.filename() != final_dir.filename()) others.push_back(c);
      for (size_t i = 0; i + keep_last < others.size() + 1; ++i) fs::remove_all(others[i].second);
    }
  }
  if (w.barrier) w.barrier();
  return final_dir.string();
}

std::optional<std::string> find_checkpoint(const std::string& output_dir, const std::string& spec) {
  if (spec == "auto") {
    auto all = complete_checkpoints(fs::path(output_dir) / "checkpoints", /*strict=*/true);
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
  const std::string state_file = (fs::path(dir) / "trainer_state.json").string();
  nlohmann::json j;
  bool optimizer_saved = true;
  try {
    j = read_json_file(state_file);
    c.state.step = state_int(j, "step", 0, kMaxStep, state_file);
    c.state.optimizer_steps = state_int(j, "optimizer_steps", 0, c.state.step, state_file);
    if (!j.at("seed").is_number_unsigned())
      throw std::runtime_error(state_file + ": \"seed\" is " + short_json(j["seed"]) +
                               ", expected a non-negative integer; resume from another checkpoint");
    c.state.seed = j.at("seed");
    c.state.world_size = static_cast<int>(
        state_int(j, "world_size", 1, std::numeric_limits<int>::max(), state_file));
    c.state.data_position = j.at("data_position");
    c.state.loss_scale = j.value("loss_scale", 1.0);
    c.state.extra = j.value("extra", nlohmann::json::object());
    optimizer_saved = j.value("optimizer_saved", true);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(dir + "/trainer_state.json: unreadable (" + e.what() + ")");
  }
  if (!std::isfinite(c.state.loss_scale) || c.state.loss_scale <= 0)
    throw std::runtime_error(state_file + ": \"loss_scale\" is " + short_json(j["loss_scale"]) +
                             ", expected a positive number; resume from another checkpoint");
  const std::optional<int64_t> named = step_of(fs::path(dir), /*strict=*/false);
  if (named && *named != c.state.step)
    throw std::runtime_error(state_file + ": \"step\" is " + std::to_string(c.state.step) +
                             " but the folder is named for step " + std::to_string(*named) +
                             "; the file was altered or copied from another checkpoint");
  if (!optimizer_saved)
    throw std::runtime_error(
        dir +
        ": saved with checkpoint.save_optimizer: false, so it holds the weights but no optimizer "
        "state, and a resumed run could not continue the same trajectory. Start a new run from "
        "it with model.init_from: " +
        dir + " (the optimizer, the learning-rate schedule and the data order start afresh)");
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
  c.optimizer_file = (fs::path(dir) / optimizer_file(rank)).string();
  SafetensorsReader opt(c.optimizer_file);
  for (const std::string& n : opt.names())
    c.optimizer_state.push_back({n, opt.load(n, MemCategory::OptimizerState)});
  c.trainer_state = j;
  return c;
}

void check_checkpoint_matches_run(const LoadedCheckpoint& ck, Module& model, Strategy& strategy) {
  const std::string advice =
      "this run's model settings differ from those the checkpoint was saved with (its "
      "config.yaml and config.json hold them). Resume with those settings, or start a new run "
      "with model.init_from pointing at a model folder";
  std::map<std::string, OfferedWeight> offered;
  const nlohmann::json& manifest = ck.state.extra;
  if (!ck.weights.empty()) {
    const std::string file = (fs::path(ck.dir) / "model.safetensors").string();
    for (const auto& [name, t] : ck.weights)
      offered[name] = {file, safetensors_dtype_name(t.dtype()), t.shape()};
  } else {
    // Only shards were saved: the manifest names every parameter and its shape.
    const std::string file = (fs::path(ck.dir) / "trainer_state.json").string() + " (\"extra\")";
    try {
      for (const nlohmann::json& g : manifest.at("groups"))
        for (const nlohmann::json& p : g.at("params"))
          offered[p.at("name").get<std::string>()] = {file, "F32", p.at("shape").get<Shape>()};
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(file + ": malformed shard manifest (" + e.what() + ")");
    }
  }
  check_offered_weights(model, offered, ck.dir, advice, /*allow_tied_lm_head=*/false);
  check_same_shard_layout(ck.dir, manifest, strategy.checkpoint_manifest());

  std::map<std::string, const Tensor*> saved;
  for (const auto& [name, t] : ck.optimizer_state) saved[name] = &t;
  const std::string& file = ck.optimizer_file;
  std::set<std::string> expected;
  for (const auto& [name, t] : strategy.optimizer_state()) {
    expected.insert(name);
    auto it = saved.find(name);
    if (it == saved.end())
      throw std::runtime_error(file + ": no optimizer state tensor '" + name +
                               "', which this run's optimizer and strategy hold; " + advice);
    const Tensor& s = *it->second;
    if (s.shape() != t.shape())
      throw std::runtime_error(file + ": optimizer state tensor '" + name + "' has shape " +
                               shape_str(s.shape()) + ", this run holds " + shape_str(t.shape()) +
                               "; " + advice);
    if (s.dtype() != t.dtype())
      throw std::runtime_error(file + ": optimizer state tensor '" + name + "' has dtype " +
                               safetensors_dtype_name(s.dtype()) + ", this run holds it in " +
                               safetensors_dtype_name(t.dtype()) +
                               " (not converted); the file was not written by this optimizer, or "
                               "it was altered");
  }
  for (const auto& [name, t] : saved)
    if (!expected.count(name))
      throw std::runtime_error(file + ": optimizer state tensor '" + name +
                               "' belongs to nothing in this run (another optimizer or "
                               "model?); " +
                               advice);
  // Only now are the dtypes known to be floating point.
  auto check_finite = [](const std::string& where, const std::string& name, const Tensor& t) {
    if (has_non_finite(t))
      throw std::runtime_error(where + ": tensor '" + name +
                               "' holds NaN or Inf values; the checkpoint is damaged (or was "
                               "saved after the run diverged): resume from an earlier one");
  };
  for (const auto& [name, t] : ck.weights)
    check_finite((fs::path(ck.dir) / "model.safetensors").string(), name, t);
  for (const auto& [name, t] : ck.optimizer_state) check_finite(file, name, t);
}

std::vector<std::string> handle_newer_checkpoints(const std::string& output_dir, int64_t step,
                                                  bool move_aside, bool mover) {
  const fs::path root = fs::path(output_dir) / "checkpoints";
  std::vector<fs::path> newer;
  for (const auto& [s, dir] : complete_checkpoints(root, /*strict=*/true))
    if (s > step) newer.push_back(dir);
  if (newer.empty()) return {};
  if (!move_aside) {
    std::string names;
    for (size_t i = 0; i < newer.size() && i < 3; ++i)
      names += (i ? ", " : "") + newer[i].filename().string();
    if (newer.size() > 3) names += " and " + std::to_string(newer.size() - 3) + " more";
    throw std::invalid_argument(
        "--resume: the checkpoint is at step " + std::to_string(step) + ", but " + root.string() +
        " holds newer ones (" + names +
        ") from the run that went on from there. Training beside them would mix two runs "
        "(keep_last prunes by step, --resume auto picks the newest). Pass "
        "--move-newer-checkpoints-aside to rename them to step_N.superseded (nothing is "
        "deleted), resume the newest with --resume auto, or pass another --output-dir");
  }
  std::vector<std::string> notes;
  if (!mover) return notes;
  for (const fs::path& dir : newer) {
    fs::path to = dir.string() + ".superseded";
    for (int i = 2; fs::exists(to); ++i) to = dir.string() + ".superseded." + std::to_string(i);
    fs::rename(dir, to);
    notes.push_back("resuming at step " + std::to_string(step) + ": moved the newer " +
                    dir.string() + " aside to " + to.filename().string());
  }
  return notes;
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

}  // namespace accel
