// Hostile or mismatched checkpoints and init_from folders (issue 26, items 6, 7, 8, 13): tensors
// of the wrong dtype, NaN weights or moments, a resume into a changed model, a resume from an
// older step beside newer checkpoints, checkpoint.save_optimizer: false, stray step folders and
// bad trainer_state.json values. Each is refused with a message naming the file and the tensor
// or value (docs/fault_tolerance.md).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "models/decoder.h"
#include "parallel/ddp.h"
#include "runtime/safetensors.h"
#include "tests/tools/run_tool.h"
#include "tools/trainer/checkpoint.h"

namespace fs = std::filesystem;

namespace {

using accel::DType;
using accel::Tensor;
using accel::tool_test::Result;

const char* kConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 7, max_steps: 4, micro_batch_size: 4, seq_len: 16, log_every: 1, progress: none,
           device: cpu}
optimizer: {lr: 0.01, warmup_steps: 2, lr_schedule: cosine}
data: {source: synthetic}
checkpoint: {every_steps: 2, keep_last: 0}
)";

class CheckpointInput : public accel::tool_test::ConfigFolderTest {
 protected:
  CheckpointInput() : ConfigFolderTest("accel_ckpt_input", kConfig) {}
  // A run of 4 steps with checkpoints at steps 2 and 4, into dir_/out.
  void base_run(const std::string& out = "base", const std::string& extra = "") {
    Result r = train(out, extra);
    ASSERT_EQ(r.code, 0) << r.output;
  }
  fs::path ckpt(const std::string& out, int step) {
    return dir_ / out / "checkpoints" / ("step_" + std::to_string(step));
  }
  // A copy of run `out`'s output folder, cut after step 2 (its step_4 removed), as a run killed
  // after its step-2 checkpoint leaves it.
  fs::path cut_copy(const std::string& out, const std::string& name) {
    fs::copy(dir_ / out, dir_ / name, fs::copy_options::recursive);
    fs::remove_all(ckpt(name, 4));
    return ckpt(name, 2);
  }
};

// Rewrites a safetensors file with tensor `name` replaced by f(tensor).
void rewrite_tensor(const fs::path& file, const std::string& name,
                    const std::function<Tensor(const Tensor&)>& f) {
  std::vector<std::pair<std::string, Tensor>> all;
  std::map<std::string, std::string> meta;
  bool found = false;
  {
    accel::SafetensorsReader r(file.string());
    meta = r.metadata();
    for (const std::string& n : r.names()) {
      Tensor t = r.load(n);
      if (n == name) {
        t = f(t);
        found = true;
      }
      all.push_back({n, t});
    }
  }
  ASSERT_TRUE(found) << file << " has no " << name;
  accel::save_safetensors(file.string(), all, meta);
}

// Records the checksums of checkpoint `ck`'s files and slices anew, as if they had been saved
// so (a run that diverged saves NaN state with matching checksums).
void rerecord_checksums(const fs::path& ck) {
  nlohmann::json st;
  std::ifstream(ck / "trainer_state.json") >> st;
  for (auto& [name, e] : st["files"].items()) {
    e["bytes"] = fs::file_size(ck / name);
    e["checksum"] = accel::checksum_file((ck / name).string());
  }
  for (auto& [name, p] : st["state"]["params"].items())
    for (auto& slice : p["slices"])
      for (auto& [kind, key] : slice["keys"].items()) {
        accel::SafetensorsReader r((ck / slice["file"].get<std::string>()).string());
        const std::string tensor = key[0];
        key[1] = accel::checksum_bytes(r.raw_data(tensor), r.info(tensor).nbytes());
      }
  std::ofstream(ck / "trainer_state.json") << st.dump(1);
}

Tensor converted(const Tensor& t, DType dtype) {
  Tensor c = Tensor::empty(t.shape(), dtype);
  c.copy_(t);
  return c;
}

Tensor with_nan(const Tensor& t) {
  std::vector<double> v = t.to_vector();
  v[v.size() / 2] = NAN;
  return Tensor::from_vector(v, t.shape(), t.dtype());
}

void edit_json(const fs::path& file, const std::function<void(nlohmann::json&)>& f) {
  nlohmann::json j;
  std::ifstream(file) >> j;
  f(j);
  std::ofstream(file) << j.dump(1);
}

void expect_has(const Result& r, const std::vector<std::string>& parts) {
  for (const std::string& p : parts)
    EXPECT_NE(r.output.find(p), std::string::npos) << p << "\n" << r.output;
}

const char* kUpProj = "model.layers.0.mlp.up_proj.weight";

// Issue 26 #6: an I32 weight was value-converted and trained on (loss 5.9e8, exit 0).
TEST_F(CheckpointInput, InitFromRefusesAnIntegerWeightNamingIt) {
  base_run();
  fs::path bad = dir_ / "bad";
  fs::copy(ckpt("base", 2), bad, fs::copy_options::recursive);
  rewrite_tensor(bad / "model.safetensors", kUpProj,
                 [](const Tensor& t) { return converted(t, DType::I32); });
  Result r = train("b", "--set model.init_from=" + bad.string());
  EXPECT_EQ(r.code, 1) << r.output;
  expect_has(r, {(bad / "model.safetensors").string(), kUpProj, "I32"});
  EXPECT_FALSE(fs::exists(dir_ / "b" / "metrics.jsonl"));
}

TEST_F(CheckpointInput, InitFromRefusesANonFiniteWeightNamingIt) {
  base_run();
  fs::path bad = dir_ / "bad";
  fs::copy(ckpt("base", 2), bad, fs::copy_options::recursive);
  rewrite_tensor(bad / "model.safetensors", kUpProj, with_nan);
  Result r = train("b", "--set model.init_from=" + bad.string());
  EXPECT_EQ(r.code, 1) << r.output;
  expect_has(r, {kUpProj, "NaN or Inf"});
}

// The documented float-to-float conversion: 16-bit weights load into the fp32 model.
TEST_F(CheckpointInput, InitFromTakesBf16AndF16Weights) {
  base_run();
  fs::path half = dir_ / "half";
  fs::copy(ckpt("base", 2), half, fs::copy_options::recursive);
  rewrite_tensor(half / "model.safetensors", kUpProj,
                 [](const Tensor& t) { return converted(t, DType::BF16); });
  rewrite_tensor(half / "model.safetensors", "model.norm.weight",
                 [](const Tensor& t) { return converted(t, DType::F16); });
  Result r = train("b", "--set model.init_from=" + half.string());
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST_F(CheckpointInput, ResumeRefusesAnIntegerWeightOrMomentAndNonFiniteState) {
  base_run();
  struct Case {
    std::string file, tensor;
    std::function<Tensor(const Tensor&)> f;
    std::vector<std::string> expect;
    bool rerecord = false;  // as saved so: the checksums match, the values are refused
  };
  const std::string moment = std::string(kUpProj) + ".exp_avg";
  const std::string moment2 = std::string(kUpProj) + ".exp_avg_sq";
  auto i32 = [](const Tensor& t) { return converted(t, DType::I32); };
  std::vector<Case> cases = {
      {"model.safetensors", kUpProj, i32, {kUpProj, "I32"}},
      {"optimizer.rank0.safetensors", moment, i32, {moment, "dtype I32", "F32"}},
      {"model.safetensors", kUpProj, with_nan, {kUpProj, "NaN or Inf"}, true},
      {"optimizer.rank0.safetensors",
       moment2,
       with_nan,
       {kUpProj, "exp_avg_sq", "NaN or Inf"},
       true},
      // Damaged bytes with the checksums as saved: the checksum names the file and tensor.
      {"optimizer.rank0.safetensors", moment2, with_nan, {moment2, "does not match the checksum"}},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string name = "cut" + std::to_string(i++);
    fs::path step2 = cut_copy("base", name);
    rewrite_tensor(step2 / c.file, c.tensor, c.f);
    if (c.rerecord) rerecord_checksums(step2);
    Result r = train(name, "--resume auto");
    EXPECT_EQ(r.code, 1) << c.file << " " << c.tensor << "\n" << r.output;
    std::vector<std::string> expect = c.expect;
    if (!c.rerecord) expect.push_back((step2 / c.file).string());
    expect_has(r, expect);
    EXPECT_FALSE(fs::exists(ckpt(name, 4))) << "trained on: " << c.tensor;
  }
}

// accel-checkpoint consolidate converted an I32 weight like accel-train did.
TEST_F(CheckpointInput, ConsolidateRefusesAnIntegerOrNonFiniteWeight) {
  base_run();
  fs::path bad = dir_ / "bad";
  fs::copy(ckpt("base", 2), bad, fs::copy_options::recursive);
  rewrite_tensor(bad / "model.safetensors", kUpProj,
                 [](const Tensor& t) { return converted(t, DType::I32); });
  const std::string cmd = std::string(ACCEL_BIN_DIR) + "/accel-checkpoint consolidate " +
                          bad.string() + " " + (dir_ / "hf").string();
  Result r = accel::tool_test::run_command(cmd);
  EXPECT_EQ(r.code, 1) << r.output;
  expect_has(r, {kUpProj, "I32"});
  rewrite_tensor(bad / "model.safetensors", kUpProj,
                 [](const Tensor& t) { return with_nan(converted(t, DType::F32)); });
  rerecord_checksums(bad);
  r = accel::tool_test::run_command(cmd);
  EXPECT_EQ(r.code, 1) << r.output;
  expect_has(r, {kUpProj, "NaN or Inf"});
  EXPECT_FALSE(fs::exists(dir_ / "hf" / "model.safetensors"));
}

// Issue 26 #7: --resume after a config change dropped the tensors the model lacked and trained.
TEST_F(CheckpointInput, ResumeRefusesAChangedModelNamingTheTensor) {
  base_run();
  struct Case {
    std::string set;
    std::string tensor;
  };
  std::vector<Case> cases = {
      {"model.num_hidden_layers=1", "model.layers.1."},                       // unexpected
      {"model.num_hidden_layers=3", "model.layers.2."},                       // missing
      {"model.tie_word_embeddings=true", "lm_head.weight"},                   // unexpected
      {"model.intermediate_size=48", "model.layers.0.mlp.gate_proj.weight"},  // shape
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string name = "cut" + std::to_string(i++);
    cut_copy("base", name);
    Result r = train(name, "--resume auto --set " + c.set);
    EXPECT_EQ(r.code, 1) << c.set << "\n" << r.output;
    expect_has(r, {c.tensor, "settings differ"});
    EXPECT_FALSE(fs::exists(ckpt(name, 4))) << c.set;
  }
  // The other way round: a tied run's checkpoint resumed untied.
  base_run("tied", "--set model.tie_word_embeddings=true");
  cut_copy("tied", "untie");
  Result r = train("untie", "--resume auto");
  EXPECT_EQ(r.code, 1) << r.output;
  expect_has(r, {"no tensor 'lm_head.weight'"});
}

// Sharded checkpoints (FSDP, no model.safetensors): the manifest's parameters are checked.
TEST_F(CheckpointInput, ResumeOfAShardedCheckpointRefusesAChangedModelNamingTheTensor) {
  const std::string fsdp = "--set distributed_type=FSDP --set num_processes=2";
  base_run("base", fsdp);
  ASSERT_FALSE(fs::exists(ckpt("base", 2) / "model.safetensors"));
  cut_copy("base", "cut");
  Result r = train("cut", "--resume auto " + fsdp + " --set model.num_hidden_layers=1");
  EXPECT_NE(r.code, 0) << r.output;
  expect_has(r, {"model.layers.1.", "does not belong to this model", "trainer_state.json"});
  EXPECT_FALSE(fs::exists(ckpt("cut", 4)));
}

// Issue 26 #8: a resume from an older step beside newer checkpoints.
TEST_F(CheckpointInput, ResumeFromAnOlderStepRefusesUnlessTheNewerAreMovedAside) {
  base_run();
  const fs::path old4 = ckpt("base", 4);
  const std::string from2 = "--resume " + ckpt("base", 2).string();
  Result r = train("base", from2);
  EXPECT_EQ(r.code, 2) << r.output;
  expect_has(r, {"step_4", "--move-newer-checkpoints-aside"});
  ASSERT_TRUE(fs::exists(old4 / "trainer_state.json"));

  // Moved aside: nothing deleted, the resumed run's own step_4 written and kept by keep_last.
  std::ifstream in(old4 / "trainer_state.json");
  const std::string old_state((std::istreambuf_iterator<char>(in)), {});
  r = train("base", from2 + " --move-newer-checkpoints-aside --set checkpoint.keep_last=1");
  ASSERT_EQ(r.code, 0) << r.output;
  expect_has(r, {"step_4.superseded"});
  fs::path moved = dir_ / "base" / "checkpoints" / "step_4.superseded";
  ASSERT_TRUE(fs::exists(moved / "trainer_state.json"));
  std::ifstream in2(moved / "trainer_state.json");
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in2)), {}), old_state);
  EXPECT_TRUE(fs::exists(old4 / "trainer_state.json"));  // the new run's
  EXPECT_FALSE(fs::exists(ckpt("base", 2)));             // keep_last 1
  r = train("other", "--move-newer-checkpoints-aside");  // without --resume it means nothing
  EXPECT_EQ(r.code, 2) << r.output;
  expect_has(r, {"--resume"});
  auto found = accel::find_checkpoint((dir_ / "base").string(), "auto");
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(fs::path(*found).filename(), "step_4");
}

// keep_last counts by step, but the checkpoint just written always stays.
TEST_F(CheckpointInput, KeepLastNeverDeletesTheCheckpointJustSaved) {
  const fs::path root = dir_ / "out" / "checkpoints";
  for (int s : {6, 8}) {
    fs::create_directories(root / ("step_" + std::to_string(s)));
    std::ofstream(root / ("step_" + std::to_string(s)) / "trainer_state.json") << "{}";
  }
  accel::DecoderConfig lc;
  lc.hidden_size = 8;
  lc.intermediate_size = 16;
  lc.num_hidden_layers = 1;
  lc.num_attention_heads = 2;
  lc.num_key_value_heads = 2;
  lc.head_dim = 4;
  lc.vocab_size = 16;
  accel::TrainerState st;
  st.step = 3;
  accel::CheckpointWriter w;
  w.save_optimizer = false;  // keep_last does not depend on what the checkpoint holds
  accel::SingleProcessStrategy single(DType::F32);
  accel::Linear model(2, 1, DType::F32, accel::Device::cpu());
  single.setup(model, accel::OptimizerOptions{});
  std::string saved = accel::save_checkpoint((dir_ / "out").string(), st, single, lc, "", w, 2);
  EXPECT_TRUE(fs::exists(fs::path(saved) / "trainer_state.json"));
  EXPECT_FALSE(fs::exists(root / "step_6"));  // the oldest beyond keep_last 2
  EXPECT_TRUE(fs::exists(root / "step_8"));
}

// Issue 26 #13: save_optimizer: false still wrote the optimizer file.
TEST_F(CheckpointInput, SaveOptimizerFalseWritesWeightsOnlyAndResumeSaysUseInitFrom) {
  base_run("base", "--set checkpoint.save_optimizer=false");
  const fs::path step2 = ckpt("base", 2);
  EXPECT_TRUE(fs::exists(step2 / "model.safetensors"));
  EXPECT_FALSE(fs::exists(step2 / "optimizer.rank0.safetensors"));
  nlohmann::json st;
  std::ifstream(step2 / "trainer_state.json") >> st;
  EXPECT_EQ(st["optimizer_saved"], false);
  EXPECT_TRUE(st["optimizer_files"].empty());
  cut_copy("base", "cut");
  Result r = train("cut", "--resume auto --set checkpoint.save_optimizer=false");
  EXPECT_EQ(r.code, 1) << r.output;
  expect_has(r, {"save_optimizer: false", "model.init_from"});
  EXPECT_FALSE(fs::exists(ckpt("cut", 4)));
  // What the message says to do works.
  r = train("fresh", "--set model.init_from=" + step2.string());
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST_F(CheckpointInput, SaveOptimizerFalseWithWeightsOnlyInShardsIsAConfigError) {
  for (const std::string& set :
       {std::string("--set distributed_type=FSDP --set num_processes=2"),
        std::string("--set distributed_type=DEEPSPEED --set num_processes=2 "
                    "--set deepspeed_config.zero_stage=3")}) {
    Result r = train("out", set + " --set checkpoint.save_optimizer=false");
    EXPECT_EQ(r.code, 2) << set << "\n" << r.output;
    expect_has(r, {"checkpoint.save_optimizer"});
    EXPECT_FALSE(fs::exists(dir_ / "out" / "metrics.jsonl"));
  }
}

// Weaker messages: `error: stoll` for a stray folder; negative or huge steps accepted.
TEST_F(CheckpointInput, StrayStepFolderWithAnOutOfRangeNumberIsNamed) {
  base_run();
  const fs::path stray = dir_ / "base" / "checkpoints" / "step_99999999999999999999";
  fs::copy(ckpt("base", 2), stray, fs::copy_options::recursive);
  Result r = train("base", "--resume auto");
  EXPECT_EQ(r.code, 2) << r.output;
  expect_has(r, {stray.string(), "out of range", "rename or remove"});
}

TEST_F(CheckpointInput, BadStepValuesInTrainerStateAreRefusedNamingFileAndValue) {
  base_run();
  struct Case {
    std::string key;
    nlohmann::json value;
    std::string expect;
  };
  std::vector<Case> cases = {
      {"step", -3, "\"step\" is -3"},
      {"step", 1e30, "\"step\" is 1e+30"},
      {"step", 18446744073709551615ull, "\"step\" is 18446744073709551615"},
      {"step", 3, "\"step\" is 3 but the folder is named for step 2"},
      {"optimizer_steps", 5, "\"optimizer_steps\" is 5"},
      {"world_size", 0, "\"world_size\" is 0"},
      {"seed", -1, "\"seed\" is -1"},
      {"loss_scale", -1.0, "\"loss_scale\" is -1.0"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string name = "cut" + std::to_string(i++);
    const fs::path step2 = cut_copy("base", name);
    edit_json(step2 / "trainer_state.json", [&](nlohmann::json& j) { j[c.key] = c.value; });
    Result r = train(name, "--resume auto");
    EXPECT_EQ(r.code, 1) << c.key << " " << c.value << "\n" << r.output;
    expect_has(r, {(step2 / "trainer_state.json").string(), c.expect});
    EXPECT_FALSE(fs::exists(ckpt(name, 4))) << c.key << " " << c.value;
  }
}

}  // namespace
