// Attention forward/backward (cuDNN's fused kernels, our tensor-core and generic kernels) against
// the CPU backend, with grouped KV heads, causal and full masks, sliding windows and packed
// documents (segment_ids), and sequence lengths that are not tile multiples.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <utility>
#include <vector>

#include "tests/cuda/cuda_test_util.h"
#ifdef ACCEL_WITH_CUDA
#include "ops/cuda/attention.cuh"
#include "ops/cuda/cuda_backend.h"
#endif

namespace accel {
namespace {
using namespace cuda_test;

// Tensor-core backward paths (ACCEL_ATTN_BWD); Default leaves the variable unset. Fa2 runs one q
// head per block (fp32 dK/dV partial sums), Fa2Group the whole group (the default), both through
// ACCEL_ATTN_FA2_HEADS.
enum class Bwd { Default, Fa2, Fa2Group, Split };

const char* bwd_suffix(Bwd b) {
  switch (b) {
    case Bwd::Fa2:
      return "_fa2";
    case Bwd::Fa2Group:
      return "_fa2group";
    case Bwd::Split:
      return "_split";
    default:
      return "";
  }
}

// The kernels a case forces (cuda::set_attention_impl).
enum class Impl { Flash, Generic, Cudnn, Auto };

const char* impl_name(Impl i) {
  switch (i) {
    case Impl::Generic:
      return "generic";
    case Impl::Cudnn:
      return "cudnn";
    case Impl::Auto:
      return "auto";
    default:
      return "flash";
  }
}

struct AttnCase {
  DType dtype;
  int64_t b, s, hq, hkv, d;
  bool causal;
  Impl impl = Impl::Flash;
  Bwd bwd = Bwd::Default;
  int64_t sk = 0;  // key count when it differs from s (causal mask bottom-right aligned)
  int64_t window = 0;
  bool segments = false;  // documents of ragged lengths (documents_for)
};

// Segment ids [B, S] of ragged documents (1 position included): row b cycles through the lengths
// from a different start; odd rows alternate ids 0 and 1, so equal ids recur in separate runs
// (separate documents).
Tensor documents_for(int64_t B, int64_t S) {
  const std::vector<int64_t> lengths{1, 70, 3, 129, 17, 64, 1, 200, 2, 33};
  std::vector<int64_t> ids;
  for (int64_t b = 0; b < B; ++b) {
    int64_t doc = 0;
    for (size_t n = static_cast<size_t>(b); static_cast<int64_t>(ids.size()) < (b + 1) * S; ++n) {
      const int64_t id = b % 2 ? doc % 2 : doc;
      for (int64_t t = 0;
           t < lengths[n % lengths.size()] && static_cast<int64_t>(ids.size()) < (b + 1) * S; ++t)
        ids.push_back(id);
      ++doc;
    }
  }
  return Tensor::from_vector(ids, {B, S}, DType::I32);
}

AttentionMask mask_for(const AttnCase& c) {
  return AttentionMask{c.causal, c.window, c.segments ? documents_for(c.b, c.s) : Tensor()};
}

// The keys [lo, hi) query i of row b sees under the case's mask, from AttentionMask's definition.
std::pair<int64_t, int64_t> visible_keys(const AttnCase& c, const std::vector<double>& seg,
                                         int64_t b, int64_t i) {
  const int64_t sk = c.sk ? c.sk : c.s;
  if (!c.causal) return {0, sk};
  const int64_t pos = i + sk - c.s;
  int64_t lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
  const int64_t hi = std::clamp<int64_t>(pos + 1, 0, sk);
  if (!seg.empty()) {  // back to the start of i's run of equal ids
    int64_t start = i;
    while (start > 0 && seg[b * c.s + start - 1] == seg[b * c.s + i]) --start;
    lo = std::max(lo, start);
  }
  return {std::min(lo, hi), hi};
}

std::string case_name(const AttnCase& c) {
  return std::string(dtype_name(c.dtype)) + "_b" + std::to_string(c.b) + "_s" +
         std::to_string(c.s) + (c.sk ? "_sk" + std::to_string(c.sk) : "") + "_hq" +
         std::to_string(c.hq) + "_hkv" + std::to_string(c.hkv) + "_d" + std::to_string(c.d) +
         (c.causal ? "_causal" : "_full") + (c.window ? "_w" + std::to_string(c.window) : "") +
         (c.segments ? "_docs" : "") +
         (c.impl == Impl::Flash ? "" : std::string("_") + impl_name(c.impl)) + bwd_suffix(c.bwd);
}

// Per element of dQ, dK and dV, `units` epsilons of the case's dtype times the sum of the absolute
// values of the terms that make it up (|dS_ij k_j| scale, |dS_ij q_i| scale, |P_ij dO_i|), in f64
// from the inputs, the forward's output and lse. A 16-bit backward rounds P and dS to the input
// dtype before its GEMMs, so its rounding error in an element stays within about an epsilon times
// this sum, whatever the cancellation in the element itself; zero for f32.
struct GradSlack {
  std::vector<double> dq, dk, dv;
};

GradSlack rounding_slack(const AttnCase& c, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& dout, const Tensor& out, const Tensor& lse, double scale,
                         double units) {
  const int64_t sk = c.sk ? c.sk : c.s, group = c.hq / c.hkv, D = c.d;
  const std::vector<double> Q = q.to_vector(), K = k.to_vector(), V = v.to_vector(),
                            dO = dout.to_vector(), O = out.to_vector(), L = lse.to_vector();
  const std::vector<double> seg =
      c.segments ? documents_for(c.b, c.s).to_vector() : std::vector<double>();
  GradSlack r{std::vector<double>(Q.size()), std::vector<double>(K.size()),
              std::vector<double>(K.size())};
  for (int64_t b = 0; b < c.b; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.s; ++i) {
        const double l = L[(b * c.hq + h) * c.s + i];
        if (std::isinf(l)) continue;  // a row that sees no key
        const size_t qi = ((b * c.s + i) * c.hq + h) * D;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += dO[qi + d] * O[qi + d];
        const auto [lo, hi] = visible_keys(c, seg, b, i);
        for (int64_t j = lo; j < hi; ++j) {
          const size_t kj = ((b * sk + j) * c.hkv + h / group) * D;
          double dot = 0, dp = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += Q[qi + d] * K[kj + d];
            dp += dO[qi + d] * V[kj + d];
          }
          const double p = std::exp(dot * scale - l), ds = std::fabs(p * (dp - delta)) * scale;
          for (int64_t d = 0; d < D; ++d) {
            r.dq[qi + d] += ds * std::fabs(K[kj + d]);
            r.dk[kj + d] += ds * std::fabs(Q[qi + d]);
            r.dv[kj + d] += p * std::fabs(dO[qi + d]);
          }
        }
      }
  const double eps =
      units * (c.dtype == DType::BF16 ? 0x1p-8 : (c.dtype == DType::F16 ? 0x1p-11 : 0));
  for (auto* sums : {&r.dq, &r.dk, &r.dv})
    for (double& x : *sums) x *= eps;
  return r;
}

class CudaAttention : public ::testing::TestWithParam<AttnCase> {
 protected:
  void SetUp() override {
#ifdef ACCEL_WITH_CUDA
    if (cuda::available()) cuda::set_attention_impl(impl_name(GetParam().impl));
#endif
    const Bwd bwd = GetParam().bwd;
    if (bwd != Bwd::Default) setenv("ACCEL_ATTN_BWD", bwd == Bwd::Split ? "split" : "fa2", 1);
    if (bwd == Bwd::Fa2) setenv("ACCEL_ATTN_FA2_HEADS", "1", 1);
    if (bwd == Bwd::Fa2Group) setenv("ACCEL_ATTN_FA2_HEADS", "64", 1);  // lowered to the group
  }
  void TearDown() override {
#ifdef ACCEL_WITH_CUDA
    if (cuda::available()) cuda::set_attention_impl("auto");
#endif
    unsetenv("ACCEL_ATTN_BWD");
    unsetenv("ACCEL_ATTN_FA2_HEADS");
  }
};

TEST_P(CudaAttention, ForwardAndBackwardMatchCpu) {
  ACCEL_SKIP_WITHOUT_CUDA();
  const AttnCase c = GetParam();
  const DType t = c.dtype;
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t sk = c.sk ? c.sk : c.s;
  const Shape qs{c.b, c.s, c.hq, c.d}, ks{c.b, sk, c.hkv, c.d}, ls{c.b, c.hq, c.s};
  Tensor q = random_tensor(qs, t, rng, -2, 2), k = random_tensor(ks, t, rng, -2, 2);
  Tensor v = random_tensor(ks, t, rng);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const AttentionMask mask = mask_for(c);
  AttentionMask gpu_mask = mask;
  if (mask.segment_ids.defined()) gpu_mask.segment_ids = mask.segment_ids.to(gpu());
  Tensor want = cpu_out(qs, t), wl = cpu_out(ls, DType::F32);
  cpu_backend().attention(want, wl, q, k, v, mask, scale);
  Tensor qg = q.to(gpu()), kg = k.to(gpu()), vg = v.to(gpu());
  Tensor got = poisoned(qs, t), gl = poisoned(ls, DType::F32);
  cuda_backend().attention(got, gl, qg, kg, vg, gpu_mask, scale);
  expect_matches(got, want, t, "attention out", 2.0);
  expect_close(gl, wl, t == DType::F32 ? 1e-5 : 2e-3, t == DType::F32 ? 1e-5 : 2e-3, "lse");

  Tensor dout = random_tensor(qs, t, rng);
  Tensor wdq = cpu_out(qs, t), wdk = cpu_out(ks, t), wdv = cpu_out(ks, t);
  cpu_backend().attention_backward(wdq, wdk, wdv, dout, q, k, v, want, wl, mask, scale);
  Tensor gdq = poisoned(qs, t), gdk = poisoned(ks, t), gdv = poisoned(ks, t);
  cuda_backend().attention_backward(gdq, gdk, gdv, dout.to(gpu()), qg, kg, vg, want.to(gpu()),
                                    wl.to(gpu()), gpu_mask, scale);
  // Gradients sum over many rows: compare against each tensor's scale. A gradient can be exactly
  // zero (one visible key: softmax is 1, dS = 0), where the GPU's rounding noise of dP - delta
  // remains: the scale has a floor of 1e-3 of the incoming gradient's. The kernels round P to
  // the input dtype for the P^T dO product (as FlashAttention does); in bf16 that alone puts a
  // key's dV that many rows attend to strongly (early keys under a causal mask) at about 2e-2 of
  // the scale now and then.
  const double r = t == DType::F32 ? 1e-4 : (t == DType::BF16 ? 3e-2 : 2e-2);
  const double floor = 1e-3 * rms(dout);
  // cuDNN rounds more intermediates to the input dtype than our kernels: dS (and P) before the
  // dQ / dK GEMMs, where a row's few terms can cancel (a query that sees two keys), and each
  // query head's dK/dV before the grouped-KV sum, up to half an ulp of the largest partial per
  // head (keys that many queries attend to: the first ones under a causal mask). Measured worst
  // cases over hundreds of seeds are within twice the per-element bound and the group term below.
  const bool cudnn = (c.impl == Impl::Cudnn || c.impl == Impl::Auto) && t != DType::F32;
  const double widen = cudnn ? 2.0 : 1.0;
  // In f32 that noise is a few ulps of dO.V (the GPU's exp and row sums round otherwise), far
  // above r * floor: a window of 1 makes every dQ and dK exactly zero on the CPU.
  const double f32_noise = t == DType::F32 ? 1e-5 * rms(dout) : 0.0;
  auto atol = [&](const Tensor& want_grad, bool kv) {
    const double bound = std::max(widen * r * std::max(rms(want_grad), floor), f32_noise);
    if (!cudnn || !kv || c.hq == c.hkv) return bound;
    double max_abs = 0;
    for (double x : want_grad.to_vector()) max_abs = std::max(max_abs, std::fabs(x));
    const double eps = t == DType::BF16 ? 0x1p-8 : 0x1p-11;
    return std::max(bound, static_cast<double>(c.hq / c.hkv) * eps * max_abs);
  };
  // Where an element's terms cancel, the tensor-scale bound above can be tighter than the
  // rounding of P and dS allows (2 of 2,552 runs of the split backward's cases failed so, at
  // 0.1-0.7 of the term-sum bound): every element also gets two epsilons of its term sum.
  const GradSlack slack = rounding_slack(c, q, k, v, dout, want, wl, scale, 2.0);
  expect_close(gdq, wdq, r, atol(wdq, false), "grad_q", &slack.dq);
  expect_close(gdk, wdk, r, atol(wdk, true), "grad_k", &slack.dk);
  expect_close(gdv, wdv, r, atol(wdv, true), "grad_v", &slack.dv);
}

// The tensor-core cases, each run under every backward path: GQA ratios 1, 2 and 4, head dims
// 64 and 128, bf16 and f16, batch 1 and 2, lengths below, at and across the 64-row tiles.
std::vector<AttnCase> mma_cases() {
  const DType B = DType::BF16, H = DType::F16;
  const std::vector<AttnCase> base = {
      {B, 2, 100, 4, 2, 64, true},   {B, 1, 130, 4, 1, 128, true}, {B, 2, 77, 2, 2, 64, false},
      {H, 1, 129, 4, 2, 128, true},  {B, 1, 300, 4, 1, 64, true},  {H, 1, 200, 2, 2, 64, false},
      {B, 2, 1, 4, 4, 64, true},     {H, 1, 1, 2, 1, 128, false},  {B, 2, 37, 4, 1, 128, true},
      {H, 2, 37, 4, 4, 64, true},    {B, 1, 257, 8, 2, 64, true},  {H, 2, 257, 2, 1, 128, true},
      {B, 2, 130, 4, 2, 128, false}, {B, 1, 64, 2, 1, 64, true},   {H, 1, 128, 4, 4, 128, true},
  };
  // Masks: windows shorter than S (off and on the 64-key tiles), of 1 and longer than S;
  // documents of ragged lengths, alone and with a window.
  const auto masked = [](AttnCase c, int64_t window, bool segments) {
    c.window = window;
    c.segments = segments;
    return c;
  };
  const std::vector<AttnCase> masks = {
      masked({B, 2, 300, 4, 2, 64, true}, 100, false),
      masked({H, 1, 200, 4, 1, 128, true}, 1, false),
      masked({B, 1, 130, 2, 2, 64, true}, 500, false),
      masked({B, 1, 257, 8, 2, 64, true}, 64, false),
      masked({B, 2, 300, 4, 2, 64, true}, 0, true),
      masked({H, 2, 257, 4, 1, 128, true}, 0, true),
      masked({H, 1, 400, 4, 2, 64, true}, 50, true),
      masked({B, 2, 1, 4, 4, 64, true}, 1, true),
  };
  std::vector<AttnCase> out;
  for (Bwd bwd : {Bwd::Fa2, Bwd::Fa2Group, Bwd::Split})
    for (const auto* list : {&base, &masks})
      for (AttnCase c : *list) {
        if (bwd == Bwd::Fa2Group && c.hq == c.hkv) continue;  // the same as Fa2
        c.bwd = bwd;
        out.push_back(c);
      }
  // Key count != query count: bottom-right aligned causal mask (and window); with more queries
  // than keys the first rows see no key at all (lse -inf, zero gradients).
  for (Bwd bwd : {Bwd::Fa2, Bwd::Fa2Group, Bwd::Split}) {
    AttnCase more_keys{B, 1, 37, 4, 2, 64, true, Impl::Flash, bwd, 100};
    AttnCase more_queries{H, 2, 100, 2, 1, 128, true, Impl::Flash, bwd, 37};
    out.push_back(more_keys);
    out.push_back(more_queries);
    more_keys.window = 20;
    more_queries.window = 10;
    out.push_back(more_keys);
    out.push_back(more_queries);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(TensorCores, CudaAttention, ::testing::ValuesIn(mma_cases()),
                         [](const auto& info) { return case_name(info.param); });

// cuDNN's fused kernels (forced, so a graph cuDNN turns down fails the case): GQA ratios 1, 2
// and 4, head dims 64, 128 and 96, bf16 and f16, lengths off the tile sizes; and "auto", which
// must pick them for these problems. The backward gets the CPU's output and lse, so it also
// shows that cuDNN reads our lse convention.
std::vector<AttnCase> cudnn_cases() {
  const DType B = DType::BF16, H = DType::F16;
  const Impl C = Impl::Cudnn;
  return {
      {B, 2, 100, 4, 2, 64, true, C},
      {B, 1, 130, 4, 1, 128, true, C},
      {B, 2, 77, 2, 2, 64, false, C},
      {H, 1, 129, 4, 2, 128, true, C},
      {B, 1, 300, 8, 2, 64, true, C},
      {H, 2, 64, 2, 2, 64, true, C},
      {B, 1, 1, 4, 4, 64, true, C},
      {B, 2, 257, 4, 4, 96, true, C},
      {B, 1, 256, 8, 2, 64, true, Impl::Auto},
      // Sliding windows through cuDNN's diagonal-band pattern (a window of 1, shorter and
      // longer than S); documents are ours even under "auto" (cuDNN declines them).
      {B, 2, 300, 4, 2, 64, true, C, Bwd::Default, 0, 100},
      {H, 1, 129, 4, 2, 128, true, C, Bwd::Default, 0, 1},
      {B, 1, 130, 2, 2, 64, true, C, Bwd::Default, 0, 500},
      {B, 1, 256, 8, 2, 64, true, Impl::Auto, Bwd::Default, 0, 64},
      {B, 2, 300, 4, 2, 64, true, Impl::Auto, Bwd::Default, 0, 0, true},
  };
}

INSTANTIATE_TEST_SUITE_P(Cudnn, CudaAttention, ::testing::ValuesIn(cudnn_cases()),
                         [](const auto& info) { return case_name(info.param); });

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttention,
    ::testing::Values(
        AttnCase{DType::BF16, 2, 100, 4, 2, 64, true, Impl::Generic},
        AttnCase{DType::F32, 2, 70, 4, 2, 64, true, Impl::Auto},
        AttnCase{DType::F32, 1, 45, 3, 1, 80, false, Impl::Auto},
        AttnCase{DType::F32, 1, 33, 2, 2, 16, true, Impl::Auto},
        // The generic kernels under every mask.
        AttnCase{DType::BF16, 2, 100, 4, 2, 64, true, Impl::Generic, Bwd::Default, 0, 30},
        AttnCase{DType::F16, 2, 300, 4, 1, 64, true, Impl::Generic, Bwd::Default, 0, 0, true},
        AttnCase{DType::F32, 2, 70, 4, 2, 64, true, Impl::Auto, Bwd::Default, 0, 1, true},
        AttnCase{DType::F32, 1, 45, 3, 1, 80, true, Impl::Auto, Bwd::Default, 0, 7},
        AttnCase{DType::F32, 1, 50, 2, 1, 32, true, Impl::Auto, Bwd::Default, 20, 5}),
    [](const auto& info) { return case_name(info.param); });

#ifdef ACCEL_WITH_CUDA
// The switch itself (host code, no GPU needed).
TEST(CudaAttentionOps, BackwardSwitchFollowsEnv) {
  unsetenv("ACCEL_ATTN_BWD");
  EXPECT_EQ(cuda::attention_backward_impl(DType::BF16, 64), cuda::AttnBwdImpl::Fa2);
  EXPECT_EQ(cuda::attention_backward_impl(DType::F16, 128), cuda::AttnBwdImpl::Fa2);
  EXPECT_EQ(cuda::attention_backward_impl(DType::F32, 64), cuda::AttnBwdImpl::None);
  EXPECT_EQ(cuda::attention_backward_impl(DType::BF16, 80), cuda::AttnBwdImpl::None);
  setenv("ACCEL_ATTN_BWD", "split", 1);
  EXPECT_EQ(cuda::attention_backward_impl(DType::BF16, 64), cuda::AttnBwdImpl::Split);
  setenv("ACCEL_ATTN_BWD", "fa2", 1);
  EXPECT_EQ(cuda::attention_backward_impl(DType::BF16, 128), cuda::AttnBwdImpl::Fa2);
  setenv("ACCEL_ATTN_BWD", "fast", 1);
  EXPECT_THROW(cuda::attention_backward_impl(DType::BF16, 64), std::invalid_argument);
  unsetenv("ACCEL_ATTN_BWD");
}
#endif

#ifdef ACCEL_WITH_CUDA
// Forcing cuDNN where it cannot run is an error that names the reason, not a silent fallback;
// unknown implementation names are rejected.
TEST(CudaAttentionOps, ForcedCudnnRefusesUnsupportedProblems) {
  EXPECT_THROW(cuda::set_attention_impl("fastest"), std::invalid_argument);
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(7);
  Tensor q = random_tensor({1, 16, 2, 32}, DType::F32, rng).to(gpu());
  Tensor out = poisoned({1, 16, 2, 32}, DType::F32), lse = poisoned({1, 2, 16}, DType::F32);
  cuda::set_attention_impl("cudnn");
  try {
    cuda_backend().attention(out, lse, q, q, q, AttentionMask{}, 0.5);
    ADD_FAILURE() << "cuDNN accepted an f32 problem";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 or f16"), std::string::npos) << e.what();
  }
  cuda::set_attention_impl("auto");
}
#endif

#ifdef ACCEL_WITH_CUDA
// cuDNN does no document masks here: demanded, that is an error saying so (never attention
// across documents).
TEST(CudaAttentionOps, ForcedCudnnRefusesSegments) {
  ACCEL_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(8);
  Tensor q = random_tensor({2, 64, 2, 64}, DType::BF16, rng).to(gpu());
  Tensor out = poisoned({2, 64, 2, 64}, DType::BF16), lse = poisoned({2, 2, 64}, DType::F32);
  const AttentionMask mask{true, 0, documents_for(2, 64).to(gpu())};
  cuda::set_attention_impl("cudnn");
  try {
    cuda_backend().attention(out, lse, q, q, q, mask, 0.125);
    ADD_FAILURE() << "cuDNN accepted segment_ids";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("segment_ids"), std::string::npos) << e.what();
  }
  cuda::set_attention_impl("auto");
}
#endif

// Packed documents on the GPU: the packed row's output and gradients equal, document by
// document, those of attention over each document alone (through the ops layer, every kernel).
TEST(CudaAttentionOps, DocumentsEqualEachAlone) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> lengths{1, 70, 3, 129, 64, 33};
  const int64_t S = 300;
  std::vector<int64_t> ids;
  for (size_t d = 0; d < lengths.size(); ++d) ids.insert(ids.end(), lengths[d], int64_t(d));
  const Tensor seg = Tensor::from_vector(ids, {1, S}, DType::I32).to(gpu());
  for (const char* impl : {"auto", "flash", "generic"})
    for (DType t : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(std::string(impl) + " " + dtype_name(t));
#ifdef ACCEL_WITH_CUDA
      cuda::set_attention_impl(impl);
#endif
      Tensor q = random_tensor({1, S, 4, 64}, t, rng).to(gpu());
      Tensor k = random_tensor({1, S, 2, 64}, t, rng).to(gpu());
      Tensor v = random_tensor({1, S, 2, 64}, t, rng).to(gpu());
      Tensor go = random_tensor({1, S, 4, 64}, t, rng).to(gpu());
      for (Tensor* x : {&q, &k, &v}) x->set_requires_grad(true);
      Tensor packed = attention(q, k, v, AttentionMask{true, 0, seg});
      packed.backward(go);
      int64_t start = 0;
      for (int64_t len : lengths) {
        SCOPED_TRACE("document at " + std::to_string(start));
        auto part = [&](const Tensor& x) { return contiguous(narrow(x.detach(), 1, start, len)); };
        std::vector<Tensor> doc{part(q), part(k), part(v)};
        for (Tensor& x : doc) x.set_requires_grad(true);
        Tensor alone = attention(doc[0], doc[1], doc[2]);
        alone.backward(part(go));
        // Against each tensor's scale over all documents (a 1-position document's gradients
        // are zero alone, rounding noise when packed). 16-bit: under "auto" the documents alone
        // run on cuDNN and the packed row on ours, so both sides carry rounding (twice the
        // one-sided bound of ForwardAndBackwardMatchCpu); crossing a boundary is an O(1) change.
        const double r = t == DType::F32 ? 1e-4 : 6e-2;
        auto same = [&](const Tensor& packed_part, const Tensor& whole, const Tensor& alone_x,
                        const char* what) {
          expect_close(packed_part.to(Device::cpu()), alone_x.to(Device::cpu()), r,
                       r * rms(whole.to(Device::cpu())), what);
        };
        same(part(packed), packed, alone, "out");
        same(part(q.grad()), q.grad(), doc[0].grad(), "dq");
        same(part(k.grad()), k.grad(), doc[1].grad(), "dk");
        same(part(v.grad()), v.grad(), doc[2].grad(), "dv");
        start += len;
      }
    }
#ifdef ACCEL_WITH_CUDA
  cuda::set_attention_impl("auto");
#endif
}

TEST(CudaAttentionOps, AutogradThroughOpsLayer) {
  ACCEL_SKIP_WITHOUT_CUDA();
  uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  Tensor q = random_tensor({1, 20, 2, 32}, DType::F32, rng);
  Tensor k = random_tensor({1, 20, 1, 32}, DType::F32, rng);
  Tensor v = random_tensor({1, 20, 1, 32}, DType::F32, rng);
  Tensor want = attention(q, k, v);
  Tensor got = attention(q.to(gpu()), k.to(gpu()), v.to(gpu()));
  expect_matches(got, want, DType::F32, "attention op", 2.0);
}

}  // namespace
}  // namespace accel
