// The NCCL process group. On a machine with a GPU: a 1-rank group on GPU 0, every collective and
// dtype. Elsewhere the GPU tests skip, and the backend must say clearly why it cannot be used.
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

  // A subgroup of the one rank works too (its own communicator).
  auto sub = pg->new_group({0});
  ASSERT_TRUE(sub);
  Tensor x = Tensor::full({5}, 2, DType::F32, gpu);
  sub->all_reduce(x, ReduceOp::Sum)->wait();
  EXPECT_EQ(x.to_vector()[4], 2);
}

}  // namespace
}  // namespace accel
