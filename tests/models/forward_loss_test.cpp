// CausalLM::forward_loss (the LM head fused with the cross-entropy over row chunks) gives the loss
// and every parameter gradient of loss(forward(ids), targets), with an untied and a tied head.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "tests/models/tiny_decoder.h"

namespace accel {
namespace {

std::map<std::string, std::vector<double>> gradients(CausalLM& m) {
  std::map<std::string, std::vector<double>> g;
  for (Parameter* p : m.parameters()) g[p->name] = p->value.grad().to_vector();
  return g;
}

TEST(ForwardLoss, EqualsLossOfLogitsWithGradients) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied head" : "untied head");
    DecoderConfig c = testing::tiny_decoder(70);
    c.head_dim = 8;
    c.tie_word_embeddings = tied;
    CausalLM model(c, DType::F32, Device::cpu(), 11);
    std::vector<int64_t> idv(3 * 7);
    for (size_t i = 0; i < idv.size(); ++i) idv[i] = static_cast<int64_t>((i * 13 + 2) % 70);
    Tensor ids = Tensor::from_vector(idv, {3, 7}, DType::I64);
    Tensor targets = shift_labels(ids);

    for (Parameter* p : model.parameters()) p->value.zero_grad();
    Tensor want = CausalLM::loss(model.forward(ids), targets);
    want.backward();
    auto want_grads = gradients(model);
    for (Parameter* p : model.parameters()) p->value.zero_grad();
    Tensor got = model.forward_loss(ids, targets);
    got.backward();
    auto got_grads = gradients(model);

    EXPECT_NEAR(got.item(), want.item(), 1e-6 * want.item());
    ASSERT_EQ(got_grads.size(), want_grads.size());
    for (auto& [name, w] : want_grads) {
      const std::vector<double>& g = got_grads[name];
      ASSERT_EQ(g.size(), w.size()) << name;
      double scale = 0;
      for (double v : w) scale = std::max(scale, std::abs(v));
      for (size_t i = 0; i < w.size(); ++i)
        ASSERT_NEAR(g[i], w[i], 1e-5 * scale + 1e-9) << name << " element " << i;
    }
  }
}

}  // namespace
}  // namespace accel
