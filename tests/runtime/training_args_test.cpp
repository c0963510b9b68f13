// Hugging Face TrainingArguments (training_args: in the YAML, accel-train --training-args): every
// field of a transformers dump is known, mapped values land in our keys with the mapping listed
// as notices, values we cannot honour are refused by name, settings given twice disagreeing are
// errors naming both; plus the Trainer/Accelerate-aware suggestions for unknown keys.
#include "runtime/training_args.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/config.h"
#include "tests/runtime/config_test_util.h"

namespace accel {
namespace {

using config_test::has_notice;
using config_test::notices_text;
using config_test::spelled;

const std::string kData = std::string(ACCEL_TEST_DATA_DIR) + "/config/";
const std::string kArgs = kData + "training_args.json";

class TrainingArgsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/accel_targs_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    std::string p = dir_ + "/" + name;
    std::ofstream(p) << text;
    return p;
  }
  std::string dir_;
};

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

// The dump transformers writes holds exactly the fields the mapping knows, in Trainer's order
// (regenerating the fixture with a newer transformers shows new fields here).
TEST_F(TrainingArgsTest, TheFixtureHoldsExactlyTheKnownFields) {
  std::ifstream in(kArgs);
  ASSERT_TRUE(in) << kArgs;
  nlohmann::json j = nlohmann::json::parse(in);
  std::vector<std::string> dumped;
  for (auto it = j.begin(); it != j.end(); ++it) dumped.push_back(it.key());
  std::vector<std::string> known = training_args_names();
  std::sort(dumped.begin(), dumped.end());
  std::sort(known.begin(), known.end());
  std::vector<std::string> missing, extra;
  std::set_difference(dumped.begin(), dumped.end(), known.begin(), known.end(),
                      std::back_inserter(missing));
  std::set_difference(known.begin(), known.end(), dumped.begin(), dumped.end(),
                      std::back_inserter(extra));
  // Names the dump no longer holds that hand-written sections still use.
  for (const char* kept : {"logging_dir", "warmup_ratio"})
    extra.erase(std::remove(extra.begin(), extra.end(), kept), extra.end());
  EXPECT_TRUE(missing.empty()) << "fields the mapping does not know: " << missing.size()
                               << (missing.empty() ? "" : " (first: " + missing[0] + ")");
  EXPECT_TRUE(extra.empty()) << "names not in the dump: " << extra.size()
                             << (extra.empty() ? "" : " (first: " + extra[0] + ")");
}

TEST_F(TrainingArgsTest, TheDumpMapsOntoOurKeysAndListsTheMapping) {
  Config c = load_config("", {}, {}, kArgs);
  EXPECT_EQ(spelled(c.training.output_dir), "out/trainer-args");
  EXPECT_EQ(c.training.micro_batch_size, 4);
  EXPECT_EQ(c.training.max_steps, 30);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(spelled(c.optimizer.lr_schedule), "cosine");
  EXPECT_DOUBLE_EQ(c.optimizer.min_lr_ratio, 0.0);  // Trainer decays to 0
  EXPECT_EQ(c.optimizer.warmup_steps, 3);           // ceil(0.1 * 30)
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(spelled(c.optimizer.name), "adamw");
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.training.log_every, 5);
  EXPECT_EQ(c.training.eval_every, 10);
  EXPECT_EQ(c.checkpoint.every_steps, 10);
  EXPECT_EQ(c.checkpoint.keep_last, 2);
  EXPECT_TRUE(c.checkpoint.at_end);
  EXPECT_TRUE(c.checkpoint.save_optimizer);
  EXPECT_EQ(c.training.seed, 1234u);
  EXPECT_TRUE(c.use_cpu);
  EXPECT_EQ(spelled(c.training.device), "cpu");
  EXPECT_DOUBLE_EQ(c.distributed.timeout_s, 1800);
  EXPECT_EQ(spelled(c.mixed_precision), "no");  // bf16/fp16 false leave it to the Accelerate keys
  const std::string n = notices_text(c);
  EXPECT_TRUE(has_notice(c, "training_args learning_rate=0.001 -> optimizer.lr: 0.001")) << n;
  EXPECT_TRUE(has_notice(c,
                         "warmup_steps=0.1 (a fraction of max_steps=30) -> "
                         "optimizer.warmup_steps: 3"))
      << n;
  EXPECT_TRUE(
      has_notice(c, "training_args report_to=[\"tensorboard\"] -> logging.tensorboard: true"))
      << n;
  EXPECT_TRUE(c.logging.tensorboard);
  // Trainer's defaults that only matter to things we lack (hub, dataloader workers, ...) are
  // quiet: this dump has no no-effect notice.
  EXPECT_EQ(std::count_if(
                c.notices.begin(), c.notices.end(),
                [](const std::string& s) { return s.find("has no effect") != std::string::npos; }),
            0)
      << n;
  // The effective config carries the mapped values and loads back the same.
  Config back = load_config(write("eff.yaml", config_to_yaml(c)), {}, {});
  EXPECT_EQ(config_to_yaml(back), config_to_yaml(c));
}

TEST_F(TrainingArgsTest, ASectionInTheYamlOrAPathToTheDump) {
  Config c = load_config(write("a.yaml", R"(training_args:
  learning_rate: 2.0e-4
  max_steps: 20
  lr_scheduler_type: constant_with_warmup
  warmup_steps: 5
  eval_strategy: no
  save_strategy: "no"
  save_total_limit: null
  bf16: true
  gradient_checkpointing: true
  ddp_backend: gloo
training: {seq_len: 32}
)"),
                         {}, {});
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-4);
  EXPECT_EQ(spelled(c.optimizer.lr_schedule), "constant");
  EXPECT_EQ(c.optimizer.warmup_steps, 5);
  EXPECT_EQ(c.training.eval_every, 0);
  EXPECT_EQ(c.checkpoint.every_steps, 0);
  EXPECT_FALSE(c.checkpoint.at_end);
  EXPECT_EQ(c.checkpoint.keep_last, 0);
  EXPECT_EQ(spelled(c.mixed_precision), "bf16");
  EXPECT_EQ(c.training.activation_checkpointing, ActivationCheckpointing::Full);
  EXPECT_EQ(spelled(c.distributed.backend), "cpu");
  EXPECT_EQ(c.training.seq_len, 32);

  // training_args: PATH (relative to the YAML file).
  std::filesystem::copy_file(kArgs, dir_ + "/args.json");
  Config p = load_config(write("b.yaml", "training_args: args.json\n"), {}, {});
  EXPECT_EQ(p.training.max_steps, 30);
  // Later layers still win: --set over the file's training_args.
  Config s = load_config(write("c.yaml", "training_args: args.json\n"), {"optimizer.lr=0.5"}, {});
  EXPECT_DOUBLE_EQ(s.optimizer.lr, 0.5);

  // constant has no warmup in Trainer; the warmup is dropped with a notice.
  Config k = load_config(
      write("k.yaml",
            "training_args: {max_steps: 9, lr_scheduler_type: constant, warmup_steps: 3}\n"),
      {}, {});
  EXPECT_EQ(k.optimizer.warmup_steps, 0);
  EXPECT_TRUE(has_notice(k, "training_args.warmup_steps=3 has no effect")) << notices_text(k);
  // cosine_with_min_lr's floor becomes min_lr_ratio.
  Config m = load_config(write("m.yaml", R"(training_args:
  max_steps: 9
  learning_rate: 0.01
  lr_scheduler_type: cosine_with_min_lr
  lr_scheduler_kwargs: {min_lr: 0.001}
)"),
                         {}, {});
  EXPECT_EQ(spelled(m.optimizer.lr_schedule), "cosine");
  EXPECT_NEAR(m.optimizer.min_lr_ratio, 0.1, 1e-12);
}

// A hand-written section sets what it names; everything else keeps accel-train's values.
TEST_F(TrainingArgsTest, NamesNotGivenLeaveOurKeysAlone) {
  Config c = load_config(write("p.yaml", R"(training: {output_dir: mine, max_steps: 40}
optimizer: {lr_schedule: cosine, min_lr_ratio: 0.1}
training_args: {learning_rate: 0.002, eval_steps: 10}
)"),
                         {}, {});
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.002);
  EXPECT_EQ(spelled(c.training.output_dir), "mine");
  EXPECT_EQ(c.training.max_steps, 40);
  EXPECT_DOUBLE_EQ(c.optimizer.min_lr_ratio, 0.1);
  EXPECT_EQ(c.training.eval_every, 0);  // eval_steps alone: eval_strategy is still "no"
  EXPECT_TRUE(has_notice(c, "key training_args.eval_steps=10 has no effect")) << notices_text(c);
  // A warmup fraction needs the max_steps it is a fraction of.
  expect_error(
      [&] { load_config(write("w.yaml", "training_args: {warmup_steps: 0.1}\n"), {}, {}); },
      {"training_args.warmup_steps: 0.1 is a fraction of max_steps"});
}

// max_steps > 0 overrides num_train_epochs (as in Trainer); max_steps < 0 runs
// num_train_epochs epochs, fractions included (training.num_epochs; the steps come from the data).
TEST_F(TrainingArgsTest, NumTrainEpochsRunsWhenMaxStepsIsNotPositive) {
  // The dump: max_steps 30 and Trainer's default num_train_epochs 3.0, which it does not use.
  Config d = load_config("", {}, {}, kArgs);
  EXPECT_EQ(d.training.max_steps, 30);
  EXPECT_DOUBLE_EQ(d.training.num_epochs, 0);
  EXPECT_TRUE(has_notice(d,
                         "training_args num_train_epochs=3.0 is not used: max_steps=30 > 0 "
                         "overrides it (as in Trainer)"))
      << notices_text(d);

  // The same dump with max_steps -1: three epochs, and no max_steps of ours.
  std::ifstream in(kArgs);
  nlohmann::json j = nlohmann::json::parse(in);
  j["max_steps"] = -1;
  j["warmup_steps"] = 3;  // a fraction needs the step count, known only from the data
  const std::string epochs = write("epochs.json", j.dump());
  Config e = load_config("", {}, {}, epochs);
  EXPECT_DOUBLE_EQ(e.training.num_epochs, 3.0);
  EXPECT_EQ(e.origins.count("training.max_steps"), 0u);
  EXPECT_EQ(e.optimizer.warmup_steps, 3);
  EXPECT_TRUE(
      has_notice(e, "training_args max_steps=-1, num_train_epochs=3.0 -> training.num_epochs: 3.0"))
      << notices_text(e);
  EXPECT_FALSE(has_notice(e, "is not used")) << notices_text(e);
  j["warmup_steps"] = 0.1;
  expect_error([&] { load_config("", {}, {}, write("frac.json", j.dump())); },
               {"training_args.warmup_steps: 0.1 is a fraction of the run's steps",
                "max_steps=-1 runs num_train_epochs=3.0 epochs", "as a number of steps"});

  // A section: max_steps left out is Trainer's -1; a fraction of an epoch is kept exactly.
  Config f = load_config(write("f.yaml", "training_args: {num_train_epochs: 2.5}\n"), {}, {});
  EXPECT_DOUBLE_EQ(f.training.num_epochs, 2.5);
  EXPECT_EQ(f.training.max_steps, 100);  // ours, unused: run.cpp counts the steps from the data
  EXPECT_EQ(f.origins.count("training.max_steps"), 0u);
  // max_steps alone, num_train_epochs not given: no notice about it.
  Config s = load_config(write("s.yaml", "training_args: {max_steps: 7}\n"), {}, {});
  EXPECT_EQ(s.training.max_steps, 7);
  EXPECT_FALSE(has_notice(s, "num_train_epochs")) << notices_text(s);
  Config o = load_config(write("o.yaml", "training_args: {max_steps: 7, num_train_epochs: 1.5}\n"),
                         {}, {});
  EXPECT_EQ(o.training.max_steps, 7);
  EXPECT_DOUBLE_EQ(o.training.num_epochs, 0);
  EXPECT_TRUE(has_notice(o, "num_train_epochs=1.5 is not used: max_steps=7 > 0 overrides it"))
      << notices_text(o);

  // Values that train nothing or are no number, by name.
  expect_error([&] { load_config(write("z.yaml", "training_args: {max_steps: 0}\n"), {}, {}); },
               {"z.yaml:1", "training_args.max_steps: 0 trains nothing", "-1 to run"});
  expect_error(
      [&] {
        load_config(write("n.yaml", "training_args: {max_steps: -1, num_train_epochs: 0}\n"), {},
                    {});
      },
      {"training_args.num_train_epochs: 0 epochs with max_steps=-1 trains nothing"});
  expect_error(
      [&] { load_config(write("t.yaml", "training_args: {num_train_epochs: two}\n"), {}, {}); },
      {"training_args.num_train_epochs: expected a number, got two"});
  expect_error([&] { load_config(write("i.yaml", "training_args: {max_steps: 2.5}\n"), {}, {}); },
               {"training_args.max_steps: expected an integer, got 2.5"});
  // Per-epoch logging, evaluation and saving stay refused, saying what to use.
  expect_error(
      [&] {
        load_config(write("v.yaml", "training_args: {num_train_epochs: 1, eval_strategy: epoch}\n"),
                    {}, {});
      },
      {"training_args.eval_strategy: epoch cannot be honoured", "use steps"});
}

// Our YAML and training_args together: training.max_steps (from either) wins over
// training.num_epochs with a notice; the same key given twice must agree.
TEST_F(TrainingArgsTest, EpochsAndStepsFromTheYamlAndTrainingArgs) {
  Config a = load_config(write("a.yaml", R"(training: {max_steps: 20}
training_args: {num_train_epochs: 2}
)"),
                         {}, {});
  EXPECT_EQ(a.training.max_steps, 20);
  EXPECT_DOUBLE_EQ(a.training.num_epochs, 2);
  EXPECT_TRUE(has_notice(a, "key training.num_epochs=2.0 has no effect: training.max_steps"))
      << notices_text(a);
  // The dump's default epochs against the YAML's: a real disagreement (Trainer would run 3).
  std::ifstream in(kArgs);
  nlohmann::json j = nlohmann::json::parse(in);
  j["max_steps"] = -1;
  j["warmup_steps"] = 0;
  const std::string epochs = write("epochs.json", j.dump());
  expect_error(
      [&] { load_config(write("b.yaml", "training: {num_epochs: 1}\n"), {}, {}, epochs); },
      {"training.num_epochs", "training_args max_steps=-1, num_train_epochs=3.0", "b.yaml:1"});
  Config c = load_config(write("c.yaml", "training: {num_epochs: 3}\n"), {}, {}, epochs);
  EXPECT_DOUBLE_EQ(c.training.num_epochs, 3);
  // The dump's max_steps 30 wins over the YAML's epochs, as ours does.
  Config d = load_config(write("d.yaml", "training: {num_epochs: 1}\n"), {}, {}, kArgs);
  EXPECT_EQ(d.training.max_steps, 30);
  EXPECT_TRUE(has_notice(d, "key training.num_epochs=1.0 has no effect: training.max_steps"))
      << notices_text(d);
}

TEST_F(TrainingArgsTest, ASettingGivenTwiceWithDifferentValuesNamesBoth) {
  std::string y = write("x.yaml", R"(optimizer:
  lr: 0.01
training_args: {learning_rate: 0.001, max_steps: 10}
)");
  expect_error([&] { load_config(y, {}, {}); },
               {"x.yaml:3 (training_args learning_rate=0.001)", "optimizer.lr = 0.01", "x.yaml:2",
                "give it once"});
  // The same through --training-args: the file's key and the dump's field.
  std::string z = write("z.yaml", "training: {max_steps: 7}\n");
  expect_error([&] { load_config(z, {}, {}, kArgs); },
               {"training.max_steps = 30", "training_args max_steps=30", "z.yaml:1",
                "training.max_steps = 7"});
  // Agreeing values are fine.
  Config ok = load_config(write("ok.yaml", "optimizer: {lr: 0.001}\n"), {}, {}, kArgs);
  EXPECT_DOUBLE_EQ(ok.optimizer.lr, 1e-3);
  // An Accelerate key and its TrainingArguments twin.
  expect_error(
      [&] {
        load_config(write("g.yaml",
                          "gradient_accumulation_steps: 4\n"
                          "training_args: {gradient_accumulation_steps: 2, max_steps: 5}\n"),
                    {}, {});
      },
      {"gradient_accumulation_steps = 2", "gradient_accumulation_steps = 4", "g.yaml:1"});
}

TEST_F(TrainingArgsTest, ValuesWeCannotHonourAreRefusedByName) {
  auto refused = [&](const std::string& args, std::vector<std::string> pieces) {
    std::string y = write("r.yaml", "training_args: {max_steps: 10, " + args + "}\n");
    expect_error([&] { load_config(y, {}, {}); }, pieces);
  };
  refused("label_smoothing_factor: 0.1",
          {"r.yaml:1", "training_args.label_smoothing_factor: 0.1 cannot be honoured",
           "cross-entropy"});
  refused("push_to_hub: true", {"training_args.push_to_hub", "Hub"});
  refused("load_best_model_at_end: true", {"training_args.load_best_model_at_end"});
  refused("lr_scheduler_type: polynomial", {"training_args.lr_scheduler_type: polynomial"});
  refused("eval_strategy: epoch", {"training_args.eval_strategy: epoch", "epochs"});
  refused("save_strategy: best", {"training_args.save_strategy: best"});
  refused("fsdp: hybrid_shard", {"training_args.fsdp", "hybrid sharding"});
  refused("optim: adafactor", {"training_args.optim: adafactor", "AdamW and SGD"});
  refused("data_seed: 3", {"training_args.data_seed: 3"});
  refused("neftune_noise_alpha: 5.0", {"training_args.neftune_noise_alpha"});
  refused("accelerator_config: {split_batches: true}", {"split_batches=true"});
  refused("bf16: true, fp16: true", {"bf16 and fp16 are both true"});
  // Trainer's flag is a boolean (true is full recomputation), never one of our modes.
  refused("gradient_checkpointing: selective",
          {"training_args.gradient_checkpointing", "true or false"});
  refused("lr_scheduler_type: cosine, lr_scheduler_kwargs: {num_cycles: 2}",
          {"training_args.lr_scheduler_kwargs", "num_cycles"});
  // Unknown names get the closest field.
  expect_error([&] { load_config(write("u.yaml", "training_args: {learning_rat: 1}\n"), {}, {}); },
               {"u.yaml:1", "unknown TrainingArguments name 'training_args.learning_rat'",
                "did you mean 'learning_rate'?"});
  // Our own parser checks the value a mapped name carries, naming where it came from.
  expect_error(
      [&] {
        load_config(write("t.yaml", "training_args: {max_steps: 5, learning_rate: abc}\n"), {}, {});
      },
      {"t.yaml:1 (training_args learning_rate=abc)", "optimizer.lr: expected a number"});
  // training_args is read from files only.
  expect_error([&] { load_config("", {"training_args.learning_rate=1"}, {}); },
               {"--set", "--training-args FILE.json"});
}

TEST_F(TrainingArgsTest, NoEffectNamesGetTheUsualNotice) {
  Config c = load_config(write("n.yaml", R"(training_args:
  max_steps: 5
  torch_compile: true
  dataloader_num_workers: 4
  per_device_eval_batch_size: 16
  accelerator_config: {even_batches: false}
  hub_model_id: me/model
)"),
                         {}, {});
  const std::string n = notices_text(c);
  EXPECT_TRUE(has_notice(c,
                         "key training_args.torch_compile=true has no effect in accel-train "
                         "(torch.compile is not used"))
      << n;
  EXPECT_TRUE(has_notice(c, "key training_args.dataloader_num_workers=4 has no effect")) << n;
  EXPECT_TRUE(has_notice(c, "key training_args.per_device_eval_batch_size=16 has no effect")) << n;
  EXPECT_TRUE(has_notice(c, "key training_args.accelerator_config.even_batches=false")) << n;
  EXPECT_FALSE(has_notice(c, "hub_model_id")) << n;  // only matters with push_to_hub
}

TEST_F(TrainingArgsTest, FsdpAndDeepSpeedConfigFiles) {
  write("fsdp.json", R"({"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                        "activation_checkpointing": true, "cpu_ram_efficient_loading": "true",
                        "version": 2, "backward_prefetch": "backward_pre"})");
  Config f = load_config(write("f.yaml", R"(training_args:
  max_steps: 5
  fsdp: "full_shard auto_wrap offload"
  fsdp_config: fsdp.json
)"),
                         {}, {});
  EXPECT_EQ(spelled(f.distributed_type), "FSDP");
  EXPECT_TRUE(f.fsdp.fsdp_reshard_after_forward);
  EXPECT_TRUE(f.fsdp.fsdp_offload_params);
  EXPECT_TRUE(f.fsdp.fsdp_activation_checkpointing);
  EXPECT_TRUE(f.fsdp.fsdp_cpu_ram_efficient_loading);
  EXPECT_EQ(spelled(f.fsdp.fsdp_auto_wrap_policy), "TRANSFORMER_BASED_WRAP");
  EXPECT_EQ(spelled(f.fsdp.fsdp_transformer_layer_cls_to_wrap), "LlamaDecoderLayer");
  // shard_grad_op; min_num_params picks size-based wrapping.
  Config s = load_config(write("s.yaml", R"(training_args:
  max_steps: 5
  fsdp: [shard_grad_op, auto_wrap]
  fsdp_config: {min_num_params: 1000}
)"),
                         {}, {});
  EXPECT_FALSE(s.fsdp.fsdp_reshard_after_forward);
  EXPECT_EQ(spelled(s.fsdp.fsdp_auto_wrap_policy), "SIZE_BASED_WRAP");
  EXPECT_EQ(s.fsdp.fsdp_min_num_params, 1000);
  expect_error(
      [&] {
        load_config(write("b.yaml",
                          "training_args: {max_steps: 5, fsdp: full_shard, "
                          "fsdp_config: {shardin_strategy: 1}}\n"),
                    {}, {});
      },
      {"unknown FSDP config key 'shardin_strategy'", "did you mean 'sharding_strategy'?"});

  // deepspeed: PATH is read as deepspeed_config_file; its values must agree with the
  // TrainingArguments ones (as Trainer requires).
  std::filesystem::copy_file(kData + "zero_stage2_config.json", dir_ + "/ds.json");
  const std::string agree = R"(training_args:
  max_steps: 5
  deepspeed: ds.json
  gradient_accumulation_steps: 2
  per_device_train_batch_size: 4
  max_grad_norm: 0.5
  fp16: true
  weight_decay: 0.01
  adam_beta2: 0.999
  adam_epsilon: 1.0e-6
)";
  Config d = load_config(write("d.yaml", agree), {}, {});
  EXPECT_EQ(spelled(d.distributed_type), "DEEPSPEED");
  EXPECT_EQ(d.deepspeed.zero_stage, 2);
  EXPECT_EQ(spelled(d.deepspeed.offload_optimizer_device), "cpu");
  EXPECT_EQ(spelled(d.mixed_precision), "fp16");
  expect_error(
      [&] {
        load_config(write("dd.yaml",
                          "training_args: {max_steps: 5, deepspeed: ds.json, "
                          "gradient_accumulation_steps: 4}\n"),
                    {}, {});
      },
      {"gradient_accumulation_steps = 2", "conflicts with",
       "training_args gradient_accumulation_steps=4", "ds.json"});
}

TEST_F(TrainingArgsTest, SuggestionsKnowTrainerAndAccelerateNames) {
  auto unknown = [&](const std::string& set, std::vector<std::string> pieces) {
    expect_error([&] { load_config("", {set}, {}); }, pieces);
  };
  unknown("training.learning_rate=1", {"unknown key 'training.learning_rate'; did you mean "
                                       "'optimizer.lr'?"});
  unknown("num_train_epochs=3", {"unknown key 'num_train_epochs'", "training.num_epochs"});
  unknown("report_to=wandb", {"unknown key 'report_to'", "metrics.jsonl"});
  unknown("training.per_device_train_batch_size=8", {"did you mean 'training.micro_batch_size'?"});
  unknown("optimizer.adam_beta2=0.9", {"did you mean 'optimizer.beta2'?"});
  unknown("max_grad_norm=1", {"did you mean 'optimizer.grad_clip'?"});
  unknown("training.logging_steps=5", {"did you mean 'training.log_every'?"});
  unknown("fsdp_config.sharding_strategy=1",
          {"did you mean 'fsdp_config.fsdp_sharding_strategy'?"});
  unknown("fsdp_config.cpu_offload=true", {"did you mean 'fsdp_config.fsdp_offload_params'?"});
  unknown("deepspeed_config.stage=3", {"did you mean 'deepspeed_config.zero_stage'?"});
  // Edit distance still handles typos.
  unknown("training.max_stpes=3", {"did you mean 'training.max_steps'?"});
}

TEST_F(TrainingArgsTest, FsdpCpuOffloadIsTheAliasTransformersDocsUse) {
  Config c = load_config(
      write("o.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_cpu_offload: true\n"), {}, {});
  EXPECT_TRUE(c.fsdp.fsdp_offload_params);
  expect_error(
      [&] {
        load_config(write("p.yaml",
                          "distributed_type: FSDP\nfsdp_config:\n  fsdp_cpu_offload: "
                          "true\n  fsdp_offload_params: false\n"),
                    {}, {});
      },
      {"fsdp_config.fsdp_offload_params = false", "fsdp_config.fsdp_cpu_offload = true"});
  // The effective config writes the first spelling.
  EXPECT_NE(config_to_yaml(c).find("fsdp_offload_params: true"), std::string::npos);
}

TEST_F(TrainingArgsTest, DocsHaveTheMappingTable) {
  std::ifstream in(std::string(ACCEL_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in);
  std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(doc.find(training_args_reference_markdown()), std::string::npos)
      << "docs/config.md is out of date: paste training_args_reference_markdown() into it";
}

}  // namespace
}  // namespace accel
