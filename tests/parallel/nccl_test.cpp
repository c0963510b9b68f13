// The NCCL process group. On a machine with a GPU: a 1-rank group on GPU 0, every collective and
// dtype. Elsewhere the GPU tests skip, and the backend must say clearly why it cannot be used.
#include <filesystem>

#include "ops/ops.h"
#include "parallel/expert_parallel.h"
#include "runtime/device.h"
#include "tests/parallel/harness.h"

namespace accel {
namespace {

using namespace std::chrono_literals;

std::shared_ptr<TcpStore> one_rank_store() {
  StoreOptions so;
  so.port = testing::pick_free_port();
  so.is_server = true;
  so.token = "nccl-test";
  so.timeout = 30s;
  return std::make_shared<TcpStore>(so);
}

TEST(Nccl, UnavailableBackendSaysWhy) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is present; see Nccl.OneRankGroup";
  EXPECT_FALSE(nccl_available());
  try {
    make_nccl_process_group(one_rank_store(), 0, 1, 0);
    ADD_FAILURE() << "expected an error";
  } catch (const std::exception& e) {
    std::string msg = e.what();
    EXPECT_TRUE(msg.find("without NCCL") != std::string::npos ||
                msg.find("no CUDA device") != std::string::npos)
        << msg;
  }
}

TEST(Nccl, OneRankGroup) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device: the NCCL backend is not tested here";
  ASSERT_TRUE(nccl_available());
  const Device gpu = Device::cuda(0);
  ProcessGroupOptions po;
  po.timeout = 60s;
  auto pg = make_nccl_process_group(one_rank_store(), 0, 1, 0, po);
  EXPECT_EQ(pg->backend(), "nccl");
  EXPECT_EQ(pg->size(), 1);

  for (DType d :
       {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      std::vector<double> v = {1, 2, 3, 4, 5, 6, 7};
      Tensor t = Tensor::from_vector(v, {7}, d, gpu);
      pg->all_reduce(t, op)->wait();
      EXPECT_EQ(t.to_vector(), v) << dtype_name(d) << " " << reduce_op_name(op);
    }
  }
  // Zero elements, reduce_scatter, all_gather of fp8 bytes, broadcast, barrier, wait_stream.
  pg->all_reduce(Tensor::zeros({0}, DType::F32, gpu))->wait();
  Tensor in = Tensor::from_vector(std::vector<double>{1, 2, 3}, {3}, DType::BF16, gpu);
  Tensor out = Tensor::zeros({3}, DType::BF16, gpu);
  pg->reduce_scatter(out, in, ReduceOp::Avg)->wait();
  EXPECT_EQ(out.to_vector(), (std::vector<double>{1, 2, 3}));
  Tensor f8 = Tensor::from_vector(std::vector<double>{0.5, -2, 448}, {3}, DType::E4M3, gpu);
  Tensor g8 = Tensor::zeros({3}, DType::E4M3, gpu);
  pg->all_gather(g8, f8)->wait();
  EXPECT_EQ(g8.to_vector(), (std::vector<double>{0.5, -2, 448}));
  Tensor b = Tensor::full({1 << 20}, 3, DType::F32, gpu);
  auto w = pg->broadcast(b, 0);
  w->wait_stream();
  w->wait();
  EXPECT_TRUE(w->is_completed());
  pg->barrier()->wait();
  CommStats s = pg->stats();
  EXPECT_EQ(s[CommKind::AllReduce].calls, 7 * 3 + 1);
  EXPECT_EQ(s[CommKind::Broadcast].bytes, 4 << 20);

  // Clear errors.
  EXPECT_THROW(pg->all_reduce(Tensor::zeros({4}, DType::E4M3, gpu)), std::invalid_argument);
  EXPECT_THROW(pg->all_reduce(Tensor::zeros({4})), std::invalid_argument);  // host tensor
  EXPECT_THROW(pg->send(b, 0), std::invalid_argument);                      // to itself

  // all_to_all over one rank: the own rows are copied (every dtype moves as bytes).
  for (DType d : {DType::F32, DType::BF16, DType::E4M3, DType::I64}) {
    Tensor rows = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {3, 2}, d, gpu);
    Tensor moved = Tensor::zeros({3, 2}, d, gpu);
    pg->all_to_all(moved, rows, {3}, {3})->wait();
    EXPECT_EQ(moved.to_vector(), rows.to_vector()) << dtype_name(d);
  }
  EXPECT_EQ(pg->stats()[CommKind::AllToAll].calls, 4);
  EXPECT_EQ(pg->stats()[CommKind::AllToAll].wire_bytes, 0);
  EXPECT_THROW(pg->all_to_all(Tensor::zeros({2, 2}, DType::F32, gpu),
                              Tensor::zeros({3, 2}, DType::F32, gpu), {2}, {3}),
               std::invalid_argument);

  // A subgroup of the one rank works too (its own communicator).
  auto sub = pg->new_group({0});
  ASSERT_TRUE(sub);
  Tensor x = Tensor::full({5}, 2, DType::F32, gpu);
  sub->all_reduce(x, ReduceOp::Sum)->wait();
  EXPECT_EQ(x.to_vector()[4], 2);
}

// GPUs visible to the driver, counted without initializing CUDA in this process (the ranks are
// forked; a CUDA context must not exist before fork).
int driver_gpu_count() {
  std::error_code ec;
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
    (void)e;
    ++n;
  }
  return n;
}

// Two ranks on two GPUs: uneven and zero splits, both directions, and the differentiable
// all_to_all_rows (forward and backward) of parallel/expert_parallel.h.
TEST(Nccl, TwoRankAllToAll) {
  if (driver_gpu_count() < 2) GTEST_SKIP() << "needs two GPUs";
  const int port = testing::pick_free_port();
  auto exits = testing::run_ranks(
      2,
      [&](int r) -> int {
        StoreOptions so;
        so.port = port;
        so.is_server = r == 0;
        so.token = "nccl-a2a";
        so.timeout = 60s;
        auto store = std::make_shared<TcpStore>(so);
        ProcessGroupOptions po;
        po.timeout = 60s;
        auto pg = make_nccl_process_group(store, r, 2, r, po);
        const Device gpu = Device::cuda(r);
        // Rank q sends rank p rows(q, p) rows of 3 columns, values naming both.
        auto rows = [](int q, int p) -> int64_t {
          return q == 0 ? (p == 0 ? 2 : 3) : (p == 0 ? 0 : 1);
        };
        for (DType d : {DType::F32, DType::BF16, DType::I64}) {
          std::vector<int64_t> send = {rows(r, 0), rows(r, 1)}, recv = {rows(0, r), rows(1, r)};
          std::vector<double> v;
          for (int p = 0; p < 2; ++p)
            for (int64_t i = 0; i < send[p]; ++i)
              for (int j = 0; j < 3; ++j) v.push_back(r * 100 + p * 10 + i * 3 + j);
          Tensor in = Tensor::from_vector(v, {send[0] + send[1], 3}, d, gpu);
          Tensor out = Tensor::zeros({recv[0] + recv[1], 3}, d, gpu);
          pg->all_to_all(out, in, recv, send)->wait();
          std::vector<double> got = out.to_vector();
          size_t k = 0;
          for (int q = 0; q < 2; ++q)
            for (int64_t i = 0; i < recv[q]; ++i)
              for (int j = 0; j < 3; ++j, ++k)
                RANK_CHECK(got[k] == q * 100 + r * 10 + i * 3 + j, "%s row %lld from %d: %f",
                           dtype_name(d), static_cast<long long>(i), q, got[k]);
        }
        // The differentiable version: the gradient of sum(y * c) comes back to the sender.
        std::vector<int64_t> send = {rows(r, 0), rows(r, 1)}, recv = {rows(0, r), rows(1, r)};
        Tensor x = Tensor::full({send[0] + send[1], 3}, 1.0 + r, DType::F32, gpu);
        x.set_requires_grad(true);
        Tensor y = all_to_all_rows(x, send, recv, *pg);
        sum(mul(y, 2.0 + r)).backward();
        std::vector<double> g = x.grad().to_vector();
        size_t k = 0;
        for (int p = 0; p < 2; ++p)
          for (int64_t i = 0; i < send[p] * 3; ++i, ++k)
            RANK_CHECK(g[k] == 2.0 + p, "gradient of a row sent to %d: %f", p, g[k]);
        // Wire bytes: the rows for the other rank (3 dtypes, then all_to_all_rows' forward),
        // and in its backward the gradient rows that came from it.
        const int64_t wire = (3 * 4 + 3 * 2 + 3 * 8 + 3 * 4) * send[1 - r] + 3 * 4 * recv[1 - r];
        RANK_CHECK(pg->stats()[CommKind::AllToAll].wire_bytes == wire, "wire bytes %lld vs %lld",
                   static_cast<long long>(pg->stats()[CommKind::AllToAll].wire_bytes),
                   static_cast<long long>(wire));
        return 0;
      },
      std::chrono::seconds(120));
  testing::expect_all_ok(exits);
}

}  // namespace
}  // namespace accel
