// The host buffer of checkpoint snapshots (tools/trainer/checkpoint_buffer.h) on the CPU, with a
// counting allocator in place of cudaMallocHost: one block reused from save to save and grown
// only when the state grows, never carved while a save still uses it, a refused pinned
// allocation warned about once; a block reserved ahead (at setup) serving the first carve, a
// refused pinned reservation an error, an outgrown one a warning; and the save path's output:
// checksums computed from memory equal those of the files read back, and a save into a reused
// buffer writes the same bytes.
#include "tools/trainer/checkpoint_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "parallel/ddp.h"
#include "tests/tools/run_tool.h"
#include "tools/trainer/checkpoint.h"

namespace fs = std::filesystem;

namespace {

using accel::DType;
using accel::HostTensorSpec;
using accel::SnapshotBuffer;
using accel::Tensor;

// Pageable memory that says it is pinned (or refuses, as cudaMallocHost does when the host
// lacks memory), counting what it hands out.
class FakeMemory : public accel::HostMemory {
 public:
  FakeMemory(bool pinned, bool refuse, int* count) : pinned_(pinned), refuse_(refuse), n_(count) {}
  std::shared_ptr<accel::Storage> allocate(size_t nbytes) override {
    if (refuse_) throw std::runtime_error("cudaErrorMemoryAllocation (out of memory)");
    ++*n_;
    return accel::allocate_storage(nbytes, accel::Device::cpu(), accel::MemCategory::Other);
  }
  bool pinned() const override { return pinned_; }

 private:
  bool pinned_, refuse_;
  int* n_;
};

struct Buffer {
  int pinned_allocs = 0, pageable_allocs = 0;
  std::vector<std::string> warnings;
  std::unique_ptr<SnapshotBuffer> b;
  explicit Buffer(bool refuse_pinned = false) {
    b = std::make_unique<SnapshotBuffer>(
        std::make_unique<FakeMemory>(true, refuse_pinned, &pinned_allocs),
        std::make_unique<FakeMemory>(false, false, &pageable_allocs),
        [this](const std::string& w) { warnings.push_back(w); });
  }
};

const std::vector<HostTensorSpec> kState = {
    {{3, 5}, DType::F32}, {{7}, DType::BF16}, {{0}, DType::F32}, {{2, 2, 2}, DType::F32}};

size_t bytes_of(const std::vector<HostTensorSpec>& specs) {
  size_t n = 0;
  for (const HostTensorSpec& s : specs)
    n += (accel::shape_numel(s.shape) * accel::dtype_size(s.dtype) + 255) / 256 * 256;
  return n;
}

TEST(SnapshotBuffer, TwoSavesOfTheSameStateShareOneBlock) {
  Buffer f;
  const void* first = nullptr;
  for (int save = 0; save < 2; ++save) {
    std::vector<Tensor> t = f.b->carve(kState, /*want_pinned=*/true);
    ASSERT_EQ(t.size(), kState.size());
    for (size_t i = 0; i < t.size(); ++i) {
      EXPECT_EQ(t[i].shape(), kState[i].shape);
      EXPECT_EQ(t[i].dtype(), kState[i].dtype);
      EXPECT_TRUE(t[i].device().is_cpu());
      EXPECT_TRUE(t[i].is_contiguous());
    }
    if (save == 0) first = t[0].data_ptr();
    EXPECT_EQ(t[0].data_ptr(), first) << "save " << save << " moved the block";
  }
  EXPECT_EQ(f.pinned_allocs, 1);
  EXPECT_EQ(f.pageable_allocs, 0);
  EXPECT_EQ(f.b->allocations(), 1);
  EXPECT_TRUE(f.b->pinned());
  EXPECT_EQ(f.b->capacity(), bytes_of(kState));
}

TEST(SnapshotBuffer, TensorsAreAlignedAndDisjoint) {
  Buffer f;
  std::vector<Tensor> t = f.b->carve(kState, true);
  const char* base = static_cast<const char*>(t[0].data_ptr());  // at the block's start
  const char* end = nullptr;
  for (const Tensor& x : t) {
    if (x.numel() == 0) continue;
    const char* p = static_cast<const char*>(x.data_ptr());
    EXPECT_EQ((p - base) % 256, 0);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);  // the CPU allocator's alignment
    if (end) {
      EXPECT_GE(p, end);
    }
    end = p + x.nbytes();
  }
  // Writing one tensor leaves the others alone.
  t[0].fill_(1.0);
  t[3].fill_(2.0);
  EXPECT_EQ(t[0].to_vector(), std::vector<double>(15, 1.0));
  EXPECT_EQ(t[3].to_vector(), std::vector<double>(8, 2.0));
}

TEST(SnapshotBuffer, GrowsOnlyWhenTheStateGrows) {
  Buffer f;
  f.b->carve(kState, true);
  f.b->carve({{{3, 5}, DType::F32}}, true);  // smaller: the same block
  EXPECT_EQ(f.b->allocations(), 1);
  EXPECT_EQ(f.b->capacity(), bytes_of(kState));
  const std::vector<HostTensorSpec> bigger = {{{1000}, DType::F32}, {{7}, DType::BF16}};
  f.b->carve(bigger, true);
  EXPECT_EQ(f.b->allocations(), 2);
  EXPECT_EQ(f.b->capacity(), bytes_of(bigger));  // exactly what is needed, no slack
  f.b->carve(kState, true);                      // back to the smaller state: kept
  EXPECT_EQ(f.b->allocations(), 2);
  EXPECT_EQ(f.pinned_allocs, 2);
}

TEST(SnapshotBuffer, RefusesToCarveWhileASaveStillHoldsItsTensors) {
  Buffer f;
  std::vector<Tensor> in_flight = f.b->carve(kState, true);
  EXPECT_THROW(f.b->carve(kState, true), std::logic_error);
  in_flight.clear();  // written: the block is free again
  EXPECT_NO_THROW(f.b->carve(kState, true));
  EXPECT_EQ(f.b->allocations(), 1);
}

TEST(SnapshotBuffer, RefusedPinnedMemoryWarnsOnceAndUsesPageable) {
  Buffer f(/*refuse_pinned=*/true);
  for (int save = 0; save < 3; ++save) f.b->carve(kState, true);
  ASSERT_EQ(f.warnings.size(), 1u);
  EXPECT_NE(f.warnings[0].find("pinned (page-locked) host memory"), std::string::npos);
  EXPECT_NE(f.warnings[0].find("cudaErrorMemoryAllocation"), std::string::npos);
  EXPECT_NE(f.warnings[0].find("pageable"), std::string::npos);
  EXPECT_FALSE(f.b->pinned());
  EXPECT_TRUE(f.b->pinned_refused());
  EXPECT_EQ(f.pageable_allocs, 1);  // and no new block per save
}

TEST(SnapshotBuffer, PageableWithoutAGpuSourceOrPinnedMemory) {
  Buffer f;
  f.b->carve(kState, /*want_pinned=*/false);  // CPU state: no page-locked memory asked for
  EXPECT_EQ(f.pinned_allocs, 0);
  EXPECT_FALSE(f.b->pinned());
  f.b->carve(kState, true);  // GPU state later: a pinned block replaces the pageable one
  EXPECT_EQ(f.pinned_allocs, 1);
  EXPECT_TRUE(f.b->pinned());
  f.b->carve(kState, false);  // a pinned block serves CPU state as well
  EXPECT_EQ(f.b->allocations(), 2);
  int unused = 0;
  SnapshotBuffer none(nullptr, std::make_unique<FakeMemory>(false, false, &unused));
  none.carve(kState, true);  // no pinned memory in this build: pageable, and no warning needed
  EXPECT_FALSE(none.pinned());
  EXPECT_FALSE(none.pinned_refused());
}

// The block reserved at setup (checkpointing.h) is the one the first carve of those tensors
// uses: one allocation, no warning.
TEST(SnapshotBuffer, ReservedBlockServesTheFirstCarveWithoutAnAllocation) {
  Buffer f;
  EXPECT_EQ(SnapshotBuffer::bytes_for(kState), bytes_of(kState));
  f.b->reserve(kState, /*want_pinned=*/true);
  EXPECT_EQ(f.pinned_allocs, 1);
  EXPECT_EQ(f.b->allocations(), 1);
  EXPECT_EQ(f.b->capacity(), bytes_of(kState));
  EXPECT_EQ(f.b->reserved_bytes(), bytes_of(kState));
  EXPECT_TRUE(f.b->pinned());
  for (int save = 0; save < 2; ++save) f.b->carve(kState, true);
  EXPECT_EQ(f.b->allocations(), 1);
  EXPECT_EQ(f.pageable_allocs, 0);
  EXPECT_TRUE(f.warnings.empty());
  Buffer none;
  none.b->reserve({{{0}, DType::F32}}, true);  // nothing to hold: no block
  EXPECT_EQ(none.b->allocations(), 0);
}

// CPU state: a pageable block, written once so that its pages exist before the first save.
TEST(SnapshotBuffer, PageableReservationIsTouchedAndServesTheCarve) {
  Buffer f;
  f.b->reserve(kState, /*want_pinned=*/false);
  EXPECT_EQ(f.pinned_allocs, 0);
  EXPECT_EQ(f.pageable_allocs, 1);
  EXPECT_FALSE(f.b->pinned());
  std::vector<Tensor> t = f.b->carve(kState, false);
  EXPECT_EQ(t[0].to_vector(), std::vector<double>(15, 0.0));  // zeros: the reservation wrote it
  EXPECT_EQ(f.b->allocations(), 1);
  EXPECT_TRUE(f.warnings.empty());
}

// At setup a refused pinned block is an error naming the size and the driver's reason, not a
// pageable block: the run stops before its first step instead of saving slower.
TEST(SnapshotBuffer, RefusedPinnedReservationThrowsAndAllocatesNothing) {
  Buffer f(/*refuse_pinned=*/true);
  try {
    f.b->reserve(kState, true);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("pinned (page-locked) host memory"), std::string::npos) << m;
    EXPECT_NE(m.find("cudaErrorMemoryAllocation"), std::string::npos) << m;
    EXPECT_NE(m.find("0.00 GiB"), std::string::npos) << m;  // the size
  }
  EXPECT_EQ(f.b->allocations(), 0);
  EXPECT_EQ(f.pageable_allocs, 0);
  EXPECT_TRUE(f.warnings.empty());
  EXPECT_FALSE(f.b->pinned_refused());  // nothing decided for later saves
}

// A snapshot larger than the reserved block (a state that grew, or a reservation sized wrong)
// is not silent: one warning, then one new block.
TEST(SnapshotBuffer, OutgrownReservationWarnsOnceAndAllocates) {
  Buffer f;
  f.b->reserve(kState, true);
  const std::vector<HostTensorSpec> bigger = {{{1000}, DType::F32}};
  f.b->carve(bigger, true);
  f.b->carve(bigger, true);
  ASSERT_EQ(f.warnings.size(), 1u);
  EXPECT_NE(f.warnings[0].find("reserved at setup"), std::string::npos) << f.warnings[0];
  EXPECT_EQ(f.b->allocations(), 2);
  EXPECT_EQ(f.b->capacity(), bytes_of(bigger));
  EXPECT_EQ(f.b->reserved_bytes(), 0u);
}

// ---- the save path ---------------------------------------------------------------------------

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

class CheckpointSaveBytes : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = accel::tool_test::fresh_test_dir("accel_ckpt_buffer");
    config_.hidden_size = 8;
    config_.intermediate_size = 16;
    config_.num_hidden_layers = 1;
    config_.num_attention_heads = 2;
    config_.num_key_value_heads = 2;
    config_.head_dim = 4;
    config_.vocab_size = 16;
    strategy_.setup(model_, accel::OptimizerOptions{});
    set_state(0.25);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string save(accel::CheckpointSaver& saver, int64_t step) {
    fs::create_directories(accel::checkpoint_tmp_dir(dir_.string(), step));
    accel::CheckpointSnapshot s = accel::take_snapshot(strategy_, 0, 1, true, saver.buffer());
    s.state.step = step;
    s.model_config = config_;
    saver.save(dir_.string(), std::move(s));
    const std::optional<std::string> done = saver.wait();
    return done ? *done : "";
  }
  // Every state tensor (live, through the strategy's views) set to distinct values from `base`
  // (the moments start at zero); the same `base` gives the same values.
  void set_state(double base) {
    int64_t k = 1;
    for (accel::ParamStateSlice& p : strategy_.param_state_slices())
      for (auto& [kind, t] : p.tensors) {
        std::vector<double> v(static_cast<size_t>(t.numel()));
        for (double& x : v) x = base + 0.001 * static_cast<double>(k++);
        t.copy_(Tensor::from_vector(v, t.shape(), DType::F32));
      }
  }
  fs::path dir_;
  accel::DecoderConfig config_;
  accel::SingleProcessStrategy strategy_{DType::F32};
  accel::Linear model_{16, 8, DType::F32, accel::Device::cpu(), /*bias=*/true};
};

// The checksums that the writer computes from memory are those of the files as read back
// (verify_checkpoint re-reads every file; verify_all every slice), and a save into the reused
// buffer, after a save of other values, writes the same bytes as the first.
TEST_F(CheckpointSaveBytes, ReusedBufferWritesTheSameFilesAndChecksumsMatchTheDisk) {
  int pinned = 0, pageable = 0;
  accel::CheckpointSaver::Options o;
  o.async = true;
  o.buffer =
      std::make_unique<SnapshotBuffer>(std::make_unique<FakeMemory>(true, false, &pinned),
                                       std::make_unique<FakeMemory>(false, false, &pageable));
  accel::CheckpointSaver saver(std::move(o));
  const std::string a = save(saver, 1);
  set_state(0.75);
  const std::string b = save(saver, 2);
  set_state(0.25);
  const std::string c = save(saver, 3);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(saver.buffer()->allocations(), 1);  // three saves, one block
  for (const char* f : {"model.safetensors", "optimizer.rank0.safetensors"}) {
    const std::string first = file_bytes(fs::path(a) / f);
    ASSERT_GT(first.size(), 100u) << f;
    EXPECT_EQ(file_bytes(fs::path(c) / f), first) << f << ": the reused buffer changed the bytes";
    EXPECT_NE(file_bytes(fs::path(b) / f), first) << f << ": the other state was not saved";
  }
  for (const std::string& d : {a, b, c}) {
    EXPECT_EQ(accel::verify_checkpoint(d), std::vector<std::string>{}) << d;
    const accel::LoadedCheckpoint ck = accel::load_checkpoint(d);
    accel::CheckpointStateReader reader(ck);
    EXPECT_EQ(reader.verify_all(), 6) << d;       // weight and bias: master, exp_avg, exp_avg_sq
    EXPECT_EQ(ck.params.count("bias"), 1u) << d;  // the name the CUDA test reads
  }
  // The file checksums in the index are those of checksum_file over the bytes on disk.
  nlohmann::json st;
  std::ifstream(fs::path(a) / "trainer_state.json") >> st;
  for (const char* f : {"model.safetensors", "optimizer.rank0.safetensors"})
    EXPECT_EQ(st["files"][f]["checksum"], accel::checksum_file((fs::path(a) / f).string())) << f;
}

// A snapshot taken while the previous save is still being written would overwrite its bytes.
TEST_F(CheckpointSaveBytes, NoSnapshotIntoTheBufferWhileASaveIsInFlight) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  accel::CheckpointSaver::Options o;
  o.async = true;
  o.before_write = [released](const std::string&) { released.wait(); };
  o.buffer = std::make_unique<SnapshotBuffer>(nullptr, accel::pageable_host_memory());
  accel::CheckpointSaver saver(std::move(o));
  fs::create_directories(accel::checkpoint_tmp_dir(dir_.string(), 1));
  accel::CheckpointSnapshot s = accel::take_snapshot(strategy_, 0, 1, true, saver.buffer());
  s.state.step = 1;
  s.model_config = config_;
  saver.save(dir_.string(), std::move(s));
  EXPECT_TRUE(saver.busy());
  EXPECT_THROW(accel::take_snapshot(strategy_, 0, 1, true, saver.buffer()), std::logic_error);
  release.set_value();
  ASSERT_TRUE(saver.wait().has_value());
  EXPECT_NO_THROW(accel::take_snapshot(strategy_, 0, 1, true, saver.buffer()));
}

}  // namespace
