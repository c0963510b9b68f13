// Selective activation checkpointing on the GPU: the gradients of a tiny llama, qwen3 and
// qwen3_moe step are those without checkpointing (the same kernels on the same inputs; within
// the spread of the GPU's non-deterministic reductions) and their CPU twin's, and the activations
// the forward leaves for backward lie strictly between none and full checkpointing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tests/cuda/cuda_test_util.h"
#include "tests/parallel/strategy_test_util.h"

namespace accel {
namespace {
using namespace accel::testing;

struct Step {
  std::vector<std::pair<std::string, std::vector<double>>> grads;
  int64_t saved_bytes = 0;  // activations held from the end of forward to backward
};

Step step_on(Device device, const DecoderConfig& c, ActivationCheckpointing mode) {
  CausalLM m(c, DType::F32, device, 5);
  m.set_activation_checkpointing(mode);
  auto [ids, labels] = rank_batch(RunSpec{}, 0, 0, 0, c.vocab_size);
  const auto held = [device] {
    return memory_stats(device).current[static_cast<int>(MemCategory::Activations)];
  };
  const int64_t before = held();
  Tensor loss = m.forward_loss(ids.to(device), labels.to(device));
  Step out;
  out.saved_bytes = held() - before;
  loss.backward();
  for (Parameter* p : m.parameters())
    out.grads.push_back({p->name, p->value.grad().to(Device::cpu()).to_vector()});
  return out;
}

// The largest difference of any gradient element, relative to that gradient's largest element.
double worst_relative_difference(const Step& got, const Step& want) {
  double worst = 0;
  for (size_t i = 0; i < got.grads.size(); ++i) {
    const std::vector<double>&a = got.grads[i].second, &b = want.grads[i].second;
    double scale = 1e-30, diff = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      scale = std::max(scale, std::abs(b[j]));
      diff = std::max(diff, std::abs(a[j] - b[j]));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

TEST(CudaSelectiveCheckpointing, GradientsMatchNoCheckpointingAndTheCpuTwin) {
  ACCEL_SKIP_WITHOUT_CUDA();
  for (const char* family : {"llama", "qwen3", "qwen3_moe"}) {
    SCOPED_TRACE(family);
    DecoderConfig c = tiny_family(family);
    c.output_router_logits = c.is_moe();
    const Step none = step_on(cuda_test::gpu(), c, ActivationCheckpointing::None);
    const Step full = step_on(cuda_test::gpu(), c, ActivationCheckpointing::Full);
    const Step selective = step_on(cuda_test::gpu(), c, ActivationCheckpointing::Selective);
    const Step cpu = step_on(Device::cpu(), c, ActivationCheckpointing::Selective);
    ASSERT_EQ(selective.grads.size(), none.grads.size());
    EXPECT_LT(worst_relative_difference(selective, none), 1e-5);
    EXPECT_LT(worst_relative_difference(selective, cpu), 1e-3);  // fp32 GEMMs, other orders
    EXPECT_LT(selective.saved_bytes, none.saved_bytes);
    EXPECT_GT(selective.saved_bytes, full.saved_bytes);
  }
}

}  // namespace
}  // namespace accel
