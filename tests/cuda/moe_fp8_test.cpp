// The experts' fp8 casts and GEMMs on the GPU against the CPU twin: the grouped cast kernels bit
// for bit; fp8_grouped_linear (one grouped cast per operand, one cuBLASLt fp8 GEMM per non-empty
// expert) under delayed (TE) and dynamic (AO) scaling over two steps with a scale update between,
// empty and unaligned groups included; and a tiny Qwen3-MoE trained 3 steps in fp8 on the GPU
// against the same on the CPU.
#include <gtest/gtest.h>

#include "models/decoder.h"
#include "models/fp8_linear.h"
#include "parallel/ddp.h"
#include "tests/cuda/cuda_test_util.h"

namespace accel {
namespace {
using namespace cuda_test;

// fp8_cast_grouped on the GPU (one launch for all groups: the grouped tile kernel, 128 groups per
// launch, with the grouped amax pass first under dynamic scaling) against the CPU's, which is each
// group's own cast (tests/ops/fp8_grouped_cast_test.cpp): every group's codes (row-major and
// transposed, padding included), scale, scale_inv and amax bit for bit. Ragged groups with empty
// ones and groups of more than one tile (128 x 64) in both directions; 130 groups (two launches);
// separate tensors (the weights); 36 columns, which the tiles do not take (group by group through
// the generic kernel); fp8 edge values in the first group.
TEST(CudaMoeFp8, GroupedCastMatchesCpuBitForBit) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  struct Case {
    std::vector<int64_t> sizes;
    int64_t cols;
    DType in;
    bool separate;  // separate tensors instead of row blocks of one
  };
  std::vector<int64_t> many;
  for (int g = 0; g < 130; ++g) many.push_back(g % 5 == 0 ? 0 : (g * 37) % 41 + 1);
  const std::vector<int64_t> ragged = {37, 0, 300, 5, 16, 129, 0, 1, 150};
  const std::vector<Case> cases = {
      {ragged, 200, DType::BF16, false}, {ragged, 200, DType::F32, false},
      {ragged, 64, DType::F16, false},   {many, 64, DType::BF16, false},
      {ragged, 96, DType::BF16, true},   {ragged, 36, DType::BF16, false}};
  for (const Case& c : cases)
    for (bool delayed : {true, false})
      for (DType fmt : {DType::E4M3, DType::E5M2})
        for (int mode = 0; mode < 3; ++mode) {
          const Fp8CastOptions opts{mode != 2, mode != 0, 16};
          SCOPED_TRACE(std::to_string(c.sizes.size()) + " groups of " + std::to_string(c.cols) +
                       " " + dtype_name(c.in) + (c.separate ? " separate" : " rows") +
                       (delayed ? " delayed " : " dynamic ") + dtype_name(fmt) + " row " +
                       std::to_string(opts.rowwise) + " col " + std::to_string(opts.columnwise));
          int64_t total = 0;
          for (int64_t n : c.sizes) total += n;
          Tensor x = with_specials(random_tensor({total, c.cols}, c.in, rng, -300.0, 300.0));
          std::vector<Tensor> xs[2];
          Fp8GroupScales sc[2];
          int64_t begin = 0;
          for (size_t g = 0; g < c.sizes.size(); ++g) {
            Tensor part = narrow(x, 0, begin, c.sizes[g]);
            begin += c.sizes[g];
            if (c.separate) part = contiguous(part);
            xs[0].push_back(part);
            xs[1].push_back(c.separate ? part.to(gpu()) : Tensor());
            if (!delayed) continue;
            const double s = (fmt == DType::E4M3 ? 0.37 : 91.0) * (1.0 + 0.29 * double(g));
            const double seed = g % 4 == 3 ? 1e6 : 0.25;  // amaxes max-accumulate
            for (int d = 0; d < 2; ++d) {
              const Device dev = d ? gpu() : Device::cpu();
              sc[d].scales.push_back(Tensor::full({1}, s, DType::F32, dev));
              sc[d].amaxes.push_back(Tensor::full({1}, seed, DType::F32, dev));
            }
          }
          if (!c.separate) {
            Tensor xg = x.to(gpu());
            begin = 0;
            for (size_t g = 0; g < c.sizes.size(); ++g) {
              xs[1][g] = narrow(xg, 0, begin, c.sizes[g]);
              begin += c.sizes[g];
            }
          }
          const Fp8GroupedTensor want = fp8_cast_grouped(xs[0], fmt, sc[0], opts);
          const Fp8GroupedTensor got = fp8_cast_grouped(xs[1], fmt, sc[1], opts);
          for (size_t g = 0; g < c.sizes.size(); ++g) {
            SCOPED_TRACE("group " + std::to_string(g));
            if (delayed) {
              EXPECT_EQ(sc[1].amaxes[g].item(), sc[0].amaxes[g].item()) << "amax";
            }
            if (c.sizes[g] == 0) continue;
            const Fp8Tensor a = got.group(static_cast<int64_t>(g));
            const Fp8Tensor b = want.group(static_cast<int64_t>(g));
            if (opts.rowwise) expect_same_codes(a.data, b.data, "data");
            if (opts.columnwise) expect_same_codes(a.data_t, b.data_t, "data_t");
            EXPECT_EQ(a.scale.item(), b.scale.item()) << "scale";
            EXPECT_EQ(a.scale_inv.item(), b.scale_inv.item()) << "scale_inv";
          }
        }
}

TEST(CudaMoeFp8, GroupedLinearMatchesCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(21);
  // 40 and 72 are not multiples of 16 (the casts pad them); group 1 is empty.
  for (auto [in, out] : {std::pair<int64_t, int64_t>{128, 96}, {40, 72}})
    for (Fp8Scaling scaling : {Fp8Scaling::Delayed, Fp8Scaling::Dynamic}) {
      SCOPED_TRACE(std::string(scaling == Fp8Scaling::Delayed ? "delayed" : "dynamic") + " in " +
                   std::to_string(in) + " out " + std::to_string(out));
      const std::vector<int64_t> groups = {37, 0, 64, 5, 150};
      int64_t rows = 0;
      for (int64_t n : groups) rows += n;
      Tensor x = random_tensor({rows, in}, DType::BF16, rng);
      Tensor g = random_tensor({rows, out}, DType::BF16, rng, -1e-3, 1e-3);
      std::vector<Tensor> w;
      for (size_t e = 0; e < groups.size(); ++e)
        w.push_back(random_tensor({out, in}, DType::BF16, rng, -0.1, 0.1));
      std::vector<Tensor> results[2];
      for (int d = 0; d < 2; ++d) {
        const Device dev = d ? gpu() : Device::cpu();
        Fp8Recipe r;
        r.scaling = scaling;
        auto delayed =
            scaling == Fp8Scaling::Delayed ? std::make_shared<Fp8DelayedScaling>(r, dev) : nullptr;
        std::vector<Fp8LinearContext> ctxs(groups.size());
        std::vector<const Fp8LinearContext*> ptrs;
        for (Fp8LinearContext& c : ctxs) {
          c.recipe = r;
          if (delayed) {
            c.delayed = delayed;
            c.slot_input = delayed->add_slot(DType::E4M3);
            c.slot_weight = delayed->add_slot(DType::E4M3);
            c.slot_grad_output = delayed->add_slot(DType::E5M2);
          }
          ptrs.push_back(&c);
        }
        for (int step = 0; step < 2; ++step) {
          Tensor xd = d ? x.to(dev) : x.clone();
          xd.set_requires_grad(true);
          std::vector<Tensor> wd;
          for (const Tensor& t : w) {
            wd.push_back(d ? t.to(dev) : t.clone());
            wd.back().set_requires_grad(true);
          }
          Tensor y = fp8_grouped_linear(xd, wd, groups, ptrs);
          y.backward(g.to(dev));
          if (delayed) delayed->update();
          if (step == 1) {
            results[d] = {y.detach().to(Device::cpu()), xd.grad().to(Device::cpu())};
            for (const Tensor& t : wd) results[d].push_back(t.grad().to(Device::cpu()));
            if (delayed) results[d].push_back(delayed->scales().to(Device::cpu()));
          }
        }
      }
      ASSERT_EQ(results[0].size(), results[1].size());
      for (size_t i = 0; i < results[0].size(); ++i) {
        const bool scales = scaling == Fp8Scaling::Delayed && i + 1 == results[0].size();
        const std::string what = i == 0   ? "output"
                                 : i == 1 ? "input grad"
                                 : scales ? "scales"
                                          : "weight grad " + std::to_string(i - 2);
        if (scales)  // from the same amaxes, bit for bit
          EXPECT_EQ(results[1][i].to_vector(), results[0][i].to_vector()) << what;
        else
          expect_matches(results[1][i], results[0][i], DType::BF16, "fp8 experts " + what, 2.0);
      }
    }
}

// Three TE and AO steps of a tiny Qwen3-MoE (aligned dims, experts in fp8) on the GPU follow the
// CPU emulation: losses within 1e-2 relative (bf16 compute, different summation orders).
TEST(CudaMoeFp8, TinyQwen3MoeTrainsLikeTheCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  DecoderConfig c;
  c.model_type = "qwen3_moe";
  c.hidden_size = 64;
  c.intermediate_size = 64;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 64;
  c.max_position_embeddings = 64;
  c.num_experts = 16;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.router_aux_loss_coef = 0.01;
  c.output_router_logits = true;
  for (Fp8Backend backend : {Fp8Backend::TE, Fp8Backend::AO}) {
    SCOPED_TRACE(backend == Fp8Backend::TE ? "TE" : "AO");
    Fp8Config cfg;
    cfg.backend = backend;
    std::vector<double> losses[2];
    for (int d = 0; d < 2; ++d) {
      const Device dev = d ? gpu() : Device::cpu();
      CausalLM model(c, DType::F32, dev, 5);
      auto fp8 = apply_fp8(model, cfg, dev);
      SingleProcessStrategy strategy(DType::BF16);
      strategy.setup(model, OptimizerOptions{});
      for (int step = 0; step < 3; ++step) {
        std::vector<int64_t> ids;
        for (int64_t i = 0; i < 4 * 32; ++i) ids.push_back((step * 7 + i * i + 3 * i) % 64);
        Tensor t = Tensor::from_vector(ids, {4, 32}).to(dev);
        Tensor loss = model.forward_loss(t, t);
        losses[d].push_back(loss.item());
        loss.backward();
        strategy.step(1e-3, 1.0, 1.0);
        fp8->step_end(static_cast<ProcessGroup*>(nullptr));
      }
    }
    for (int step = 0; step < 3; ++step)
      EXPECT_NEAR(losses[1][step], losses[0][step], 1e-2 * losses[0][step]) << "step " << step;
  }
}

}  // namespace
}  // namespace accel
