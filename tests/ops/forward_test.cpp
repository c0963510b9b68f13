// Forward values against straightforward float64 references written here, in f64 (tight) and in
// f32 / bf16 / f16 / fp8 (loose, or bit-exact where the rounding is specified), plus integer ops.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "op_test_util.h"
#include "ops/backend.h"

namespace accel {
namespace {
using test::expect_close;
using test::randn;

std::vector<double> naive_softmax_rows(const std::vector<double>& x, int64_t rows, int64_t d,
                                       bool log) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < d; ++j) m = std::max(m, x[r * d + j]);
    for (int64_t j = 0; j < d; ++j) s += std::exp(x[r * d + j] - m);
    for (int64_t j = 0; j < d; ++j)
      out[r * d + j] = log ? x[r * d + j] - m - std::log(s) : std::exp(x[r * d + j] - m) / s;
  }
  return out;
}

// Which keys query i sees, written straight from ops.h's definition of AttentionMask (segment ids
// as a std::vector [B, S], empty for none).
bool naive_sees(const AttentionMask& mask, const std::vector<int32_t>& seg, int64_t S, int64_t b,
                int64_t i, int64_t j) {
  if (!mask.causal) return true;
  if (j > i) return false;
  if (mask.window > 0 && j <= i - mask.window) return false;
  if (!seg.empty())  // one document: the same id at every position from j to i
    for (int64_t t = j; t < i; ++t)
      if (seg[b * S + t] != seg[b * S + t + 1]) return false;
  return true;
}

// Naive attention with the full S x S score matrix; also returns lse [B, Hq, S].
void naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, int64_t B, int64_t S, int64_t Hq, int64_t Hkv,
                     int64_t D, const AttentionMask& mask, double scale, std::vector<double>& out,
                     std::vector<double>& lse) {
  std::vector<int32_t> seg;
  if (mask.segment_ids.defined())
    for (double x : mask.segment_ids.to_vector()) seg.push_back(static_cast<int32_t>(x));
  out.assign(B * S * Hq * D, 0.0);
  lse.assign(B * Hq * S, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      std::vector<double> scores(S * S, -INFINITY);
      for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < S; ++j) {
          if (!naive_sees(mask, seg, S, b, i, j)) continue;
          double s = 0;
          for (int64_t c = 0; c < D; ++c)
            s += q[((b * S + i) * Hq + h) * D + c] * k[((b * S + j) * Hkv + hk) * D + c];
          scores[i * S + j] = s * scale;
        }
      std::vector<double> p = naive_softmax_rows(scores, S, S, false);
      for (int64_t i = 0; i < S; ++i) {
        double m = -INFINITY, l = 0;
        for (int64_t j = 0; j < S; ++j) m = std::max(m, scores[i * S + j]);
        for (int64_t j = 0; j < S; ++j) l += std::exp(scores[i * S + j] - m);
        lse[(b * Hq + h) * S + i] = m + std::log(l);
        for (int64_t j = 0; j < S; ++j)
          for (int64_t c = 0; c < D; ++c)
            out[((b * S + i) * Hq + h) * D + c] +=
                p[i * S + j] * v[((b * S + j) * Hkv + hk) * D + c];
      }
    }
}

Tensor segments(const std::vector<int64_t>& ids, const Shape& shape) {
  return test::ids_tensor(ids, shape, DType::I32);
}

// The masks the attention tests run, for B = 2, S = 7: causal, full, windows shorter than S, of
// 1 and longer than S, documents of ragged lengths (1 included; row 1 reuses id 5 in two runs),
// and a window inside documents.
std::vector<std::pair<std::string, AttentionMask>> test_masks() {
  const Tensor seg = segments({0, 0, 0, 1, 2, 2, 2, 5, 5, 3, 3, 3, 3, 5}, {2, 7});
  return {{"causal", {true, 0, {}}},
          {"full", {false, 0, {}}},
          {"window 3", {true, 3, {}}},
          {"window 1", {true, 1, {}}},
          {"window 9 > S", {true, 9, {}}},
          {"segments", {true, 0, seg}},
          {"window 2 + segments", {true, 2, seg}}};
}

TEST(Forward, AttentionMatchesNaiveF64AndF32) {
  const int64_t B = 2, S = 7, Hq = 6, Hkv = 2, D = 5;
  Tensor q = randn({B, S, Hq, D}, 1), k = randn({B, S, Hkv, D}, 2), v = randn({B, S, Hkv, D}, 3);
  for (const auto& [name, mask] : test_masks()) {
    SCOPED_TRACE(name);
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> ref_out, ref_lse;
    naive_attention(q.to_vector(), k.to_vector(), v.to_vector(), B, S, Hq, Hkv, D, mask, scale,
                    ref_out, ref_lse);
    expect_close(attention(q, k, v, mask), ref_out, 1e-12, 1e-12, "f64 out");
    // The backend's saved lse, at f64 precision when asked for.
    Tensor out = Tensor::empty(q.shape(), DType::F64), lse = Tensor::empty({B, Hq, S}, DType::F64);
    cpu_backend().attention(out, lse, q, k, v, mask, scale);
    expect_close(lse, ref_lse, 1e-12, 1e-12, "f64 lse");
    Tensor lse32 = Tensor::empty({B, Hq, S}, DType::F32);
    Tensor out32 = Tensor::empty(q.shape(), DType::F32);
    cpu_backend().attention(out32, lse32, cast(q, DType::F32), cast(k, DType::F32),
                            cast(v, DType::F32), mask, scale);
    expect_close(out32, ref_out, 1e-5, 1e-5, "f32 out");
    expect_close(lse32, ref_lse, 1e-5, 1e-5, "f32 lse");
    Tensor outbf =
        attention(cast(q, DType::BF16), cast(k, DType::BF16), cast(v, DType::BF16), mask);
    EXPECT_EQ(outbf.dtype(), DType::BF16);
    expect_close(outbf, ref_out, 3e-2, 3e-2, "bf16 out");
  }
}

TEST(Forward, AttentionMasksChangeTheResult) {
  // Guards the test above against masks that are silently ignored: each mask's output differs
  // from plain causal attention's.
  Tensor q = randn({2, 7, 2, 4}, 11), k = randn({2, 7, 1, 4}, 12), v = randn({2, 7, 1, 4}, 13);
  const std::vector<double> causal = attention(q, k, v).to_vector();
  for (const auto& [name, mask] : test_masks()) {
    if (name == "causal" || name == "window 9 > S") continue;
    const std::vector<double> got = attention(q, k, v, mask).to_vector();
    double diff = 0;
    for (size_t i = 0; i < got.size(); ++i) diff = std::max(diff, std::abs(got[i] - causal[i]));
    EXPECT_GT(diff, 1e-3) << name;
  }
}

// Packed documents: attention over the packed row (segment ids) gives, for every document, the
// output and the gradients that attention over that document alone gives.
TEST(Forward, AttentionDocumentsEqualEachAlone) {
  const std::vector<int64_t> lengths{3, 1, 5, 2};
  const int64_t S = 11, Hq = 4, Hkv = 2, D = 6;
  std::vector<int64_t> ids;
  for (size_t d = 0; d < lengths.size(); ++d) ids.insert(ids.end(), lengths[d], int64_t(d) + 7);
  const Tensor seg = segments(ids, {1, S});
  for (int64_t window : {0, 2}) {
    SCOPED_TRACE("window " + std::to_string(window));
    Tensor q = randn({1, S, Hq, D}, 21), k = randn({1, S, Hkv, D}, 22),
           v = randn({1, S, Hkv, D}, 23);
    Tensor go = randn({1, S, Hq, D}, 24);
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
    Tensor packed = attention(q, k, v, AttentionMask{true, window, seg});
    packed.backward(go);
    int64_t start = 0;
    for (int64_t len : lengths) {
      SCOPED_TRACE("document at " + std::to_string(start));
      auto part = [&](const Tensor& t) { return contiguous(narrow(t.detach(), 1, start, len)); };
      std::vector<Tensor> doc{part(q), part(k), part(v)};
      for (Tensor& t : doc) t.set_requires_grad(true);
      Tensor alone = attention(doc[0], doc[1], doc[2], AttentionMask{true, window, {}});
      alone.backward(part(go));
      expect_close(part(packed), alone, 1e-13, 1e-13, "out");
      expect_close(part(q.grad()), doc[0].grad(), 1e-12, 1e-13, "dq");
      expect_close(part(k.grad()), doc[1].grad(), 1e-12, 1e-13, "dk");
      expect_close(part(v.grad()), doc[2].grad(), 1e-12, 1e-13, "dv");
      start += len;
    }
  }
}

TEST(Forward, AttentionBackwardF32MatchesF64) {
  const int64_t B = 2, S = 7, Hq = 4, Hkv = 1, D = 8;
  Tensor q = randn({B, S, Hq, D}, 4), k = randn({B, S, Hkv, D}, 5), v = randn({B, S, Hkv, D}, 6);
  Tensor go = randn({B, S, Hq, D}, 7);
  for (const auto& [name, mask] : test_masks()) {
    SCOPED_TRACE(name);
    std::vector<Tensor> g64, g32;
    for (DType dt : {DType::F64, DType::F32}) {
      Tensor qq = cast(q, dt).detach(), kk = cast(k, dt).detach(), vv = cast(v, dt).detach();
      qq.set_requires_grad(true);
      kk.set_requires_grad(true);
      vv.set_requires_grad(true);
      attention(qq, kk, vv, mask).backward(cast(go, dt));
      auto& dst = dt == DType::F64 ? g64 : g32;
      dst = {qq.grad(), kk.grad(), vv.grad()};
    }
    for (int i = 0; i < 3; ++i)
      expect_close(g32[i], g64[i], 1e-4, 1e-5, "grad " + std::to_string(i));
  }
}

TEST(Forward, SoftmaxAndLogSoftmax) {
  Tensor x = randn({4, 9}, 8, DType::F64, 3.0);
  auto ref = naive_softmax_rows(x.to_vector(), 4, 9, false);
  auto ref_log = naive_softmax_rows(x.to_vector(), 4, 9, true);
  expect_close(softmax(x, -1), ref, 1e-14, 1e-15);
  expect_close(log_softmax(x, -1), ref_log, 1e-13, 1e-13);
  expect_close(softmax(cast(x, DType::F32), -1), ref, 1e-6, 1e-7);
  expect_close(softmax(cast(x, DType::BF16), -1), ref, 1e-2, 1e-2);
  // Large logits do not overflow.
  Tensor big = Tensor::from_vector(std::vector<double>{1000, 1001, 1002}, {1, 3}, DType::F32);
  expect_close(softmax(big, -1), naive_softmax_rows({1000, 1001, 1002}, 1, 3, false), 1e-6, 1e-7);
}

TEST(Forward, CrossEntropyMeanOverCountedRows) {
  const int64_t N = 5, Vc = 6;
  Tensor logits = randn({N, Vc}, 9, DType::F64, 2.0);
  std::vector<int64_t> t = {2, -1, 5, 0, -1};
  auto lsm = naive_softmax_rows(logits.to_vector(), N, Vc, true);
  double total = 0;
  int counted = 0;
  for (int64_t i = 0; i < N; ++i)
    if (t[i] != -1) {
      total -= lsm[i * Vc + t[i]];
      ++counted;
    }
  Tensor targets = test::ids_tensor(t, {N});
  EXPECT_NEAR(cross_entropy(logits, targets, -1).item(), total / counted, 1e-13);
  EXPECT_NEAR(cross_entropy(cast(logits, DType::F32), targets, -1).item(), total / counted, 1e-5);
  Tensor bf = cross_entropy(cast(logits, DType::BF16), targets, -1);
  EXPECT_EQ(bf.dtype(), DType::F32);  // 16-bit logits give an f32 loss
  EXPECT_NEAR(bf.item(), total / counted, 5e-2);

  // Backend: per-row losses and log-sum-exps, 0 loss and 0 gradient on ignored rows, gradient
  // (softmax - onehot) * scale from the saved lse.
  Tensor loss_rows = Tensor::empty({N}, DType::F64), lse = Tensor::empty({N}, DType::F64);
  Tensor grad = Tensor::empty({N, Vc}, DType::F64);
  cpu_backend().cross_entropy(loss_rows, lse, logits, targets, -1);
  cpu_backend().cross_entropy_backward(grad, logits, lse, targets, -1,
                                       Tensor::full({1}, 0.5, DType::F64));
  auto sm = naive_softmax_rows(logits.to_vector(), N, Vc, false);
  auto lr = loss_rows.to_vector();
  auto lv = lse.to_vector();
  auto lx = logits.to_vector();
  auto gv = grad.to_vector();
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_NEAR(lr[i], t[i] == -1 ? 0.0 : -lsm[i * Vc + t[i]], 1e-13);
    if (t[i] != -1) {
      EXPECT_NEAR(lv[i], lx[i * Vc] - lsm[i * Vc], 1e-13);  // lse = x - log_softmax(x)
    }
    for (int64_t j = 0; j < Vc; ++j) {
      double expect = t[i] == -1 ? 0.0 : 0.5 * (sm[i * Vc + j] - (j == t[i] ? 1.0 : 0.0));
      EXPECT_NEAR(gv[i * Vc + j], expect, 1e-14);
    }
  }
  // Both in one call, into a separate buffer and over the logits themselves: the same numbers.
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "in place" : "separate");
    Tensor l2 = Tensor::empty({N}, DType::F64), lse2 = Tensor::empty({N}, DType::F64);
    Tensor x2 = logits.clone();
    Tensor g2 = in_place ? x2 : Tensor::empty({N, Vc}, DType::F64);
    cpu_backend().cross_entropy_with_grad(l2, lse2, g2, x2, targets, -1,
                                          Tensor::full({1}, 0.5, DType::F64));
    EXPECT_EQ(l2.to_vector(), lr);
    EXPECT_EQ(lse2.to_vector(), lv);
    EXPECT_EQ(g2.to_vector(), gv);
  }
}

TEST(Forward, RmsNormMatchesReference) {
  const int64_t rows = 3, D = 16;
  Tensor x = randn({rows, D}, 10), w = randn({D}, 11, DType::F64, 0.2, 1.0);
  auto xv = x.to_vector(), wv = w.to_vector();
  std::vector<double> ref(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < D; ++j) ms += xv[r * D + j] * xv[r * D + j] / D;
    for (int64_t j = 0; j < D; ++j) ref[r * D + j] = xv[r * D + j] / std::sqrt(ms + 1e-6) * wv[j];
  }
  expect_close(rms_norm(x, w, 1e-6), ref, 1e-14, 1e-14, "f64");
  expect_close(rms_norm(cast(x, DType::F32), cast(w, DType::F32), 1e-6), ref, 1e-6, 1e-6, "f32");
  expect_close(rms_norm(cast(x, DType::BF16), cast(w, DType::BF16), 1e-6), ref, 2e-2, 2e-2, "bf16");
}

TEST(Forward, RmsNormBf16RoundsLikeHuggingFace) {
  // HF: weight * (x * rstd).to(bf16): the normalized value is rounded before the weight multiply.
  Tensor x = cast(randn({2, 8}, 12), DType::BF16), w = cast(randn({8}, 13), DType::BF16);
  auto xv = x.to_vector(), wv = w.to_vector();
  auto out = rms_norm(x, w, 1e-5).to_vector();
  for (int r = 0; r < 2; ++r) {
    double ss = 0;  // exact for bf16 inputs
    for (int j = 0; j < 8; ++j) ss += xv[r * 8 + j] * xv[r * 8 + j];
    float rstd = 1.0f / std::sqrt(float(ss / 8.0) + 1e-5f);
    for (int j = 0; j < 8; ++j) {
      float normed = bf16_to_f32(f32_to_bf16(float(xv[r * 8 + j]) * rstd));
      float expect = bf16_to_f32(f32_to_bf16(float(wv[j]) * normed));
      EXPECT_EQ(out[r * 8 + j], expect) << r << "," << j;
    }
  }
}

// The reference rotation of x [B, S, H, D] (f64) by inv_freq at positions pos[b][s], cos and sin
// times `scale`, all in double.
std::vector<double> rope_reference(const Tensor& x, const std::vector<float>& inv_freq,
                                   const std::vector<std::vector<int64_t>>& pos, double scale) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  auto xv = x.to_vector();
  std::vector<double> ref(xv.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D / 2; ++i) {
          const double ang = double(pos[b][s]) * double(inv_freq[i]);
          const int64_t base = ((b * S + s) * H + h) * D;
          const double x1 = xv[base + i], x2 = xv[base + i + D / 2];
          const double c = std::cos(ang) * scale, sn = std::sin(ang) * scale;
          ref[base + i] = x1 * c - x2 * sn;
          ref[base + i + D / 2] = x2 * c + x1 * sn;
        }
  return ref;
}

TEST(Forward, RopeRotateHalfConvention) {
  const int64_t B = 2, S = 5, H = 2, D = 6;
  const int64_t offset = 3;
  const RopeFrequencies f = default_rope_frequencies(10000.0, D);
  ASSERT_EQ(f.inv_freq.size(), 3u);
  EXPECT_EQ(f.inv_freq[0], 1.0f);
  EXPECT_EQ(f.inv_freq[1], 1.0f / std::pow(10000.0f, 2.0f / 6.0f));
  Tensor x = randn({B, S, H, D}, 14);
  std::vector<std::vector<int64_t>> pos(B);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) pos[b].push_back(s + offset);
  const std::vector<double> ref = rope_reference(x, f.inv_freq, pos, 1.0);
  expect_close(rope(x, f, offset), ref, 1e-13, 1e-13, "f64");
  expect_close(rope(cast(x, DType::F32), f, offset), ref, 1e-5, 1e-5, "f32");
  // inverse=true undoes the rotation.
  Tensor y = rope(x, f, offset), back = Tensor::empty(x.shape(), DType::F64);
  cpu_backend().rope(back, y, f, offset, Tensor(), true);
  expect_close(back, x, 1e-13, 1e-13, "inverse");
}

TEST(Forward, RopePerTokenPositionsAndAttentionScaling) {
  // Packed rows: each document's positions restart at 0 (row 0: 0 1 2 0 1, row 1: 4 5 6 7 0),
  // with YaRN-style scaled cos/sin and non-default frequencies.
  const int64_t B = 2, S = 5, H = 3, D = 8;
  RopeFrequencies f;
  f.inv_freq = {1.0f, 0.3f, 0.05f, 0.001f};
  f.attention_scaling = 1.1386;
  const std::vector<std::vector<int64_t>> pos = {{0, 1, 2, 0, 1}, {4, 5, 6, 7, 0}};
  std::vector<int64_t> flat;
  for (const auto& row : pos) flat.insert(flat.end(), row.begin(), row.end());
  Tensor x = randn({B, S, H, D}, 16);
  const std::vector<double> ref = rope_reference(x, f.inv_freq, pos, f.attention_scaling);
  for (DType idt : {DType::I64, DType::I32}) {
    Tensor ids = Tensor::from_vector(flat, {B, S}, idt);
    expect_close(rope(x, f, 0, ids), ref, 1e-13, 1e-13, "f64 position_ids");
    expect_close(rope(cast(x, DType::F32), f, 0, ids), ref, 1e-5, 1e-5, "f32 position_ids");
  }
  // position_ids equal to offset + s give the offset's result bit for bit.
  std::vector<int64_t> seq;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) seq.push_back(s + 9);
  Tensor xf = cast(x, DType::F32);
  EXPECT_EQ(rope(xf, f, 0, Tensor::from_vector(seq, {B, S}, DType::I64)).to_vector(),
            rope(xf, f, 9).to_vector());
  // The backward is the transposed (scaled) rotation: <rope(x), g> == <x, rope^T(g)>.
  Tensor g = randn({B, S, H, D}, 17), gt = Tensor::empty(g.shape(), DType::F64);
  Tensor ids = Tensor::from_vector(flat, {B, S}, DType::I64);
  cpu_backend().rope(gt, g, f, 0, ids, true);
  auto yv = rope(x, f, 0, ids).to_vector(), gv = g.to_vector(), xv = x.to_vector(),
       gtv = gt.to_vector();
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < yv.size(); ++i) lhs += yv[i] * gv[i], rhs += xv[i] * gtv[i];
  EXPECT_NEAR(lhs, rhs, 1e-12 * std::abs(lhs));
}

TEST(Forward, RopeF32MatchesHuggingFaceFloat32AtLargePositions) {
  // HF computes inv_freq, angles and cos/sin in float32; at position 4000 that differs from the
  // double-precision angle by far more than 1e-5, so f32 rope must follow the float32 recipe.
  const int64_t D = 8;
  const double theta = 500000.0;
  Tensor x = randn({1, 2, 1, D}, 15, DType::F32);
  auto xv = x.to_vector();
  auto out = rope(x, default_rope_frequencies(theta, D), 4000).to_vector();
  for (int64_t s = 0; s < 2; ++s)
    for (int64_t i = 0; i < D / 2; ++i) {
      float inv = 1.0f / std::pow(float(theta), float(2 * i) / float(D));
      float ang = float(4000 + s) * inv;
      float c = std::cos(ang), sn = std::sin(ang);
      float x1 = float(xv[s * D + i]), x2 = float(xv[s * D + i + D / 2]);
      EXPECT_NEAR(out[s * D + i], x1 * c - x2 * sn, 1e-6);
      EXPECT_NEAR(out[s * D + i + D / 2], x2 * c + x1 * sn, 1e-6);
    }
}

TEST(Forward, GeluSiluSwigluValues) {
  Tensor x = Tensor::from_vector(std::vector<double>{-3, -1, 0, 0.5, 1, 2.5}, {6}, DType::F64);
  std::vector<double> gelu_ref, silu_ref;
  for (double v : x.to_vector()) {
    gelu_ref.push_back(0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
    silu_ref.push_back(v / (1 + std::exp(-v)));
  }
  expect_close(gelu(x), gelu_ref, 1e-15, 1e-15, "gelu");
  EXPECT_NEAR(gelu(x).to_vector()[4], 0.8411919906082768, 1e-15);  // gelu_pytorch_tanh(1)
  expect_close(silu(x), silu_ref, 1e-15, 1e-15, "silu");
  Tensor up = randn({6}, 16);
  std::vector<double> sw;
  for (int i = 0; i < 6; ++i) sw.push_back(silu_ref[i] * up.to_vector()[i]);
  expect_close(swiglu(x, up), sw, 1e-15, 1e-15, "swiglu");
  expect_close(gelu(cast(x, DType::F32)), gelu_ref, 1e-6, 1e-7, "gelu f32");
}

TEST(Forward, MatmulAllFloatDtypes) {
  Tensor a = randn({2, 3, 5}, 17), b = randn({5, 4}, 18);
  auto av = a.to_vector(), bv = b.to_vector();
  std::vector<double> ref(2 * 3 * 4, 0.0);
  for (int n = 0; n < 2; ++n)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j)
        for (int k = 0; k < 5; ++k)
          ref[(n * 3 + i) * 4 + j] += av[(n * 3 + i) * 5 + k] * bv[k * 4 + j];
  expect_close(matmul(a, b), ref, 1e-14, 1e-14, "f64");
  expect_close(matmul(cast(a, DType::F32), cast(b, DType::F32)), ref, 1e-5, 1e-5, "f32");
  expect_close(matmul(cast(a, DType::BF16), cast(b, DType::BF16)), ref, 3e-2, 5e-2, "bf16");
  expect_close(matmul(cast(a, DType::F16), cast(b, DType::F16)), ref, 3e-3, 5e-3, "f16");
  // fp8 operands: the product of the decoded values, rounded once to e4m3.
  Tensor a8 = cast(a, DType::E4M3), b8 = cast(b, DType::E4M3);
  Tensor ref8 = cast(matmul(cast(a8, DType::F64), cast(b8, DType::F64)), DType::E4M3);
  expect_close(matmul(a8, b8), ref8, 0, 0, "e4m3");
  // Transposed operands, alpha and beta, directly on the backend.
  Tensor at = randn({1, 5, 3}, 19), bt = randn({1, 4, 5}, 20);
  Tensor out = randn({1, 3, 4}, 21);
  auto ov = out.to_vector(), atv = at.to_vector(), btv = bt.to_vector();
  cpu_backend().matmul(out, at, bt, true, true, 2.0, 0.5, Tensor());
  std::vector<double> ref2(12);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) {
      double s = 0;
      for (int k = 0; k < 5; ++k) s += atv[k * 3 + i] * btv[j * 5 + k];
      ref2[i * 4 + j] = 2.0 * s + 0.5 * ov[i * 4 + j];
    }
  expect_close(out, ref2, 1e-14, 1e-14, "alpha beta transposed");
}

TEST(Forward, LargeOpsUseThreadsAndStayCorrect) {
  // Big enough to take the parallel paths of elementwise, reductions and GEMM.
  Tensor a = randn({300, 257}, 22, DType::F32), b = randn({257}, 23, DType::F32);
  auto av = a.to_vector(), bv = b.to_vector();
  auto sum_ab = add(a, b).to_vector();
  for (int i = 0; i < 300; ++i)
    for (int j = 0; j < 257; ++j)
      ASSERT_FLOAT_EQ(sum_ab[i * 257 + j], float(av[i * 257 + j]) + float(bv[j]));
  double total = 0;
  for (double v : av) total += v;
  EXPECT_NEAR(sum(a).item(), total, 1e-3);
  auto col = sum(a, {0}).to_vector();
  double c0 = 0;
  for (int i = 0; i < 300; ++i) c0 += av[i * 257];
  EXPECT_NEAR(col[0], c0, 1e-4);
  Tensor m = matmul(a, transpose(a, 0, 1));
  auto mv = m.to_vector();
  double d00 = 0;
  for (int j = 0; j < 257; ++j) d00 += av[j] * av[j];
  EXPECT_NEAR(mv[0], d00, 1e-3);
}

TEST(Forward, ReductionsOverStridedAndIntegerInputs) {
  Tensor x = randn({3, 4, 5}, 24);
  Tensor xt = permute(x, {2, 0, 1});  // [5, 3, 4], strided
  auto xv = x.to_vector();
  auto s = sum(xt, {0, 2}).to_vector();  // over original dims 2 and 1 -> [3]
  for (int i = 0; i < 3; ++i) {
    double ref = 0;
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 5; ++k) ref += xv[(i * 4 + j) * 5 + k];
    EXPECT_NEAR(s[i], ref, 1e-13);
  }
  auto mx = max(xt, 2).to_vector();  // [5, 3]: max over original dim 1
  auto am = amax(xt, {0}).to_vector();
  for (int k = 0; k < 5; ++k)
    for (int i = 0; i < 3; ++i) {
      double ref = -INFINITY;
      for (int j = 0; j < 4; ++j) ref = std::max(ref, xv[(i * 4 + j) * 5 + k]);
      EXPECT_EQ(mx[k * 3 + i], ref);
    }
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) {
      double ref = 0;
      for (int k = 0; k < 5; ++k) ref = std::max(ref, std::abs(xv[(i * 4 + j) * 5 + k]));
      EXPECT_EQ(am[i * 4 + j], ref);
    }
  Tensor ints = Tensor::from_vector(std::vector<int64_t>{1, -2, 3, 4, 5, 6}, {2, 3}, DType::I32);
  EXPECT_EQ(sum(ints).to_vector(), std::vector<double>{17});
  EXPECT_EQ(sum(ints, {1}).to_vector(), (std::vector<double>{2, 15}));
  EXPECT_EQ(max(ints, 0).to_vector(), (std::vector<double>{4, 5, 6}));
  // mean of an empty dim is 0-safe; sum of empty is 0.
  EXPECT_EQ(sum(Tensor::zeros({0, 3})).item(), 0.0);
  // NaN propagates through max.
  Tensor withnan = Tensor::from_vector(std::vector<double>{1, NAN, 3}, {3}, DType::F32);
  EXPECT_TRUE(std::isnan(max(withnan, 0).item()));
}

TEST(Forward, IntegerAndComparisonElementwise) {
  for (DType dt : {DType::I32, DType::I64}) {
    Tensor a = Tensor::from_vector(std::vector<int64_t>{1, -2, 30, 7}, {2, 2}, dt);
    Tensor b = Tensor::from_vector(std::vector<int64_t>{5, -1}, {2}, dt);
    EXPECT_EQ(add(a, b).to_vector(), (std::vector<double>{6, -3, 35, 6}));
    EXPECT_EQ(sub(a, b).to_vector(), (std::vector<double>{-4, -1, 25, 8}));
    EXPECT_EQ(mul(a, b).to_vector(), (std::vector<double>{5, 2, 150, -7}));
    EXPECT_EQ(maximum(a, b).to_vector(), (std::vector<double>{5, -1, 30, 7}));
    EXPECT_EQ(add(a, 2.0).to_vector(), (std::vector<double>{3, 0, 32, 9}));
    EXPECT_EQ(neg(a).to_vector(), (std::vector<double>{-1, 2, -30, -7}));
    Tensor gt = greater(a, b), eq = equal(a, a);
    EXPECT_EQ(gt.dtype(), DType::Bool);
    EXPECT_EQ(gt.to_vector(), (std::vector<double>{0, 0, 1, 1}));
    EXPECT_EQ(eq.to_vector(), (std::vector<double>{1, 1, 1, 1}));
    EXPECT_EQ(where(gt, a, b).to_vector(), (std::vector<double>{5, -1, 30, 7}));
  }
}

TEST(Forward, SixteenBitElementwiseRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even gives 1.
  Tensor one = Tensor::full({1}, 1.0, DType::BF16);
  Tensor tiny = Tensor::full({1}, std::ldexp(1.0, -8), DType::BF16);
  EXPECT_EQ(add(one, tiny).item(), 1.0);
  Tensor three = Tensor::full({1}, 3 * std::ldexp(1.0, -8), DType::BF16);
  EXPECT_EQ(add(one, three).item(), 1.0 + std::ldexp(1.0, -6));
  // f16 and fp8 compute in float and round once.
  Tensor h = Tensor::full({1}, 1.0, DType::F16);
  EXPECT_EQ(add(h, Tensor::full({1}, std::ldexp(1.0, -11), DType::F16)).item(), 1.0);
  Tensor e = Tensor::full({1}, 448.0, DType::E4M3);
  EXPECT_EQ(mul(e, 2.0).item(), 448.0);  // fp8 saturates
  EXPECT_EQ(exp(Tensor::full({1}, 1.0, DType::BF16)).item(),
            double(bf16_to_f32(f32_to_bf16(std::exp(1.0f)))));
}

TEST(Forward, BroadcastStrideZeroViews) {
  Tensor a = randn({4, 1, 3}, 25), b = randn({5, 1}, 26);
  Tensor c = add(a, b);
  ASSERT_EQ(c.shape(), (Shape{4, 5, 3}));
  auto av = a.to_vector(), bv = b.to_vector(), cv = c.to_vector();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j)
      for (int k = 0; k < 3; ++k) EXPECT_EQ(cv[(i * 5 + j) * 3 + k], av[i * 3 + k] + bv[j]);
}

TEST(Forward, EmbeddingGathersRows) {
  Tensor w = randn({5, 3}, 27, DType::BF16);
  Tensor ids = test::ids_tensor({4, 0, 4}, {3}, DType::I32);
  auto wv = w.to_vector(), ev = embedding(w, ids).to_vector();
  std::vector<double> ref;
  for (int id : {4, 0, 4})
    for (int j = 0; j < 3; ++j) ref.push_back(wv[id * 3 + j]);
  EXPECT_EQ(ev, ref);
}

TEST(Forward, MaxBackwardPicksFirstArgmax) {
  Tensor x = Tensor::from_vector(std::vector<double>{2, 5, 5, 1}, {1, 4}, DType::F64);
  x.set_requires_grad(true);
  max(x, 1).backward(Tensor::full({1}, 3.0, DType::F64));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0, 3, 0, 0}));
}

}  // namespace
}  // namespace accel
