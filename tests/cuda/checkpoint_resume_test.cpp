// Checkpoints on the GPU (issue 24): a background save (checkpoint.async) copies the device state
// to host memory at the step boundary and the run resumed from it continues bit for bit (bf16,
// fp16 with its loss scaler, fp8 delayed scaling); a ZeRO-3 checkpoint resumes as the single
// process (resharded), step 4 within 1e-5; a background save through pinned host memory writes
// the bytes of a synchronous save of the same state, although a kernel overwrites the state right
// after the snapshot, and two saves share one pinned block, the one reserved before the first
// save from the snapshot's layout (as accel-train reserves it at setup for periodic background
// saves: before step 1, said once; a synchronous run pins nothing up front). A few seconds on an
// H200.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "parallel/ddp.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/tools/run_tool.h"
#include "tools/trainer/checkpoint.h"
#include "tools/trainer/checkpoint_buffer.h"

namespace fs = std::filesystem;

namespace {

using accel::tool_test::Result;

// Every dimension a multiple of 16, so that every Linear runs in fp8.
const char* kConfig = R"(
model: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 128, vocab_size: 128, max_position_embeddings: 64}
training: {seed: 5, max_steps: 6, micro_batch_size: 4, seq_len: 32, log_every: 1,
           progress: plain, device: cuda}
optimizer: {lr: 0.01, warmup_steps: 1, lr_schedule: cosine}
data: {source: synthetic}
checkpoint: {every_steps: 3, keep_last: 0, async: true}
)";

class CheckpointResumeCuda : public accel::tool_test::ConfigFolderTest {
 protected:
  CheckpointResumeCuda() : ConfigFolderTest("accel_ckpt_cuda", kConfig) {}
};

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Every state tensor of `strategy` (live, on the GPU) set to distinct values from `base`.
void set_state(accel::Strategy& strategy, double base) {
  int64_t k = 0;
  for (accel::ParamStateSlice& p : strategy.param_state_slices())
    for (auto& [kind, t] : p.tensors) {
      std::vector<double> v(static_cast<size_t>(t.numel()));
      for (double& x : v) x = base + 1e-6 * static_cast<double>(k++ % 100003);
      t.copy_(accel::Tensor::from_vector(v, t.shape(), accel::DType::F32, t.device()));
    }
}

TEST_F(CheckpointResumeCuda, PinnedAsyncSaveWritesTheBytesOfASyncSave) {
  ACCEL_SKIP_WITHOUT_CUDA();
  accel::DecoderConfig config;
  config.hidden_size = 8;
  config.intermediate_size = 16;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 2;
  config.num_key_value_heads = 2;
  config.head_dim = 4;
  config.vocab_size = 16;
  // 64 MB per state tensor: a device-to-host copy of milliseconds, against microseconds for the
  // fill below, which would overtake the copies if the compute stream did not wait for them.
  accel::Linear model(4096, 4096, accel::DType::F32, accel::cuda_test::gpu(), /*bias=*/true);
  accel::SingleProcessStrategy strategy(accel::DType::F32);
  strategy.setup(model, accel::OptimizerOptions{});
  set_state(strategy, 0.25);
  accel::TrainerState st;
  st.step = 1;
  // The reference: a synchronous save through pageable memory.
  const std::string sync = accel::save_checkpoint((dir_ / "sync").string(), st, strategy, config,
                                                  "", accel::CheckpointWriter{}, 0);
  accel::CheckpointSaver::Options o;
  o.async = true;
  accel::CheckpointSaver saver(std::move(o));  // the run's buffer: pinned
  // As RunCheckpoints does at setup: the block from metadata, before any save.
  const accel::SnapshotLayout layout = accel::snapshot_layout(strategy, 0, true);
  ASSERT_TRUE(layout.on_gpu);
  saver.buffer()->reserve(layout.tensors, layout.on_gpu);
  ASSERT_EQ(saver.buffer()->allocations(), 1);
  ASSERT_TRUE(saver.buffer()->pinned());
  EXPECT_EQ(saver.buffer()->capacity(), layout.bytes());
  EXPECT_GT(layout.bytes(), size_t{3} * (64 << 20));  // weight, exp_avg, exp_avg_sq
  auto save_async = [&](int64_t step, double overwrite_with) {
    fs::create_directories(accel::checkpoint_tmp_dir((dir_ / "async").string(), step));
    accel::CheckpointSnapshot s = accel::take_snapshot(strategy, 0, 1, true, saver.buffer());
    EXPECT_TRUE(s.pinned);
    EXPECT_NE(s.copies, nullptr);  // still copying: the host did not wait
    // Queued on the compute stream after the snapshot: must not reach it.
    for (accel::ParamStateSlice& p : strategy.param_state_slices())
      for (auto& [kind, t] : p.tensors) t.fill_(overwrite_with);
    s.state.step = step;
    s.model_config = config;
    saver.save((dir_ / "async").string(), std::move(s));
    const std::optional<std::string> dir = saver.wait();
    EXPECT_TRUE(dir.has_value());
    EXPECT_GT(saver.last_copy_seconds(), 0.0);
    return dir.value_or("");
  };
  const std::string first = save_async(1, -7.0);
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(saver.buffer()->allocations(), 1) << "the first save allocated a block of its own";
  EXPECT_EQ(saver.buffer()->capacity(), layout.bytes());
  for (const char* f : {"model.safetensors", "optimizer.rank0.safetensors"}) {
    const std::string want = file_bytes(fs::path(sync) / f);
    ASSERT_GT(want.size(), size_t{64} << 20) << f;
    EXPECT_TRUE(file_bytes(fs::path(first) / f) == want)
        << f << ": the pinned background save differs from the synchronous one";
  }
  nlohmann::json a, b;
  std::ifstream(fs::path(sync) / "trainer_state.json") >> a;
  std::ifstream(fs::path(first) / "trainer_state.json") >> b;
  EXPECT_EQ(a["state"], b["state"]);  // every slice's checksum
  EXPECT_EQ(a["files"]["model.safetensors"], b["files"]["model.safetensors"]);
  EXPECT_EQ(a["files"]["optimizer.rank0.safetensors"], b["files"]["optimizer.rank0.safetensors"]);
  // A second save (of the overwritten state, -7 everywhere) reuses the pinned block.
  const std::string second = save_async(2, 3.0);
  ASSERT_FALSE(second.empty());
  EXPECT_EQ(saver.buffer()->allocations(), 1);
  EXPECT_TRUE(saver.buffer()->pinned());
  EXPECT_EQ(accel::verify_checkpoint(second), std::vector<std::string>{});
  const accel::LoadedCheckpoint ck = accel::load_checkpoint(second);
  accel::CheckpointStateReader reader(ck);
  accel::Tensor got = accel::Tensor::empty({4096}, accel::DType::F32);
  reader.read("bias", "exp_avg", 0, got);
  EXPECT_EQ(got.to_vector(), std::vector<double>(4096, -7.0));
}

TEST_F(CheckpointResumeCuda, AsyncSaveResumesBitForBit) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const std::map<std::string, std::string> modes = {
      {"bf16", "--set mixed_precision=bf16"},
      {"fp16", "--set mixed_precision=fp16"},
      {"fp8", "--set mixed_precision=fp8 --set fp8_config.backend=TE"}};
  for (const auto& [name, precision] : modes) {
    Result full = train(name, precision);
    ASSERT_EQ(full.code, 0) << full.output;
    EXPECT_NE(full.output.find("(in the background during"), std::string::npos) << full.output;
    // Periodic background saves: the pinned block is reserved once, before the first step, and
    // no save outgrows it (that would warn).
    const size_t reserved = full.output.find("checkpoint: reserved ");
    const size_t first_step = full.output.find("step 1/");
    ASSERT_NE(reserved, std::string::npos) << full.output;
    ASSERT_NE(first_step, std::string::npos) << full.output;
    EXPECT_LT(reserved, first_step) << full.output;
    EXPECT_NE(full.output.find(" bytes) of pinned host memory for background saves in ", reserved),
              std::string::npos)
        << full.output;
    EXPECT_EQ(full.output.find("checkpoint: reserved ", reserved + 1), std::string::npos)
        << full.output;
    // No save outgrew the block (that warns) or was refused pinned memory.
    EXPECT_EQ(full.output.find("reserved at setup does not hold"), std::string::npos)
        << full.output;
    EXPECT_EQ(full.output.find("pinned (page-locked) host memory"), std::string::npos)
        << full.output;
    EXPECT_NE(full.output.find("pinned snapshot"), std::string::npos) << full.output;
    EXPECT_EQ(accel::verify_checkpoint(step(name, 3).string()), std::vector<std::string>{}) << name;
    Result resumed = train(name + "_resumed", precision + " --resume " + step(name, 3).string());
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const std::map<int, double> a = losses(name), b = losses(name + "_resumed");
    for (int s = 4; s <= 6; ++s) EXPECT_EQ(b.at(s), a.at(s)) << name << " step " << s;
  }
}

// A synchronous run pins nothing up front (its first save allocates the pinned block, as
// before); its checkpoint holds the bytes of the background run's.
TEST_F(CheckpointResumeCuda, SyncRunReservesNothingAndSavesTheBytesOfAnAsyncRun) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const std::string bf16 = "--set mixed_precision=bf16";
  Result sync = train("sync", bf16 + " --set checkpoint.async=false");
  ASSERT_EQ(sync.code, 0) << sync.output;
  EXPECT_EQ(sync.output.find("checkpoint: reserved"), std::string::npos) << sync.output;
  EXPECT_NE(sync.output.find("pinned snapshot"), std::string::npos) << sync.output;
  Result async = train("async", bf16);
  ASSERT_EQ(async.code, 0) << async.output;
  EXPECT_NE(async.output.find("checkpoint: reserved"), std::string::npos) << async.output;
  for (const char* f : {"model.safetensors", "optimizer.rank0.safetensors"}) {
    const std::string want = file_bytes(step("sync", 3) / f);
    ASSERT_FALSE(want.empty()) << f;
    EXPECT_TRUE(file_bytes(step("async", 3) / f) == want) << f;
  }
}

TEST_F(CheckpointResumeCuda, Zero3CheckpointResumesAsTheSingleProcess) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const std::string bf16 = "--set mixed_precision=bf16";
  Result z3 = train("z3", bf16 +
                              " --set distributed_type=DEEPSPEED --set "
                              "deepspeed_config.zero_stage=3");
  ASSERT_EQ(z3.code, 0) << z3.output;
  Result single = train("single", bf16 + " --resume " + step("z3", 3).string());
  ASSERT_EQ(single.code, 0) << single.output;
  EXPECT_NE(single.output.find("saved by zero3 x 1, resharded for single x 1"), std::string::npos)
      << single.output;
  EXPECT_NEAR(losses("single").at(4), losses("z3").at(4), 1e-5);
}

}  // namespace
