// Config loading: defaults, every section, extends, env/--set precedence, strict validation with
// helpful messages, Accelerate compatibility (its example files load as is) and the
// config_to_yaml round trip.
#include "runtime/config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace accel {
namespace {

const std::string kData = std::string(ACCEL_TEST_DATA_DIR) + "/config/";

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/accel_config_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // Writes `text` to a file in the temp folder and returns its path.
  std::string write(const std::string& name, const std::string& text) {
    std::string p = dir_ + "/" + name;
    std::ofstream(p) << text;
    return p;
  }
  std::string dir_;
};

// Runs `fn`, expects a ConfigError whose message holds every piece; returns the message.
std::string expect_error(const std::function<void()>& fn, std::vector<std::string> pieces) {
  try {
    fn();
  } catch (const ConfigError& e) {
    std::string msg = e.what();
    for (const auto& p : pieces)
      EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
    return msg;
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

bool has_notice(const Config& c, const std::string& piece) {
  for (const auto& n : c.notices)
    if (n.find(piece) != std::string::npos) return true;
  return false;
}

std::string notices_text(const Config& c) {
  std::string s;
  for (const auto& n : c.notices) s += n + "\n";
  return s;
}

TEST_F(ConfigTest, Defaults) {
  Config c = default_config();
  EXPECT_EQ(c.distributed_type, DistributedType::No);
  EXPECT_EQ(c.mixed_precision, MixedPrecision::No);
  EXPECT_EQ(c.num_processes, 1);
  EXPECT_EQ(c.main_process_port, 29500);
  EXPECT_EQ(c.model.hidden_size, 256);
  EXPECT_EQ(c.model.intermediate_size, 688);
  EXPECT_DOUBLE_EQ(c.model.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.training.max_steps, 100);
  EXPECT_EQ(c.training.device, DeviceChoice::Auto);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.lr_schedule, LrScheduleKind::Cosine);
  EXPECT_EQ(c.data.tokenizer, "byte");
  EXPECT_EQ(c.checkpoint.keep_last, 3);
  EXPECT_EQ(c.logging.metrics_file, "metrics.jsonl");
  EXPECT_EQ(c.fsdp.fsdp_version, 2);
  EXPECT_EQ(c.deepspeed.zero_stage, 2);
  EXPECT_EQ(c.fp8.backend, Fp8Backend::TE);
  EXPECT_EQ(c.fp8.amax_history_len, 1024);
  EXPECT_NO_THROW(validate_config(c));

  Config loaded = load_config("", {}, {});
  EXPECT_EQ(config_to_yaml(loaded), config_to_yaml(c));
  EXPECT_TRUE(loaded.notices.empty()) << notices_text(loaded);
  EXPECT_TRUE(loaded.origins.empty());
}

TEST_F(ConfigTest, EverySectionParsed) {
  Config c = load_config(kData + "full.yaml", {}, {});
  EXPECT_EQ(c.source_path, kData + "full.yaml");
  EXPECT_EQ(c.distributed_type, DistributedType::MultiCpu);
  EXPECT_EQ(c.num_processes, 3);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.main_process_ip, "192.168.1.5");
  EXPECT_EQ(c.main_process_port, 40000);
  const auto& m = c.model;
  EXPECT_EQ(m.hidden_size, 96);
  EXPECT_EQ(m.num_hidden_layers, 3);
  EXPECT_EQ(m.num_attention_heads, 6);
  EXPECT_EQ(m.num_key_value_heads, 2);
  EXPECT_EQ(m.intermediate_size, 256);
  EXPECT_EQ(m.vocab_size, 512);
  EXPECT_EQ(m.max_position_embeddings, 512);
  EXPECT_EQ(m.head_dim, 16);
  EXPECT_DOUBLE_EQ(m.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(m.initializer_range, 0.01);
  EXPECT_TRUE(m.tie_word_embeddings);
  EXPECT_EQ(m.init_from, "");
  const auto& t = c.training;
  EXPECT_EQ(t.seed, 1234u);
  EXPECT_EQ(t.max_steps, 20);
  EXPECT_EQ(t.micro_batch_size, 2);
  EXPECT_EQ(t.seq_len, 32);
  EXPECT_EQ(t.eval_every, 5);
  EXPECT_EQ(t.eval_batches, 2);
  EXPECT_EQ(t.log_every, 2);
  EXPECT_EQ(t.sample_tokens, 16);
  EXPECT_EQ(t.sample_prompt, "Once upon a time: \"quoted\"");
  EXPECT_EQ(t.device, DeviceChoice::Cpu);
  EXPECT_TRUE(t.allow_tf32);
  EXPECT_EQ(t.activation_checkpointing, ActivationCheckpointing::Full);  // true
  EXPECT_EQ(t.nan_policy, NanPolicy::Skip);
  EXPECT_DOUBLE_EQ(t.loss_scale_init, 1024);
  EXPECT_EQ(t.loss_scale_window, 100);
  EXPECT_EQ(t.output_dir, "runs/full");
  EXPECT_EQ(t.progress, ProgressMode::Plain);
  const auto& o = c.optimizer;
  EXPECT_EQ(o.name, OptimizerName::Sgd);
  EXPECT_DOUBLE_EQ(o.lr, 0.05);
  EXPECT_DOUBLE_EQ(o.beta1, 0.8);
  EXPECT_DOUBLE_EQ(o.beta2, 0.99);
  EXPECT_DOUBLE_EQ(o.eps, 1e-6);
  EXPECT_DOUBLE_EQ(o.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(o.momentum, 0.5);
  EXPECT_DOUBLE_EQ(o.grad_clip, 0.0);
  EXPECT_EQ(o.lr_schedule, LrScheduleKind::Linear);
  EXPECT_EQ(o.warmup_steps, 3);
  EXPECT_DOUBLE_EQ(o.min_lr_ratio, 0.0);
  EXPECT_EQ(c.data.source, DataSource::Text);
  EXPECT_EQ(c.data.text_files, (std::vector<std::string>{"a.txt", "b c.txt"}));
  EXPECT_EQ(c.data.tokenizer, "tok/tokenizer.json");
  EXPECT_DOUBLE_EQ(c.data.eval_fraction, 0.1);
  EXPECT_FALSE(c.data.shuffle);
  EXPECT_EQ(c.checkpoint.every_steps, 10);
  EXPECT_EQ(c.checkpoint.keep_last, 0);
  EXPECT_FALSE(c.checkpoint.save_optimizer);
  EXPECT_FALSE(c.checkpoint.at_end);
  EXPECT_EQ(c.logging.metrics_file, "m.jsonl");
  EXPECT_EQ(c.distributed.backend, CommBackend::Cpu);
  EXPECT_DOUBLE_EQ(c.distributed.timeout_s, 30.5);
  EXPECT_DOUBLE_EQ(c.distributed.ddp_bucket_cap_mb, 1);
  EXPECT_TRUE(c.distributed.find_unused_parameters);
  EXPECT_TRUE(c.notices.empty()) << notices_text(c);
  EXPECT_EQ(c.origins.at("training.max_steps"), kData + "full.yaml:24");
}

TEST_F(ConfigTest, Extends) {
  Config c = load_config(kData + "child.yaml", {}, {});
  EXPECT_EQ(c.mixed_precision, MixedPrecision::Bf16);  // from base
  EXPECT_EQ(c.model.hidden_size, 128);                 // from base
  EXPECT_EQ(c.model.num_hidden_layers, 3);             // child overrides base
  EXPECT_EQ(c.training.max_steps, 75);                 // child overrides base
  EXPECT_EQ(c.training.seq_len, 64);                   // from base
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);              // from base
  EXPECT_EQ(c.origins.at("model.hidden_size").rfind(kData + "base.yaml:", 0), 0u);

  // Relative to the including file, recursively.
  Config g = load_config(kData + "sub/grandchild.yaml", {}, {});
  EXPECT_EQ(g.training.micro_batch_size, 2);
  EXPECT_EQ(g.training.max_steps, 75);
  EXPECT_EQ(g.model.hidden_size, 128);

  std::string msg = expect_error([] { load_config(kData + "cycle_a.yaml", {}, {}); },
                                 {"extends cycle", "cycle_a.yaml -> ", "cycle_b.yaml -> "});

  std::string missing = write("missing_base.yaml", "extends: nowhere.yaml\n");
  expect_error([&] { load_config(missing, {}, {}); },
               {missing + ":1", "cannot open config file", "nowhere.yaml"});
  expect_error([] { load_config("/no/such/config.yaml", {}, {}); },
               {"/no/such/config.yaml", "cannot open config file"});
  std::string bad_ext = write("bad_ext.yaml", "extends: {a: 1}\n");
  expect_error([&] { load_config(bad_ext, {}, {}); }, {"extends", "expected a file path"});
}

TEST_F(ConfigTest, EnvironmentAndSetPrecedence) {
  const std::string f = kData + "child.yaml";  // training.max_steps: 75
  EXPECT_EQ(load_config(f, {}, {}).training.max_steps, 75);
  std::map<std::string, std::string> env = {{"ACCEL_TRAINING__MAX_STEPS", "80"},
                                            {"ACCEL_MIXED_PRECISION", "fp16"},
                                            {"ACCEL_DATA__TEXT_FILES", "x.txt, y.txt"},
                                            {"ACCEL_RANK", "3"},  // not a config key: ignored
                                            {"PATH", "/usr/bin"}};
  Config e = load_config(f, {}, env);
  EXPECT_EQ(e.training.max_steps, 80);
  EXPECT_EQ(e.mixed_precision, MixedPrecision::Fp16);
  EXPECT_EQ(e.data.text_files, (std::vector<std::string>{"x.txt", "y.txt"}));
  EXPECT_EQ(e.origins.at("training.max_steps"), "environment variable ACCEL_TRAINING__MAX_STEPS");

  Config s = load_config(f,
                         {"training.max_steps=90", "data.text_files=[p.txt, q.txt]",
                          "fp8_config.exclude_modules=lm_head,layers.0"},
                         env);
  EXPECT_EQ(s.training.max_steps, 90);
  EXPECT_EQ(s.mixed_precision, MixedPrecision::Fp16);  // env still applies where --set is silent
  EXPECT_EQ(s.data.text_files, (std::vector<std::string>{"p.txt", "q.txt"}));
  EXPECT_EQ(s.fp8.exclude_modules, (std::vector<std::string>{"lm_head", "layers.0"}));
  EXPECT_EQ(s.origins.at("training.max_steps"), "--set training.max_steps=90");
  // A repeated --set: the last one wins.
  EXPECT_EQ(load_config(f, {"training.max_steps=1", "training.max_steps=2"}, {}).training.max_steps,
            2);
  // Values with '=' inside, and nested Accelerate sections.
  EXPECT_EQ(load_config("", {"training.sample_prompt=a=b"}, {}).training.sample_prompt, "a=b");
  Config fs = load_config("", {"distributed_type=FSDP", "fsdp_config.fsdp_offload_params=true"},
                          {{"ACCEL_FSDP_CONFIG__FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT"},
                           {"ACCEL_NUM_PROCESSES", "4"},
                           {"ACCEL_DISTRIBUTED_TYPE", "FSDP"}});
  EXPECT_TRUE(fs.fsdp.fsdp_offload_params);
  EXPECT_EQ(fs.fsdp.fsdp_state_dict_type, FsdpStateDictType::Full);
  EXPECT_EQ(fs.num_processes, 4);

  expect_error(
      [&] {
        load_config(f, {}, {{"ACCEL_TRAINING__MAX_STPES", "5"}});
      },
      {"environment variable ACCEL_TRAINING__MAX_STPES", "training.max_stpes",
       "did you mean 'training.max_steps'"});
  expect_error(
      [&] {
        load_config(f, {}, {{"ACCEL_TRAINING__MAX_STEPS", "lots"}});
      },
      {"environment variable ACCEL_TRAINING__MAX_STEPS", "expected an integer", "\"lots\""});
  expect_error([&] { load_config(f, {"training.max_steps"}, {}); },
               {"--set training.max_steps", "expected KEY=VALUE"});
  expect_error([&] { load_config(f, {"extends=base.yaml"}, {}); }, {"extends"});
  expect_error([&] { load_config(f, {"trainng.max_steps=3"}, {}); },
               {"--set trainng.max_steps=3", "unknown key 'trainng.max_steps'",
                "did you mean 'training.max_steps'"});
  expect_error([&] { load_config(f, {"dynamo_config.dynamo_backend=EAGER"}, {}); },
               {"dynamo_config", "as a whole"});
}

TEST_F(ConfigTest, UnknownKeySuggestsTheClosest) {
  std::string p = write("typo.yaml", "model:\n  hidden_size: 64\ntraining:\n  max_stpes: 10\n");
  std::string msg = expect_error(
      [&] { load_config(p, {}, {}); },
      {p + ":4", "unknown key 'training.max_stpes'", "did you mean 'training.max_steps'?"});
  EXPECT_EQ(msg, p + ":4: unknown key 'training.max_stpes'; did you mean 'training.max_steps'?");

  p = write("toplevel.yaml", "max_steps: 10\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"unknown key 'max_steps'", "did you mean 'training.max_steps'?"});
  p = write("fsdp.yaml", "distributed_type: FSDP\nfsdp:\n  fsdp_version: 2\n");
  expect_error([&] { load_config(p, {}, {}); },
               {p + ":2", "unknown key 'fsdp'", "did you mean 'fsdp_config'?"});
  p = write("fp8key.yaml", "fp8_config:\n  amax_history_lenght: 3\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"unknown key 'fp8_config.amax_history_lenght'", "did you mean 'fp8_config.amax_"});
  p = write("far.yaml", "training:\n  zzzzzzzzzzzz: 1\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"unknown key 'training.zzzzzzzzzzzz'", "the closest valid key is 'training.",
                "valid keys in training:", "max_steps"});
  p = write("scalar_parent.yaml", "training:\n  max_steps:\n    value: 3\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"training.max_steps: expected an integer", "got a map"});
}

TEST_F(ConfigTest, WrongTypesNameFileKeyExpectedAndValue) {
  struct Case {
    std::string yaml;
    std::vector<std::string> pieces;
  };
  std::vector<Case> cases = {
      {"training:\n  max_steps: abc\n",
       {":2", "training.max_steps: expected an integer >= 0, got \"abc\""}},
      {"training:\n  max_steps: 1.5\n", {"training.max_steps: expected an integer", "\"1.5\""}},
      {"model:\n  hidden_size: {a: 1}\n", {"model.hidden_size: expected an integer", "got a map"}},
      {"model:\n  hidden_size: [1, 2]\n", {"model.hidden_size", "got a list [1, 2]"}},
      {"data:\n  shuffle: maybe\n", {"data.shuffle: expected a boolean", "\"maybe\""}},
      {"optimizer:\n  lr: fast\n", {"optimizer.lr: expected a number", "\"fast\""}},
      {"optimizer:\n  beta1: 1.5\n", {"optimizer.beta1: expected a number >= 0.0 and < 1.0"}},
      // 1 itself: AdamW's bias correction would divide by 1 - 1^step = 0.
      {"optimizer:\n  beta1: 1\n",
       {"optimizer.beta1: expected a number >= 0.0 and < 1.0", "\"1\""}},
      {"optimizer:\n  beta2: 1.0\n", {"optimizer.beta2: expected a number >= 0.0 and < 1.0"}},
      {"optimizer:\n  eps: 0\n", {"optimizer.eps: expected a number > 0"}},
      {"distributed_type: TPU\n",
       {"distributed_type: expected one of NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED", "\"TPU\""}},
      {"mixed_precision: fp4\n", {"mixed_precision: expected one of no, fp16, bf16, fp8"}},
      {"training:\n  nan_policy: ignore\n", {"training.nan_policy: expected one of stop, skip"}},
      {"optimizer:\n  state_dtype: float16\n",
       {"optimizer.state_dtype: expected one of fp32, bf16", "\"float16\""}},
      {"training: 5\n", {"training: expected a map of training keys", "\"5\""}},
      {"data:\n  text_files: {a: b}\n", {"data.text_files: expected a list of strings"}},
      {"main_process_port: 70000\n", {"main_process_port: expected an integer in 1..65535"}},
      {"num_processes: -1\n", {"num_processes: expected an integer >= 1", "\"-1\""}},
      {"training:\n  seed: -3\n", {"training.seed: expected a non-negative integer"}},
      {"training:\n  seed: 2.5\n", {"training.seed: expected a non-negative integer"}},
      {"training:\n  seed: -1e3\n", {"training.seed: expected a non-negative integer"}},
      {"gpu_ids: 0,x\n", {"gpu_ids: expected all or a comma-separated list"}},
      {"compute_environment: AMAZON_SAGEMAKER\n",
       {"compute_environment: expected one of LOCAL_MACHINE"}},
      {"mixed_precision: fp8\nfp8_config:\n  override_linear_precision: [true, false]\n",
       {"fp8_config.override_linear_precision: expected a list of three booleans"}},
      {"- a\n- b\n", {"the top level must be a map"}},
      {"training:\n  max_steps: [1\n", {"invalid YAML"}},
  };
  int i = 0;
  for (const auto& tc : cases) {
    SCOPED_TRACE(tc.yaml);
    std::string p = write("type" + std::to_string(i++) + ".yaml", tc.yaml);
    std::vector<std::string> pieces = tc.pieces;
    pieces.push_back(p);
    expect_error([&] { load_config(p, {}, {}); }, pieces);
  }
  // Leniency that is not ambiguity: integral floats, yes/no booleans, enum case.
  std::string p = write("lenient.yaml",
                        "fsdp_config:\n  fsdp_min_num_params: 1e8\ndistributed_type: fsdp\n"
                        "data:\n  shuffle: no\nmixed_precision: BF16\n"
                        "training:\n  seed: 1e3\n");
  Config c = load_config(p, {}, {});
  EXPECT_EQ(c.fsdp.fsdp_min_num_params, 100000000);
  EXPECT_EQ(c.training.seed, 1000u);
  EXPECT_EQ(c.distributed_type, DistributedType::Fsdp);
  EXPECT_EQ(c.mixed_precision, MixedPrecision::Bf16);
  EXPECT_FALSE(c.data.shuffle);
}

// An epoch run's effective config, printed before the data is read, loads back as an epoch run:
// the default max_steps must not come back as a given one (which would win over num_epochs).
TEST_F(ConfigTest, EpochRunsPrintedBeforeTheDataLoadBackAsEpochRuns) {
  const Config c = load_config(write("ep.yaml", "training:\n  num_epochs: 1\n"), {}, {});
  const std::string yaml = config_to_yaml(c);
  EXPECT_EQ(yaml.find("max_steps: 100"), std::string::npos) << yaml;
  const Config again = load_config(write("ep2.yaml", yaml), {}, {});
  EXPECT_EQ(again.origins.count("training.max_steps"), 0u) << yaml;
  EXPECT_EQ(again.training.num_epochs, 1.0);
  // Once given (or computed from the data, which records where it came from), it is written.
  const Config given =
      load_config(write("ep3.yaml", "training:\n  num_epochs: 1\n  max_steps: 7\n"), {}, {});
  EXPECT_NE(config_to_yaml(given).find("max_steps: 7"), std::string::npos);
}

TEST_F(ConfigTest, OptimizerStateDtype) {
  // Default fp32; bf16 from the file or --set, written back by config_to_yaml.
  Config d = load_config(write("sd0.yaml", "training:\n  max_steps: 3\n"), {}, {});
  EXPECT_EQ(d.optimizer.state_dtype, StateDType::Fp32);
  EXPECT_NE(config_to_yaml(d).find("state_dtype: fp32"), std::string::npos);
  const std::string p = write("sd1.yaml", "optimizer:\n  state_dtype: bf16\n");
  Config c = load_config(p, {}, {});
  EXPECT_EQ(c.optimizer.state_dtype, StateDType::Bf16);
  const std::string yaml = config_to_yaml(c);
  EXPECT_NE(yaml.find("state_dtype: bf16"), std::string::npos) << yaml;
  Config again = load_config(write("sd2.yaml", yaml), {}, {});
  EXPECT_EQ(again.optimizer.state_dtype, StateDType::Bf16);
  Config set = load_config("", {"optimizer.state_dtype=bf16"}, {});
  EXPECT_EQ(set.optimizer.state_dtype, StateDType::Bf16);
  // SGD's momentum buffer may be bf16 too.
  Config sgd =
      load_config(write("sd4.yaml", "optimizer:\n  name: sgd\n  state_dtype: bf16\n"), {}, {});
  EXPECT_EQ(sgd.optimizer.state_dtype, StateDType::Bf16);
  // beta2 too close to 1 for round-to-nearest bf16 moments: a notice, no error.
  auto has_notice = [](const Config& x) {
    for (const std::string& n : x.notices)
      if (n.find("optimizer.state_dtype bf16 with optimizer.beta2=0.999") != std::string::npos)
        return true;
    return false;
  };
  EXPECT_FALSE(has_notice(c));
  Config b =
      load_config(write("sd5.yaml", "optimizer:\n  state_dtype: bf16\n  beta2: 0.999\n"), {}, {});
  EXPECT_TRUE(has_notice(b));
  Config b32 = load_config(write("sd6.yaml", "optimizer:\n  beta2: 0.999\n"), {}, {});
  EXPECT_FALSE(has_notice(b32));
}

TEST_F(ConfigTest, ActivationCheckpointingModes) {
  using AC = ActivationCheckpointing;
  EXPECT_EQ(load_config("", {}, {}).training.activation_checkpointing, AC::None);
  // The modes by name (any case), and the boolean the key was before them.
  const std::pair<const char*, AC> spellings[] = {{"none", AC::None},           {"full", AC::Full},
                                                  {"Selective", AC::Selective}, {"true", AC::Full},
                                                  {"false", AC::None},          {"yes", AC::Full}};
  for (const auto& [text, mode] : spellings) {
    SCOPED_TRACE(text);
    const Config c =
        load_config("", {std::string("training.activation_checkpointing=") + text}, {});
    EXPECT_EQ(c.training.activation_checkpointing, mode);
    // config.yaml writes the mode's name, which loads back to the same mode.
    const Config again = load_config(write("ac.yaml", config_to_yaml(c)), {}, {});
    EXPECT_EQ(again.training.activation_checkpointing, mode);
  }
  expect_error([] { load_config("", {"training.activation_checkpointing=partial"}, {}); },
               {"training.activation_checkpointing", "none, full, selective", "partial"});
  // Accelerate's FSDP boolean is full recomputation, unless the training key chose a mode.
  auto fsdp_with = [](std::vector<std::string> sets) {
    sets.insert(sets.end(), {"distributed_type=FSDP", "num_processes=2",
                             "fsdp_config.fsdp_activation_checkpointing=true"});
    return load_config("", sets, {});
  };
  const Config fsdp = fsdp_with({});
  EXPECT_EQ(fsdp.training.activation_checkpointing, AC::Full);
  const Config selective = fsdp_with({"training.activation_checkpointing=selective"});
  EXPECT_EQ(selective.training.activation_checkpointing, AC::Selective);
  EXPECT_TRUE(selective.fsdp.fsdp_activation_checkpointing);
  // none is a mode too: it wins, and the boolean is named as having no effect.
  const Config none = fsdp_with({"training.activation_checkpointing=none"});
  EXPECT_EQ(none.training.activation_checkpointing, AC::None);
  EXPECT_FALSE(none.fsdp.fsdp_activation_checkpointing);
  bool named = false;
  for (const auto& n : none.notices)
    named |=
        n.find("fsdp_config.fsdp_activation_checkpointing=true has no effect") != std::string::npos;
  EXPECT_TRUE(named);
}

TEST_F(ConfigTest, OptimizerMasterWeights) {
  // Default fp32; bf16 under bf16 or fp8 compute, written back by config_to_yaml.
  Config d = load_config(write("mw0.yaml", "training:\n  max_steps: 3\n"), {}, {});
  EXPECT_EQ(d.optimizer.master_weights, StateDType::Fp32);
  EXPECT_NE(config_to_yaml(d).find("master_weights: fp32"), std::string::npos);
  for (const char* precision : {"bf16", "fp8"}) {
    SCOPED_TRACE(precision);
    Config c = load_config(
        "", {std::string("mixed_precision=") + precision, "optimizer.master_weights=bf16"}, {});
    EXPECT_EQ(c.optimizer.master_weights, StateDType::Bf16);
    const std::string yaml = config_to_yaml(c);
    EXPECT_NE(yaml.find("master_weights: bf16"), std::string::npos) << yaml;
    EXPECT_EQ(load_config(write("mw1.yaml", yaml), {}, {}).optimizer.master_weights,
              StateDType::Bf16);
  }
  // fp32 compute has no master copy to drop; fp16 weights cannot be bf16 masters. Both keys named.
  const std::string fp32 = write("mw2.yaml", "optimizer:\n  master_weights: bf16\n");
  expect_error([&] { load_config(fp32, {}, {}); },
               {"optimizer.master_weights", "mixed_precision is no",
                "fp32 training computes on its fp32 masters",
                "Set mixed_precision: bf16 (or fp8), or optimizer.master_weights: fp32"});
  const std::string fp16 =
      write("mw3.yaml", "mixed_precision: fp16\noptimizer:\n  master_weights: bf16\n");
  expect_error([&] { load_config(fp16, {}, {}); },
               {"optimizer.master_weights", "mixed_precision is fp16", "mw3.yaml:1",
                "fp16 compute weights cannot be bf16 masters"});
  expect_error(
      [&] { load_config(write("mw4.yaml", "optimizer:\n  master_weights: fp16\n"), {}, {}); },
      {"optimizer.master_weights: expected one of fp32, bf16"});
}

TEST_F(ConfigTest, ImpossibleCombinationsFail) {
  struct Case {
    std::string yaml;
    std::vector<std::string> pieces;
  };
  std::vector<Case> cases = {
      {"distributed_type: MULTI_GPU\nnum_processes: 2\nfsdp_config:\n  fsdp_offload_params: true\n",
       {"fsdp_config.fsdp_offload_params", "only to distributed_type FSDP",
        "distributed_type is MULTI_GPU"}},
      {"distributed_type: FSDP\ndeepspeed_config:\n  zero_stage: 2\n",
       {"deepspeed_config.zero_stage", "only to distributed_type DEEPSPEED"}},
      {"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 0\n",
       {"zero_stage 0 is not supported: use 1, 2 or 3"}},
      {"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n",
       {"deepspeed_config.zero_stage: expected an integer in 0..3"}},
      {"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
       "  offload_param_device: cpu\n",
       {"offload_param_device cpu needs zero_stage 3"}},
      {"distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_optimizer_device: nvme\n",
       {"nvme is not supported"}},
      {"model:\n  hidden_size: 100\n  num_attention_heads: 3\n",
       {"model.hidden_size 100 is not divisible by model.num_attention_heads 3"}},
      {"model:\n  num_attention_heads: 4\n  num_key_value_heads: 3\n",
       {"model.num_attention_heads 4 is not divisible by model.num_key_value_heads 3"}},
      {"model:\n  num_attention_heads: 4\n  num_key_value_heads: 8\n",
       {"not divisible by model.num_key_value_heads 8"}},
      {"mixed_precision: fp8\nfp8_config:\n  fp8_format: E5M2\n",
       {"fp8_format E5M2 is rejected for training", "HYBRID"}},
      {"mixed_precision: fp8\nfp8_config:\n  backend: MSAMP\n",
       {"fp8_config.backend MSAMP is not supported with mixed_precision fp8", "TE", "AO"}},
      {"mixed_precision: fp8\nfp8_config:\n  backend: MS-AMP\n", {"MSAMP is not supported"}},
      {"mixed_precision: fp8\nfp8_config:\n  backend: AO\n  use_mxfp8_block_scaling: true\n",
       {"fp8_config.use_mxfp8_block_scaling is a TE option", "backend TE"}},
      {"distributed_type: FSDP\nnum_processes: 2\nmixed_precision: fp8\nfp8_config:\n"
       "  backend: TE\n  enable_fsdp_float8_all_gather: true\n",
       {"fp8_config.enable_fsdp_float8_all_gather needs fp8_config.backend: AO"}},
      {"mixed_precision: fp8\nfp8_config:\n  backend: XYZ\n",
       {"fp8_config.backend: expected one of TE, AO, MSAMP"}},
      {"num_processes: 0\n", {"num_processes: expected an integer >= 1"}},
      {"num_processes: 2\n", {"num_processes is 2 but distributed_type is NO"}},
      {"distributed_type: MULTI_GPU\nnum_machines: 2\nmachine_rank: 2\nnum_processes: 4\n",
       {"machine_rank 2 is outside 0..1"}},
      {"distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\n",
       {"num_processes 3 is not a multiple of num_machines 2"}},
      {"use_cpu: true\ntraining:\n  device: cuda\n",
       {"training.device is cuda but use_cpu is true"}},
      {"distributed_type: MULTI_CPU\ntraining:\n  device: cuda\n",
       {"training.device is cuda but distributed_type is MULTI_CPU"}},
      {"training:\n  device: cpu\ndistributed:\n  backend: nccl\n",
       {"distributed.backend nccl needs GPU tensors"}},
      {"data:\n  source: shards\n", {"data.source is shards but data.train_path is empty"}},
      {"training:\n  seq_len: 4096\n", {"training.seq_len 4096 exceeds model.max_position"}},
      {"training:\n  eval_every: 10\ndata:\n  source: synthetic\n",
       {"training.eval_every is 10 but data.source synthetic has no evaluation data"}},
      {"training:\n  eval_every: 10\ndata:\n  eval_fraction: 0\n",
       {"training.eval_every is 10 but the data has no evaluation split", "eval_fraction"}},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n",
       {"NO_SHARD", "MULTI_GPU"}},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 4\n",
       {"hybrid sharding", "not implemented"}},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: HYBRID_SHARD\n",
       {"HYBRID_SHARD is not supported"}},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n",
       {"fsdp_config.fsdp_version: expected an integer in 1..2"}},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n",
       {"expected one of SHARDED_STATE_DICT, FULL_STATE_DICT"}},
      {"tp_config:\n  tp_size: 2\n", {"tp_config.tp_size = 2", "not implemented"}},
      {"parallelism_config:\n  parallelism_config_cp_size: 2\n", {"cp_size = 2"}},
      {"distributed_type: MULTI_GPU\nnum_processes: 4\ngpu_ids: 0,1\n",
       {"gpu_ids 0,1 lists 2 GPU(s) but 4 processes run on each machine"}},
  };
  int i = 0;
  for (const auto& tc : cases) {
    SCOPED_TRACE(tc.yaml);
    std::string p = write("combo" + std::to_string(i++) + ".yaml", tc.yaml);
    std::vector<std::string> pieces = tc.pieces;
    pieces.push_back(p);
    expect_error([&] { load_config(p, {}, {}); }, pieces);
  }
  // The message names where distributed_type came from, even across layers.
  std::string p = write("ddp_fsdp.yaml", "fsdp_config:\n  fsdp_version: 2\n");
  expect_error(
      [&] {
        load_config(p, {"distributed_type=MULTI_GPU", "num_processes=2"}, {});
      },
      {p + ":2", "--set distributed_type=MULTI_GPU"});
  // validate_config catches the same rules on a Config changed in code.
  Config c = default_config();
  c.model.num_key_value_heads = 3;
  EXPECT_THROW(validate_config(c), ConfigError);
}

TEST_F(ConfigTest, Fp8HistoryKeysBothSpellings) {
  std::string p = write("fp8a.yaml",
                        "mixed_precision: fp8\nfp8_config:\n  amax_history_length: 16\n"
                        "  amax_compute_algorithm: max\n");
  Config a = load_config(p, {}, {});
  EXPECT_EQ(a.fp8.amax_history_len, 16);
  EXPECT_EQ(a.fp8.amax_compute_algo, AmaxComputeAlgo::Max);
  p = write(
      "fp8b.yaml",
      "mixed_precision: fp8\nfp8_config:\n  amax_history_len: 32\n  amax_compute_algo: max\n");
  Config b = load_config(p, {}, {});
  EXPECT_EQ(b.fp8.amax_history_len, 32);
  EXPECT_EQ(b.fp8.amax_compute_algo, AmaxComputeAlgo::Max);
  // Both spellings, same value: fine.
  p = write("fp8same.yaml",
            "mixed_precision: fp8\nfp8_config:\n  amax_history_len: 8\n  amax_history_length: 8\n");
  EXPECT_EQ(load_config(p, {}, {}).fp8.amax_history_len, 8);
  // Both spellings, different values: an error naming both.
  p = write(
      "fp8conflict.yaml",
      "mixed_precision: fp8\nfp8_config:\n  amax_history_len: 8\n  amax_history_length: 16\n");
  expect_error([&] { load_config(p, {}, {}); },
               {p + ":4", "fp8_config.amax_history_length = 16", "conflicts with",
                "fp8_config.amax_history_len = 8", p + ":3"});
  p = write("fp8conflict2.yaml",
            "mixed_precision: fp8\nfp8_config:\n  amax_compute_algorithm: max\n"
            "  amax_compute_algo: most_recent\n");
  expect_error(
      [&] { load_config(p, {}, {}); },
      {"amax_compute_algo = most_recent conflicts with fp8_config.amax_compute_algorithm"});
  // Across layers, the later layer simply wins.
  Config l = load_config(kData + "accelerate_fp8.yaml", {"fp8_config.amax_history_len=64"}, {});
  EXPECT_EQ(l.fp8.amax_history_len, 64);
  // The effective config uses the canonical spelling only.
  std::string y = config_to_yaml(a);
  EXPECT_NE(y.find("amax_history_len: 16"), std::string::npos) << y;
  EXPECT_EQ(y.find("amax_history_length"), std::string::npos) << y;
}

TEST_F(ConfigTest, DeepSpeedMirrorsTopLevelKeys) {
  std::string p = write("ds_ok.yaml",
                        "distributed_type: DEEPSPEED\ngradient_accumulation_steps: 4\n"
                        "deepspeed_config:\n  gradient_accumulation_steps: 4\n"
                        "  gradient_clipping: 0.5\n");
  Config c = load_config(p, {}, {});
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_EQ(c.deepspeed.gradient_accumulation_steps, 4);
  EXPECT_DOUBLE_EQ(c.optimizer.grad_clip, 0.5);
  EXPECT_DOUBLE_EQ(c.deepspeed.gradient_clipping, 0.5);
  p = write("ds_gas.yaml",
            "distributed_type: DEEPSPEED\ngradient_accumulation_steps: 2\n"
            "deepspeed_config:\n  gradient_accumulation_steps: 4\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"deepspeed_config.gradient_accumulation_steps = 4 conflicts with "
                "gradient_accumulation_steps = 2"});
  p = write("ds_clip.yaml",
            "distributed_type: DEEPSPEED\noptimizer:\n  grad_clip: 1.0\n"
            "deepspeed_config:\n  gradient_clipping: 0.5\n");
  expect_error(
      [&] { load_config(p, {}, {}); },
      {"deepspeed_config.gradient_clipping = 0.5 conflicts with optimizer.grad_clip = 1.0 ("});
  // --set of the top-level key overrides the file's deepspeed value (a later layer).
  Config s =
      load_config(kData + "accelerate_deepspeed.yaml", {"gradient_accumulation_steps=8"}, {});
  EXPECT_EQ(s.gradient_accumulation_steps, 8);
  EXPECT_EQ(s.deepspeed.gradient_accumulation_steps, 8);
}

TEST_F(ConfigTest, AccelerateFsdp1ExampleLoads) {
  Config c = load_config(kData + "accelerate_fsdp1.yaml", {}, {});
  EXPECT_EQ(c.distributed_type, DistributedType::Fsdp);
  EXPECT_EQ(c.mixed_precision, MixedPrecision::Bf16);
  EXPECT_EQ(c.num_processes, 2);
  EXPECT_TRUE(c.fsdp.present);
  EXPECT_EQ(c.fsdp.fsdp_version, 2);
  EXPECT_TRUE(c.fsdp.fsdp_reshard_after_forward);  // FULL_SHARD
  EXPECT_TRUE(c.fsdp.fsdp_cpu_ram_efficient_loading);
  EXPECT_EQ(c.fsdp.fsdp_state_dict_type, FsdpStateDictType::Sharded);
  EXPECT_EQ(c.fsdp.fsdp_transformer_layer_cls_to_wrap, "LlamaDecoderLayer");
  EXPECT_FALSE(c.use_cpu);
  EXPECT_TRUE(c.gpu_id_list.empty());
  // Kept, and explained when they would have meant something.
  EXPECT_EQ(c.inert.at("fsdp_config.fsdp_forward_prefetch"), "false");
  EXPECT_EQ(c.inert.at("tpu_env"), "[]");
  EXPECT_TRUE(has_notice(c,
                         "key fsdp_config.fsdp_forward_prefetch=false has no effect in "
                         "accel-train (the next unit's all-gather is always prefetched in "
                         "forward)"))
      << notices_text(c);
  EXPECT_TRUE(has_notice(c, "fsdp_transformer_layer_cls_to_wrap=BertLayer names no layer"))
      << notices_text(c);
  // Neutral values make no noise.
  EXPECT_FALSE(has_notice(c, "tpu_env")) << notices_text(c);
  EXPECT_FALSE(has_notice(c, "debug")) << notices_text(c);
  EXPECT_FALSE(has_notice(c, "rdzv_backend")) << notices_text(c);
  EXPECT_FALSE(has_notice(c, "fsdp_sync_module_states")) << notices_text(c);
  EXPECT_EQ(c.notices.size(), 2u) << notices_text(c);
  // Another family with the default (Llama's name): its own layer, and no notice about it.
  const Config q =
      load_config("", {"distributed_type=FSDP", "num_processes=2", "model.name=qwen3"}, {});
  EXPECT_EQ(q.fsdp.fsdp_transformer_layer_cls_to_wrap, "Qwen3DecoderLayer");
  EXPECT_FALSE(has_notice(q, "names no layer")) << notices_text(q);
}

TEST_F(ConfigTest, AccelerateFsdp2ExampleLoads) {
  Config c = load_config(kData + "accelerate_fsdp2.yaml", {}, {});
  EXPECT_EQ(c.distributed_type, DistributedType::Fsdp);
  EXPECT_EQ(c.num_processes, 8);
  EXPECT_FALSE(c.fsdp.fsdp_reshard_after_forward);
  EXPECT_TRUE(c.fsdp.fsdp_activation_checkpointing);
  // The two switches agree: Accelerate's boolean is full recomputation.
  EXPECT_EQ(c.training.activation_checkpointing, ActivationCheckpointing::Full);
  EXPECT_EQ(c.fsdp.fsdp_state_dict_type, FsdpStateDictType::Full);
  EXPECT_TRUE(c.notices.empty()) << notices_text(c);

  // FSDP1 version: runs FSDP2-style, says so.
  Config v1 = load_config(kData + "accelerate_fsdp2.yaml", {"fsdp_config.fsdp_version=1"}, {});
  EXPECT_EQ(v1.fsdp.fsdp_version, 2);
  EXPECT_TRUE(has_notice(v1, "fsdp_version=1 runs as fsdp_version 2")) << notices_text(v1);
  // The sharding-strategy spelling conflicts with reshard_after_forward within one layer.
  std::string p = write("fsdp_conflict.yaml",
                        "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: true\n"
                        "  fsdp_sharding_strategy: SHARD_GRAD_OP\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"fsdp_config.fsdp_sharding_strategy = false conflicts with "
                "fsdp_config.fsdp_reshard_after_forward = true"});
  p = write("fsdp_strategy_int.yaml",
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 2\n");
  EXPECT_FALSE(load_config(p, {}, {}).fsdp.fsdp_reshard_after_forward);
}

TEST_F(ConfigTest, AccelerateDeepSpeedExamplesLoad) {
  Config c = load_config(kData + "accelerate_deepspeed.yaml", {}, {});
  EXPECT_EQ(c.distributed_type, DistributedType::DeepSpeed);
  EXPECT_TRUE(c.deepspeed.present);
  EXPECT_EQ(c.deepspeed.zero_stage, 3);
  EXPECT_EQ(c.deepspeed.offload_optimizer_device, OffloadDevice::Cpu);
  EXPECT_EQ(c.deepspeed.offload_param_device, OffloadDevice::Cpu);
  EXPECT_TRUE(c.deepspeed.zero3_save_16bit_model);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_DOUBLE_EQ(c.optimizer.grad_clip, 1.0);
  EXPECT_TRUE(has_notice(c, "key deepspeed_config.zero3_init_flag=true has no effect"))
      << notices_text(c);

  // The JSON-file form: known DeepSpeed keys are applied, the rest are listed in a notice.
  Config f = load_config(kData + "accelerate_deepspeed_file.yaml", {}, {});
  EXPECT_EQ(f.deepspeed.deepspeed_config_file, kData + "zero_stage2_config.json");
  EXPECT_EQ(f.deepspeed.zero_stage, 2);
  EXPECT_EQ(f.deepspeed.offload_optimizer_device, OffloadDevice::Cpu);
  EXPECT_EQ(f.mixed_precision, MixedPrecision::Fp16);
  EXPECT_DOUBLE_EQ(f.training.loss_scale_init, 4096);
  EXPECT_EQ(f.training.loss_scale_window, 500);
  EXPECT_EQ(f.gradient_accumulation_steps, 2);
  EXPECT_DOUBLE_EQ(f.optimizer.grad_clip, 0.5);
  EXPECT_EQ(f.training.micro_batch_size, 4);
  EXPECT_EQ(f.optimizer.name, OptimizerName::AdamW);
  EXPECT_DOUBLE_EQ(f.optimizer.lr, 3e-4);  // "auto": left alone
  EXPECT_DOUBLE_EQ(f.optimizer.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(f.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(f.optimizer.eps, 1e-6);
  EXPECT_TRUE(has_notice(f, "scheduler")) << notices_text(f);
  EXPECT_TRUE(has_notice(f, "zero_optimization.overlap_comm")) << notices_text(f);
  EXPECT_FALSE(has_notice(f, "train_batch_size")) << notices_text(f);  // "auto"

  // A YAML key that contradicts the JSON file in the same layer is an error.
  std::string p = write("ds_json_conflict.yaml",
                        "distributed_type: DEEPSPEED\ngradient_accumulation_steps: 3\n"
                        "deepspeed_config:\n  deepspeed_config_file: " +
                            kData + "zero_stage2_config.json\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"gradient_accumulation_steps", "conflicts with", "zero_stage2_config.json"});
  p = write("ds_json_missing.yaml",
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nope.json\n");
  expect_error([&] { load_config(p, {}, {}); },
               {p + ":3", "cannot open the DeepSpeed config file", "nope.json"});
}

TEST_F(ConfigTest, AccelerateMultiGpuAndCpuExamplesLoad) {
  Config g = load_config(kData + "accelerate_multi_gpu.yaml", {}, {});
  EXPECT_EQ(g.distributed_type, DistributedType::MultiGpu);
  EXPECT_EQ(g.mixed_precision, MixedPrecision::Fp16);
  EXPECT_EQ(g.num_processes, 16);
  EXPECT_EQ(g.num_machines, 2);
  EXPECT_EQ(g.machine_rank, 1);
  EXPECT_EQ(g.main_process_ip, "10.0.0.1");
  EXPECT_EQ(g.main_process_port, 29501);
  EXPECT_EQ(g.gpu_ids, "all");
  EXPECT_TRUE(g.notices.empty()) << notices_text(g);

  Config c = load_config(kData + "accelerate_multi_cpu.yaml", {}, {});
  EXPECT_EQ(c.distributed_type, DistributedType::MultiCpu);
  EXPECT_TRUE(c.use_cpu);
  EXPECT_EQ(c.training.device, DeviceChoice::Cpu);
  EXPECT_EQ(c.mixed_precision, MixedPrecision::No);
  EXPECT_TRUE(has_notice(c,
                         "key mpirun_config={mpirun_ccl: \"1\", mpirun_hostfile: "
                         "/home/user/hostfile} has no effect"))
      << notices_text(c);
  EXPECT_FALSE(has_notice(c, "ipex_config")) << notices_text(c);  // ipex: false

  // gpu_ids is honoured: local rank r uses the r-th id.
  Config ids = load_config(kData + "accelerate_multi_gpu.yaml", {"gpu_ids=2,3,4,5,6,7,0,1"}, {});
  EXPECT_EQ(ids.gpu_id_list, (std::vector<int>{2, 3, 4, 5, 6, 7, 0, 1}));
  // use_cpu is honoured: it selects the CPU.
  Config cpu = load_config("", {"use_cpu=true"}, {});
  EXPECT_EQ(cpu.training.device, DeviceChoice::Cpu);
}

TEST_F(ConfigTest, AccelerateFp8ExamplesLoad) {
  Config c = load_config(kData + "accelerate_fp8.yaml", {}, {});
  EXPECT_EQ(c.mixed_precision, MixedPrecision::Fp8);
  EXPECT_TRUE(c.fp8.present);
  EXPECT_EQ(c.fp8.backend, Fp8Backend::TE);
  EXPECT_EQ(c.fp8.fp8_format, Fp8Format::Hybrid);
  EXPECT_EQ(c.fp8.amax_history_len, 16);
  EXPECT_EQ(c.fp8.amax_compute_algo, AmaxComputeAlgo::Max);
  EXPECT_FALSE(c.fp8.override_linear_precision_fprop);
  EXPECT_FALSE(c.fp8.override_linear_precision_dgrad);
  EXPECT_TRUE(c.fp8.override_linear_precision_wgrad);
  EXPECT_TRUE(c.notices.empty()) << notices_text(c);

  Config t = load_config(kData + "accelerate_fp8_template.yaml", {}, {});
  EXPECT_EQ(t.distributed_type, DistributedType::No);
  EXPECT_EQ(t.fp8.fp8_format, Fp8Format::E4M3);
  EXPECT_EQ(t.fp8.amax_history_len, 1024);
  EXPECT_FALSE(t.fp8.override_linear_precision_wgrad);

  // The wizard's plain `false` for override_linear_precision.
  std::string p = write("olp.yaml",
                        "mixed_precision: fp8\nfp8_config:\n"
                        "  override_linear_precision: false\n");
  EXPECT_FALSE(load_config(p, {}, {}).fp8.override_linear_precision_fprop);

  // AO backend with TE-only keys, fp8 on the CPU, fp8_config without fp8: notices.
  Config ao = load_config(kData + "accelerate_fp8.yaml",
                          {"fp8_config.backend=AO", "use_cpu=true", "distributed_type=MULTI_CPU",
                           "fp8_config.pad_inner_dim=true"},
                          {});
  EXPECT_EQ(ao.fp8.backend, Fp8Backend::AO);
  EXPECT_TRUE(ao.fp8.pad_inner_dim);
  EXPECT_TRUE(has_notice(ao, "fp8_config.amax_history_len has no effect with fp8 backend AO"))
      << notices_text(ao);
  EXPECT_TRUE(has_notice(ao, "exact fp8 emulation")) << notices_text(ao);
  Config bf = load_config(kData + "accelerate_fp8.yaml", {"mixed_precision=bf16"}, {});
  EXPECT_TRUE(has_notice(bf, "fp8_config (fp8_config.")) << notices_text(bf);
  EXPECT_TRUE(has_notice(bf, "has no effect because mixed_precision is bf16")) << notices_text(bf);
}

// fp8_config.recipe_name: torchao's recipe names (and blockwise), valid only with backend AO.
TEST_F(ConfigTest, Fp8RecipeNameChoosesTheAoRecipe) {
  const std::vector<std::string> ao = {"mixed_precision=fp8", "fp8_config.backend=AO"};
  EXPECT_EQ(load_config(kData + "accelerate_fp8.yaml", ao, {}).fp8.recipe_name,
            Fp8RecipeName::Tensorwise);
  for (const auto& [text, value] : std::vector<std::pair<std::string, Fp8RecipeName>>{
           {"tensorwise", Fp8RecipeName::Tensorwise},
           {"rowwise", Fp8RecipeName::Rowwise},
           {"rowwise_with_gw_hp", Fp8RecipeName::RowwiseWithGwHp},
           {"blockwise", Fp8RecipeName::Blockwise}}) {
    std::vector<std::string> sets = ao;
    sets.push_back("fp8_config.recipe_name=" + text);
    Config c = load_config(kData + "accelerate_fp8.yaml", sets, {});
    EXPECT_EQ(c.fp8.recipe_name, value) << text;
    // --print-config and config.yaml show it, and it reads back.
    std::string y = config_to_yaml(c);
    EXPECT_NE(y.find("recipe_name: " + text), std::string::npos) << y;
  }
  expect_error(
      [&] {
        load_config(
            kData + "accelerate_fp8.yaml",
            {"mixed_precision=fp8", "fp8_config.backend=AO", "fp8_config.recipe_name=axiswise"},
            {});
      },
      {"fp8_config.recipe_name", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"});
  expect_error(
      [&] {
        load_config(
            kData + "accelerate_fp8.yaml",
            {"mixed_precision=fp8", "fp8_config.backend=TE", "fp8_config.recipe_name=rowwise"}, {});
      },
      {"fp8_config.recipe_name rowwise needs fp8_config.backend: AO"});
  std::string p = write("rw_fsdp.yaml",
                        "mixed_precision: fp8\ndistributed_type: FSDP\nnum_processes: 2\n"
                        "fp8_config:\n  backend: AO\n  recipe_name: blockwise\n"
                        "  enable_fsdp_float8_all_gather: true\n");
  expect_error([&] { load_config(p, {}, {}); },
               {"fp8_config.enable_fsdp_float8_all_gather needs fp8_config.recipe_name: "
                "tensorwise"});
}

TEST_F(ConfigTest, InertKeysAreKeptAndExplained) {
  std::string p = write("inert.yaml",
                        "debug: true\nmain_training_function: train\nrdzv_backend: c10d\n"
                        "dynamo_config:\n  dynamo_backend: INDUCTOR\nsame_network: false\n"
                        "megatron_lm_config: {}\n");
  Config c = load_config(p, {}, {});
  EXPECT_TRUE(has_notice(c,
                         "key debug=true has no effect in accel-train (accel-train has no "
                         "separate debug mode)"))
      << notices_text(c);
  EXPECT_TRUE(has_notice(c, "key main_training_function=train has no effect")) << notices_text(c);
  EXPECT_TRUE(has_notice(c, "key rdzv_backend=c10d has no effect")) << notices_text(c);
  EXPECT_TRUE(has_notice(c, "key dynamo_config={dynamo_backend: INDUCTOR} has no effect"))
      << notices_text(c);
  EXPECT_EQ(c.notices.size(), 4u) << notices_text(c);
  EXPECT_EQ(c.inert.at("same_network"), "false");
  // An empty value means the built-in default.
  p = write("null.yaml", "training:\n  max_steps:\n  seq_len: 64\n");
  Config n = load_config(p, {"training.log_every=5"}, {});
  EXPECT_EQ(n.training.max_steps, 100);
  EXPECT_EQ(n.training.seq_len, 64);
}

TEST_F(ConfigTest, RoundTripThroughConfigToYaml) {
  for (const char* f :
       {"full.yaml", "child.yaml", "accelerate_fsdp1.yaml", "accelerate_fsdp2.yaml",
        "accelerate_deepspeed.yaml", "accelerate_deepspeed_file.yaml", "accelerate_multi_gpu.yaml",
        "accelerate_multi_cpu.yaml", "accelerate_fp8.yaml", "accelerate_fp8_template.yaml"}) {
    SCOPED_TRACE(f);
    Config a = load_config(kData + f,
                           {"training.sample_prompt=line one\nline \"two\"\t\\ end",
                            "optimizer.lr=0.000123456789012345"},
                           {});
    std::string y1 = config_to_yaml(a);
    std::string p = write(std::string("rt_") + f, y1);
    Config b = load_config(p, {}, {});
    std::string y2 = config_to_yaml(b);
    EXPECT_EQ(y1, y2);
    EXPECT_EQ(b.training.sample_prompt, "line one\nline \"two\"\t\\ end");
    EXPECT_EQ(b.optimizer.lr, 0.000123456789012345);
    EXPECT_EQ(b.distributed_type, a.distributed_type);
    EXPECT_EQ(b.inert, a.inert);
    EXPECT_EQ(b.fp8.amax_history_len, a.fp8.amax_history_len);
    EXPECT_EQ(b.data.text_files, a.data.text_files);
  }
  // Every documented key that has a value appears in the output.
  std::string y = config_to_yaml(load_config(kData + "accelerate_deepspeed.yaml", {}, {}));
  for (const char* k : {"zero_stage: 3", "gradient_clipping: 1.0", "max_steps: 100",
                        "mixed_precision: bf16", "zero3_init_flag: true", "metrics_file:"})
    EXPECT_NE(y.find(k), std::string::npos) << k << "\n" << y;
  EXPECT_NE(config_to_yaml(default_config()).find("mixed_precision: \"no\""), std::string::npos);
}

TEST_F(ConfigTest, EveryKeyIsDocumented) {
  std::ifstream in(std::string(ACCEL_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md is missing";
  std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // docs/config.md embeds the generated tables verbatim.
  EXPECT_NE(doc.find(config_reference_markdown()), std::string::npos)
      << "docs/config.md is out of date: paste config_reference_markdown() into it";
  for (const auto& k : config_keys()) {
    std::string leaf =
        k.path.substr(k.path.rfind('.') == std::string::npos ? 0 : k.path.rfind('.') + 1);
    EXPECT_NE(doc.find("| `" + leaf + "` |"), std::string::npos) << k.path;
    EXPECT_FALSE(k.doc.empty()) << k.path;
  }
  EXPECT_NE(doc.find("ACCEL_TRAINING__MAX_STEPS"), std::string::npos);
}

}  // namespace
}  // namespace accel
