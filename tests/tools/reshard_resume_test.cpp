// Resume anywhere (issue 24): a checkpoint written at world size 3 under ZeRO-2 resumes at world
// size 2 under FSDP, 4 under ZeRO-3, 1 single and 5 under DDP with the losses of the uninterrupted
// run (same global batch, within 1e-5), in fp32 and with fp8 delayed-scaling state; offline
// reshard; a corrupted slice caught by verify and by the resume; the global-batch check; the
// background writer (training goes on while it writes; its failure fails the run naming the
// path); SIGTERM writes a checkpoint and exits with kExitPreempted.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>

#include "tests/tools/run_tool.h"
#include "tools/trainer/checkpoint.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

// 60 samples per step: micro_batch_size x gradient_accumulation_steps x num_processes is 4 x 5 x 3
// here, and the resumes below pick their own factors of 60.
const char* kConfig = R"(
model: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 64, vocab_size: 64, max_position_embeddings: 64}
training: {seed: 11, max_steps: 6, micro_batch_size: 4, seq_len: 8, log_every: 1,
           progress: none, device: cpu}
gradient_accumulation_steps: 5
optimizer: {lr: 0.01, warmup_steps: 1, lr_schedule: cosine}
data: {source: synthetic}
checkpoint: {every_steps: 3, keep_last: 0}
)";

const std::string kZero2x3 =
    "--set distributed_type=DEEPSPEED --set deepspeed_config.zero_stage=2 --set num_processes=3";

// Where each resume goes, with a micro-batch split that keeps the global batch at 60.
struct Target {
  std::string name, args;
};
const std::vector<Target> kTargets = {
    {"fsdp_x2",
     "--set distributed_type=FSDP --set num_processes=2 --set "
     "training.micro_batch_size=6"},
    {"zero3_x4",
     "--set distributed_type=DEEPSPEED --set deepspeed_config.zero_stage=3 --set "
     "num_processes=4 --set training.micro_batch_size=3"},
    {"single", "--set training.micro_batch_size=12"},
    {"ddp_x5",
     "--set distributed_type=MULTI_CPU --set num_processes=5 --set "
     "gradient_accumulation_steps=3"},
};

class ReshardResume : public accel::tool_test::ConfigFolderTest {
 protected:
  ReshardResume() : ConfigFolderTest("accel_reshard", kConfig) {}
  Result tool(const std::string& args) {
    return accel::tool_test::run_command(std::string(ACCEL_BIN_DIR) + "/accel-checkpoint " + args);
  }
  // The uninterrupted ZeRO-2 x 3 run `out` (6 steps, a checkpoint at step 3).
  void reference(const std::string& out, const std::string& extra = "") {
    Result r = train(out, kZero2x3 + " " + extra);
    ASSERT_EQ(r.code, 0) << r.output;
    ASSERT_EQ(losses(out).size(), 6u) << r.output;
  }
  // Resumes `from`'s step 3 into each target; step 4 matches the reference within `tol`, steps
  // 5-6 within `later_tol`.
  void expect_every_target_continues(const std::string& from, const std::string& extra, double tol,
                                     double later_tol) {
    const std::map<int, double> ref = losses(from);
    for (const Target& t : kTargets) {
      const std::string out = from + "_" + t.name;
      Result r = train(out, t.args + " " + extra + " --resume " + step(from, 3).string());
      ASSERT_EQ(r.code, 0) << t.name << "\n" << r.output;
      EXPECT_NE(r.output.find("resharded for"), std::string::npos) << r.output;
      const std::map<int, double> got = losses(out);
      for (int s = 4; s <= 6; ++s) {
        ASSERT_TRUE(got.count(s)) << t.name << ": no step " << s << "\n" << r.output;
        EXPECT_NEAR(got.at(s), ref.at(s), s == 4 ? tol : later_tol) << t.name << " step " << s;
      }
    }
  }
  void sigterm_then_resume(const std::string& extra);
};

TEST_F(ReshardResume, Zero2AtThreeResumesAtEveryWorldSizeAndStrategy) {
  reference("ref");
  expect_every_target_continues("ref", "", 1e-5, 1e-5);
  // The checkpoint describes itself and every file matches its checksum.
  Result insp = tool("inspect " + step("ref", 3).string());
  ASSERT_EQ(insp.code, 0) << insp.output;
  for (const char* want : {"step 3 (optimizer steps 3), saved by zero2 x 3 processes",
                           "state: master F32, exp_avg F32, exp_avg_sq F32",
                           "model.layers.0.mlp.up_proj.weight [64, 32]:", "optimizer.rank2"})
    EXPECT_NE(insp.output.find(want), std::string::npos) << want << "\n" << insp.output;
  Result ver = tool("verify " + step("ref", 3).string());
  EXPECT_EQ(ver.code, 0) << ver.output;
  EXPECT_NE(ver.output.find("ok, 7 files match"), std::string::npos) << ver.output;
}

// Delayed scaling's amax histories and scales travel with the state. fp8 trains with bf16
// compute: step 4 (the weights and fp8 scales as saved) matches within 1e-5 everywhere; after
// it, another micro-batch split rounds its bf16 gradients differently (up to ~2e-3 in the loss
// here), while the same layout resumes bit for bit.
TEST_F(ReshardResume, Fp8DelayedScalingStateResumesAtEveryWorldSizeAndStrategy) {
  const std::string fp8 =
      "--set mixed_precision=fp8 --set fp8_config.backend=TE --set fp8_config.amax_history_len=4";
  reference("fp8", fp8);
  EXPECT_TRUE(fs::exists(step("fp8", 3) / "fp8_state.safetensors"));
  expect_every_target_continues("fp8", fp8, 1e-5, 5e-3);
  Result same = train("fp8_same", kZero2x3 + " " + fp8 + " --resume " + step("fp8", 3).string());
  ASSERT_EQ(same.code, 0) << same.output;
  const std::map<int, double> ref = losses("fp8"), got = losses("fp8_same");
  for (int s = 4; s <= 6; ++s) EXPECT_EQ(got.at(s), ref.at(s)) << "step " << s;
}

// fp16's dynamic loss scaler resumes whole: with a growth window of 2 the scale grows at the
// same steps as in the uninterrupted run only if the clean steps counted so far came back too.
TEST_F(ReshardResume, Fp16LossScalerResumesWithItsCleanStepCount) {
  const std::string fp16 =
      "--set mixed_precision=fp16 --set training.loss_scale_window=2 --set "
      "training.micro_batch_size=12 --set checkpoint.async=true";
  Result full = train("fp16", fp16);
  ASSERT_EQ(full.code, 0) << full.output;
  Result resumed = train("fp16_resumed", fp16 + " --resume " + step("fp16", 3).string());
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  auto scales = [this](const std::string& out) {
    std::map<int, double> m;
    for (const auto& j : accel::tool_test::read_metrics(dir_ / out / "metrics.jsonl"))
      if (j.contains("loss_scale")) m[j["step"].get<int>()] = j["loss_scale"];
    return m;
  };
  const std::map<int, double> a = scales("fp16"), b = scales("fp16_resumed");
  ASSERT_EQ(a.size(), 6u) << full.output;
  EXPECT_NE(a.at(3), a.at(6));  // it grew after the checkpoint
  for (int s = 4; s <= 6; ++s) {
    EXPECT_EQ(b.at(s), a.at(s)) << "loss scale at step " << s;
    EXPECT_EQ(losses("fp16_resumed").at(s), losses("fp16").at(s)) << "step " << s;
  }
}

TEST_F(ReshardResume, CorruptedSliceIsCaughtByVerifyAndByResumeNamingTheFile) {
  reference("ref");
  const fs::path ck = dir_ / "damaged";
  fs::copy(step("ref", 3), ck, fs::copy_options::recursive);
  const fs::path victim = ck / "optimizer.rank1.safetensors";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(victim) - 100));
    f.put('\x7f');
  }
  Result ver = tool("verify " + ck.string());
  EXPECT_EQ(ver.code, 1) << ver.output;
  EXPECT_NE(ver.output.find(victim.string() + ": checksum"), std::string::npos) << ver.output;
  EXPECT_NE(ver.output.find("is damaged (1 problem)"), std::string::npos) << ver.output;
  Result r = train("from_damaged", kTargets[0].args + " --resume " + ck.string());
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find(victim.string() + ": tensor '"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("does not match the checksum recorded at save"), std::string::npos)
      << r.output;
}

// Each rank opens only the files holding its ranges.
TEST_F(ReshardResume, ReaderOpensOnlyTheFilesItNeeds) {
  reference("ref");
  accel::LoadedCheckpoint ck = accel::load_checkpoint(step("ref", 3).string());
  const accel::CheckpointParam& p = ck.params.at("model.layers.0.mlp.up_proj.weight");
  const accel::CheckpointSlice* first = nullptr;
  for (const accel::CheckpointSlice& s : p.slices)
    if (s.keys.count("exp_avg") && !first) first = &s;
  ASSERT_NE(first, nullptr);
  accel::CheckpointStateReader reader(ck);
  accel::Tensor t = accel::Tensor::empty({first->end - first->begin}, accel::DType::F32);
  reader.read("model.layers.0.mlp.up_proj.weight", "exp_avg", first->begin, t);
  EXPECT_EQ(reader.files_opened(), std::vector<std::string>{first->file});
  // A range no slice holds is refused, naming it.
  accel::Tensor past = accel::Tensor::empty({4}, accel::DType::F32);
  EXPECT_THROW(reader.read("model.layers.0.mlp.up_proj.weight", "exp_avg", 2046, past),
               std::runtime_error);
}

TEST_F(ReshardResume, OfflineReshardThenResume) {
  reference("ref");
  const fs::path out = dir_ / "fsdp4";
  Result rs = tool("reshard " + step("ref", 3).string() + " " + out.string() +
                   " --world-size 4 --strategy fsdp");
  ASSERT_EQ(rs.code, 0) << rs.output;
  Result insp = tool("inspect " + out.string());
  EXPECT_NE(insp.output.find("saved by fsdp x 4 processes"), std::string::npos) << insp.output;
  // Dim-0 rows: rank 3 holds rows 48-63 of lm_head.weight [64, 32], elements 1536-2047.
  EXPECT_NE(insp.output.find("lm_head.weight [64, 32]:"), std::string::npos) << insp.output;
  EXPECT_NE(insp.output.find("optimizer.rank3.safetensors[1536:2048)"), std::string::npos)
      << insp.output;
  EXPECT_EQ(tool("verify " + out.string()).code, 0);
  Result r = train("after_reshard",
                   "--set distributed_type=FSDP --set num_processes=4 --set "
                   "training.micro_batch_size=3 --resume " +
                       out.string());
  ASSERT_EQ(r.code, 0) << r.output;
  const std::map<int, double> ref = losses("ref"), got = losses("after_reshard");
  for (int s = 4; s <= 6; ++s) EXPECT_NEAR(got.at(s), ref.at(s), 1e-5) << "step " << s;
  // consolidate still writes a Hugging Face folder from it.
  Result cons = tool("consolidate " + out.string() + " " + (dir_ / "hf").string());
  EXPECT_EQ(cons.code, 0) << cons.output;
  EXPECT_TRUE(fs::exists(dir_ / "hf" / "model.safetensors"));
}

TEST_F(ReshardResume, AnotherGlobalBatchIsRefusedUnlessAllowed) {
  reference("ref");
  const std::string from = " --resume " + step("ref", 3).string();
  Result r = train("half", "--set distributed_type=MULTI_CPU --set num_processes=2" + from);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("global batch of 60 samples of 8 tokens (micro_batch_size 4 x "
                          "gradient_accumulation_steps 5 x 3 processes), this run's is 40 samples"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--resume-allow-batch-change"), std::string::npos) << r.output;
  Result ok = train("half_ok",
                    "--set distributed_type=MULTI_CPU --set num_processes=2 "
                    "--resume-allow-batch-change" +
                        from);
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(ok.output.find("global batch changed from 60 samples"), std::string::npos) << ok.output;
}

// checkpoint.async with a slow writer: steps go on while step 2's checkpoint is written, and the
// result is complete and resumes exactly.
TEST_F(ReshardResume, AsyncSaveLetsTrainingContinueWhileWriting) {
  const std::string async =
      "--set checkpoint.async=true --set checkpoint.every_steps=2 --set training.progress=plain";
  Result r = train("async", async, "ACCEL_TEST_CHECKPOINT_WRITE_DELAY_MS=1500");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("step_2: [^\n]*\\(in the background during steps 3-[456]\\)")))
      << r.output;
  EXPECT_EQ(accel::verify_checkpoint(step("async", 2).string()), std::vector<std::string>{});
  Result sync = train("sync", "--set checkpoint.every_steps=2");
  ASSERT_EQ(sync.code, 0) << sync.output;
  EXPECT_EQ(losses("async"), losses("sync"));  // the background copy changes nothing
  Result resumed = train("async_resumed", async + " --resume " + step("async", 2).string());
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const std::map<int, double> ref = losses("sync"), got = losses("async_resumed");
  for (int s = 3; s <= 6; ++s) EXPECT_EQ(got.at(s), ref.at(s)) << "step " << s;
}

// A writer that fails stops the run at the next step, naming the folder and the reason; the
// newest complete checkpoint (step 2) stays, even with keep_last 1.
TEST_F(ReshardResume, AsyncWriterFailureFailsTheRunNamingThePath) {
  Result r = train("fail",
                   "--set checkpoint.async=true --set checkpoint.every_steps=2 --set "
                   "checkpoint.keep_last=1",
                   "ACCEL_TEST_CHECKPOINT_WRITE_FAIL_STEP=4");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("checkpoint " + step("fail", 4).string() + " could not be written: "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("step_4.tmp"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("No such file or directory"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(step("fail", 2) / "trainer_state.json"));
  EXPECT_EQ(accel::verify_checkpoint(step("fail", 2).string()), std::vector<std::string>{});
  EXPECT_FALSE(fs::exists(step("fail", 4)));
}

// SIGTERM: the step finishes, its checkpoint is written, the exit code says so, and --resume
// auto continues the same trajectory. `extra`: the run's processes.
void ReshardResume::sigterm_then_resume(const std::string& extra) {
  const std::string longer = extra +
                             " --set training.max_steps=300 --set checkpoint.every_steps=0 --set "
                             "training.micro_batch_size=1 --set gradient_accumulation_steps=1";
  Result full = train("full", longer);
  ASSERT_EQ(full.code, 0) << full.output;
  const fs::path out = dir_ / "term";
  const std::string cmd = std::string(ACCEL_BIN_DIR) + "/accel-train --config " +
                          (dir_ / "config.yaml").string() + " --output-dir " + out.string() + " " +
                          longer + " >" + (dir_ / "term.log").string() + " 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait for a few logged steps, then SIGTERM.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline &&
         !(fs::exists(out / "metrics.jsonl") &&
           accel::tool_test::read_losses(out / "metrics.jsonl").size() >= 5))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(dir_ / "term.log");
  const std::string log((std::istreambuf_iterator<char>(in)), {});
  ASSERT_TRUE(WIFEXITED(status)) << log;
  ASSERT_EQ(WEXITSTATUS(status), 3) << log;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      log, m, std::regex("stopped by SIGTERM after step ([0-9]+) with its checkpoint written")))
      << log;
  ASSERT_LT(std::stoi(m[1]), 300) << "the run finished before the signal; nothing tested";
  EXPECT_EQ(accel::verify_checkpoint((out / "checkpoints" / ("step_" + m[1].str())).string()),
            std::vector<std::string>{});
  Result resumed = train("term", longer + " --resume auto");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const std::map<int, double> ref = losses("full"), got = losses("term");
  for (int s = 1; s <= 300; ++s) EXPECT_EQ(got.at(s), ref.at(s)) << "step " << s;
}

TEST_F(ReshardResume, SigtermWritesACheckpointAndExitsWithPreemptedCode) {
  sigterm_then_resume("");
}

// Under the local launcher, which forwards the signal: every rank stops after the same step and
// the launcher exits 3 as well.
TEST_F(ReshardResume, SigtermUnderTheLauncherStopsEveryRankAfterTheSameStep) {
  sigterm_then_resume("--set distributed_type=MULTI_CPU --set num_processes=2");
}

}  // namespace
