// CUDA runtime: allocator accounting and reuse, copies in every direction, strided casts, fill,
// accumulate, pinned memory, streams and events.
#include <gtest/gtest.h>

#include "runtime/kernels.h"
#include "tests/cuda/cuda_test_util.h"
#ifdef ACCEL_WITH_CUDA
#include "runtime/cuda/context.h"
#endif

namespace accel {
namespace {
using namespace cuda_test;

TEST(CudaRuntime, ReportsDevices) {
  ACCEL_SKIP_WITHOUT_CUDA();
  EXPECT_GE(cuda::device_count(), 1);
}

TEST(CudaRuntime, CountsRequestedBytesPerCategory) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const MemoryStats before = memory_stats(gpu());
  {
    Tensor a = Tensor::empty({1000}, DType::F32, gpu(), MemCategory::Params);
    Tensor b = Tensor::empty({333}, DType::BF16, gpu(), MemCategory::Grads);
    const MemoryStats during = memory_stats(gpu());
    EXPECT_EQ(during.current[int(MemCategory::Params)] - before.current[int(MemCategory::Params)],
              4000);
    EXPECT_EQ(during.current[int(MemCategory::Grads)] - before.current[int(MemCategory::Grads)],
              666);
    EXPECT_GE(during.peak_total, during.current_total);
  }
  const MemoryStats after = memory_stats(gpu());
  EXPECT_EQ(after.current_total, before.current_total);
}

#ifdef ACCEL_WITH_CUDA
TEST(CudaRuntime, AllocatorReusesFreedBlocks) {
  ACCEL_SKIP_WITHOUT_CUDA();
  { Tensor warm = Tensor::empty({3 << 20}, DType::F32, gpu()); }
  { Tensor warm = Tensor::empty({1000}, DType::F32, gpu()); }
  const int64_t mallocs = cuda::allocator_stats(0).num_device_mallocs;
  for (int i = 0; i < 10; ++i) {
    Tensor big = Tensor::empty({3 << 20}, DType::F32, gpu());
    Tensor small = Tensor::empty({1000}, DType::F32, gpu());
  }
  EXPECT_EQ(cuda::allocator_stats(0).num_device_mallocs, mallocs)
      << "the hot path called cudaMalloc";
  EXPECT_GT(cuda::allocator_stats(0).reserved_bytes, 0);
}

TEST(CudaRuntime, PinnedMemoryAndEvents) {
  ACCEL_SKIP_WITHOUT_CUDA();
  float* host = static_cast<float*>(cuda::pinned_alloc(1024 * sizeof(float)));
  for (int i = 0; i < 1024; ++i) host[i] = static_cast<float>(i);
  Tensor t = Tensor::empty({1024}, DType::F32, gpu());
  cuda::Event start, stop;
  start.record();
  cuda::copy_bytes(t.data_ptr(), gpu(), host, Device::cpu(), 1024 * sizeof(float));
  stop.record();
  stop.synchronize();
  EXPECT_TRUE(stop.query());
  EXPECT_GE(start.elapsed_ms(stop), 0.0f);
  std::vector<double> v = t.to_vector();
  EXPECT_EQ(v[1023], 1023.0);
  cuda::pinned_free(host);
}

TEST(CudaRuntime, RecordStreamDelaysReuse) {
  ACCEL_SKIP_WITHOUT_CUDA();
  cudaStream_t side;
  ASSERT_EQ(cudaStreamCreate(&side), cudaSuccess);
  {
    Tensor t = Tensor::empty({4096}, DType::F32, gpu());
    cuda::record_stream(t.data_ptr(), side);
    Tensor view = t.as_strided({100}, {1}, 1000);  // an interior pointer names the same block
    cuda::record_stream(view.data_ptr(), side);
  }
  EXPECT_THROW(cuda::record_stream(reinterpret_cast<void*>(16), side), std::invalid_argument);
  Tensor u = Tensor::empty({4096}, DType::F32, gpu());  // must not crash, may or may not reuse
  u.fill_(1.0);
  EXPECT_EQ(u.to_vector()[17], 1.0);
  cuda::synchronize(0);
  cudaStreamDestroy(side);
}
#endif

TEST(CudaRuntime, CopiesRoundTrip) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor x = random_tensor({37, 41}, DType::F32, rng);
  Tensor g = x.to(gpu());
  Tensor g2 = poisoned({37, 41}, DType::F32);
  g2.copy_(g);  // device to device
  expect_close(g2.to(Device::cpu()), x, 0, 0, "H2D, D2D, D2H");
}

TEST(CudaRuntime, StridedCastCopyMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const DType types[] = {DType::F32,  DType::BF16, DType::F16, DType::E4M3,
                         DType::E5M2, DType::I32,  DType::I64, DType::F64};
  Tensor base = random_tensor({6, 10, 12}, DType::F64, rng, -300, 300);
  for (DType src_t : types)
    for (DType dst_t : {DType::F32, DType::BF16, DType::F16, DType::E4M3, DType::I64}) {
      Tensor src_cpu = Tensor::empty({6, 10, 12}, src_t);
      src_cpu.copy_(base);
      // A transposed, sliced view.
      Tensor view_cpu = src_cpu.as_strided({10, 3, 12}, {12, 240, 1}, 12);
      Tensor src_gpu = src_cpu.to(gpu());
      Tensor view_gpu = src_gpu.as_strided({10, 3, 12}, {12, 240, 1}, 12);
      Tensor want = Tensor::empty({10, 3, 12}, dst_t);
      kernels::copy(want, view_cpu);
      Tensor got = poisoned({10, 3, 12}, dst_t);
      kernels::copy(got, view_gpu);
      expect_close(got, want, 0, 0,
                   std::string("copy ") + dtype_name(src_t) + " -> " + dtype_name(dst_t));
    }
}

TEST(CudaRuntime, ContiguousCastsMatchCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (int64_t n : {1, 7, 4099}) {  // the vector body and the tail
    Tensor f = random_tensor({n}, DType::F32, rng, -1e3, 1e3);
    Tensor want = Tensor::empty({n}, DType::BF16);
    kernels::copy(want, f);
    Tensor got = poisoned({n}, DType::BF16);
    kernels::copy(got, f.to(gpu()));
    expect_close(got, want, 0, 0, "f32 -> bf16");
    Tensor back = poisoned({n}, DType::F32);
    kernels::copy(back, got);
    Tensor want_back = Tensor::empty({n}, DType::F32);
    kernels::copy(want_back, want);
    expect_close(back, want_back, 0, 0, "bf16 -> f32");
  }
}

TEST(CudaRuntime, FillAndAccumulate) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    Tensor g = Tensor::empty({5, 7}, t, gpu());
    g.fill_(0.3);
    Tensor c = Tensor::empty({5, 7}, t);
    c.fill_(0.3);
    expect_close(g, c, 0, 0, "fill");
    Tensor src = random_tensor({7, 5}, t, rng);
    Tensor src_t_cpu = src.as_strided({5, 7}, {1, 5}, 0);  // transposed view
    Tensor src_t_gpu = src.to(gpu()).as_strided({5, 7}, {1, 5}, 0);
    kernels::accumulate(c, src_t_cpu);
    kernels::accumulate(g, src_t_gpu);
    expect_close(g, c, 0, 0, std::string("accumulate ") + dtype_name(t));
    // Contiguous (vectorized path with a tail) and a misaligned view (element path).
    Tensor a = random_tensor({3, 1001}, t, rng), b = random_tensor({3, 1001}, t, rng);
    Tensor ag = a.to(gpu()), bg = b.to(gpu());
    kernels::accumulate(a, b);
    kernels::accumulate(ag, bg);
    expect_close(ag, a, 0, 0, std::string("accumulate contiguous ") + dtype_name(t));
    Tensor a1 = a.as_strided({3000}, {1}, 1), b1 = b.as_strided({3000}, {1}, 2);
    Tensor ag1 = ag.as_strided({3000}, {1}, 1), bg1 = bg.as_strided({3000}, {1}, 2);
    kernels::accumulate(a1, b1);
    kernels::accumulate(ag1, bg1);
    expect_close(ag, a, 0, 0, std::string("accumulate misaligned ") + dtype_name(t));
    // sum_of: a new tensor, both inputs unchanged (vector path, misaligned views, strided b).
    for (int64_t off : {0, 1}) {
      Tensor x = a.as_strided({3000}, {1}, off), y = b.as_strided({3000}, {1}, 2);
      Tensor xg = ag.as_strided({3000}, {1}, off), yg = bg.as_strided({3000}, {1}, 2);
      Tensor want = kernels::sum_of(x, y), got = kernels::sum_of(xg, yg);
      ASSERT_TRUE(got.is_contiguous());
      expect_close(got, want, 0, 0, std::string("sum_of ") + dtype_name(t));
      expect_close(xg, x, 0, 0, "sum_of leaves a unchanged");
      expect_close(yg, y, 0, 0, "sum_of leaves b unchanged");
    }
    Tensor st = kernels::sum_of(src_t_gpu, g);  // a strided operand
    expect_close(st, kernels::sum_of(src_t_cpu, c), 0, 0, "sum_of strided");
  }
}

}  // namespace
}  // namespace accel
