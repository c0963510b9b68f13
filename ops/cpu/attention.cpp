// Scaled-dot-product attention with grouped KV heads, one query row at a time (memory O(S), never
// S x S). The forward saves the log-sum-exp of each row; the backward recomputes the probabilities
// row by row from it (flash-attention's backward):
//   P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
//   dQ = dS K * scale, dK = dS^T Q * scale.
// Math is in float (double for f64 tensors); 16-bit inputs are widened once up front. Every mask
// (causal, sliding window, documents) leaves each query row one contiguous range of keys.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel {
namespace {
using namespace cpu;

template <class A>
constexpr DType native_dtype() {
  return std::is_same_v<A, double> ? DType::F64 : DType::F32;
}

// The tensor's data as A values: the tensor itself when its dtype is A, else a widened copy.
template <class A>
const A* input_ptr(const Tensor& t, std::vector<A>& own) {
  if (t.dtype() == native_dtype<A>()) return static_cast<const A*>(t.data_ptr());
  own = load_as<A>(t);
  return own.data();
}

// Where to write A results for `t`: in place when its dtype is A, else a scratch buffer that
// finish_output rounds into t.
template <class A>
A* output_ptr(const Tensor& t, std::vector<A>& own) {
  if (t.dtype() == native_dtype<A>()) return static_cast<A*>(t.data_ptr());
  own.assign(static_cast<size_t>(t.numel()), A(0));
  return own.data();
}

template <class A>
void finish_output(const Tensor& t, const std::vector<A>& own) {
  if (t.dtype() != native_dtype<A>()) store_from(t, own);
}

struct AttnShape {
  int64_t b, sq, sk, hq, hkv, d, group;
  int64_t q_index(int64_t bi, int64_t i, int64_t h) const { return ((bi * sq + i) * hq + h) * d; }
  int64_t kv_index(int64_t bi, int64_t j, int64_t h) const { return ((bi * sk + j) * hkv + h) * d; }
};

// The keys [lo, hi) each query row sees: every mask here leaves one contiguous range.
struct KeyRanges {
  const AttnShape& s;
  bool causal;
  int64_t window;
  std::vector<int64_t> run_start;  // [B, S]: where the document holding position i begins

  KeyRanges(const AttnShape& shape, const AttentionMask& mask)
      : s(shape), causal(mask.causal), window(mask.window) {
    if (!mask.segment_ids.defined()) return;
    const int32_t* seg = static_cast<const int32_t*>(mask.segment_ids.data_ptr());
    run_start.resize(static_cast<size_t>(s.b * s.sq));
    for (int64_t bi = 0; bi < s.b; ++bi)
      for (int64_t i = 0; i < s.sq; ++i) {
        const int64_t r = bi * s.sq + i;
        run_start[r] = i > 0 && seg[r] == seg[r - 1] ? run_start[r - 1] : i;
      }
  }
  std::pair<int64_t, int64_t> operator()(int64_t bi, int64_t i) const {
    if (!causal) return {0, s.sk};
    const int64_t pos = i + (s.sk - s.sq);  // bottom-right aligned when sk != sq
    const int64_t hi = std::clamp<int64_t>(pos + 1, 0, s.sk);
    int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    if (!run_start.empty()) lo = std::max(lo, run_start[bi * s.sq + i]);
    return {std::min(lo, hi), hi};
  }
};

AttnShape check_shapes(const char* op, const Tensor& out, const Tensor& lse, const Tensor& q,
                       const Tensor& k, const Tensor& v, const AttentionMask& mask) {
  if (q.dim() != 4 || k.dim() != 4 || k.shape() != v.shape() || q.shape()[0] != k.shape()[0] ||
      q.shape()[3] != k.shape()[3] || k.shape()[2] == 0 || q.shape()[2] % k.shape()[2] != 0 ||
      out.shape() != q.shape() || !q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous() ||
      !out.is_contiguous() || !lse.is_contiguous() ||
      lse.shape() != Shape{q.shape()[0], q.shape()[2], q.shape()[1]})
    throw std::logic_error(std::string("[") + op + "] CPU backend got q " + q.str() + ", k " +
                           k.str() + ", v " + v.str() + ", out " + out.str() + ", lse " +
                           lse.str());
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype() || out.dtype() != q.dtype())
    throw std::invalid_argument(std::string("[") + op + "] q, k, v and out must share a dtype");
  const Tensor& seg = mask.segment_ids;
  if (seg.defined() &&
      (seg.dtype() != DType::I32 || !seg.is_contiguous() || q.shape()[1] != k.shape()[1] ||
       seg.shape() != Shape{q.shape()[0], q.shape()[1]}))
    throw std::logic_error(std::string("[") + op + "] CPU backend got segment_ids " + seg.str() +
                           " for q " + q.str() + " and k " + k.str());
  AttnShape s;
  s.b = q.shape()[0];
  s.sq = q.shape()[1];
  s.hq = q.shape()[2];
  s.d = q.shape()[3];
  s.sk = k.shape()[1];
  s.hkv = k.shape()[2];
  s.group = s.hq / s.hkv;
  return s;
}

template <class A>
A dot(const A* a, const A* b, int64_t n) {
  A s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Scores of query row `qr` against keys [lo, hi) of kv head `hk` into out[0, hi - lo); returns
// the row max.
template <class A>
A scores(const AttnShape& s, const A* qr, const A* k, int64_t bi, int64_t hk, int64_t lo,
         int64_t hi, A scale, A* out) {
  A m = -std::numeric_limits<A>::infinity();
  for (int64_t j = lo; j < hi; ++j) {
    out[j - lo] = scale * dot(qr, k + s.kv_index(bi, j, hk), s.d);
    m = std::max(m, out[j - lo]);
  }
  return m;
}

template <class A, class TrL>
void attention_forward(const AttnShape& s, const Tensor& out, const Tensor& lse, const Tensor& q,
                       const Tensor& k, const Tensor& v, const KeyRanges& keys, A scale) {
  std::vector<A> q_own, k_own, v_own, o_own;
  const A* qp = input_ptr<A>(q, q_own);
  const A* kp = input_ptr<A>(k, k_own);
  const A* vp = input_ptr<A>(v, v_own);
  A* op = output_ptr<A>(out, o_own);
  auto* lp = ptr<TrL>(lse);
  const int64_t rows = s.b * s.hq * s.sq;  // lse order: [B, Hq, S]
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, s.sk * s.d));
  parallel_for(rows, grain, [&](int64_t rb, int64_t re) {
    std::vector<A> p(static_cast<size_t>(s.sk));
    for (int64_t r = rb; r < re; ++r) {
      const int64_t i = r % s.sq, h = (r / s.sq) % s.hq, bi = r / (s.sq * s.hq);
      const int64_t hk = h / s.group;
      const auto [lo, hi] = keys(bi, i);
      A* orow = op + s.q_index(bi, i, h);
      std::fill(orow, orow + s.d, A(0));
      if (lo == hi) {
        lp[r] = TrL::store(-std::numeric_limits<float>::infinity());
        continue;
      }
      const A m = scores(s, qp + s.q_index(bi, i, h), kp, bi, hk, lo, hi, scale, p.data());
      A l = 0;
      for (int64_t j = lo; j < hi; ++j) {
        const A pj = std::exp(p[j - lo] - m);
        l += pj;
        const A* vr = vp + s.kv_index(bi, j, hk);
        for (int64_t c = 0; c < s.d; ++c) orow[c] += pj * vr[c];
      }
      const A inv = A(1) / l;
      for (int64_t c = 0; c < s.d; ++c) orow[c] *= inv;
      lp[r] = TrL::store(static_cast<typename TrL::C>(m + std::log(l)));
    }
  });
  finish_output(out, o_own);
}

template <class A, class TrL>
void attention_backward_impl(const AttnShape& s, const Tensor& grad_q, const Tensor& grad_k,
                             const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             const KeyRanges& keys, A scale) {
  std::vector<A> q_own, k_own, v_own, o_own, do_own, dq_own, dk_own, dv_own;
  const A* qp = input_ptr<A>(q, q_own);
  const A* kp = input_ptr<A>(k, k_own);
  const A* vp = input_ptr<A>(v, v_own);
  const A* op = input_ptr<A>(out, o_own);
  const A* dop = input_ptr<A>(grad_out, do_own);
  A* dq = output_ptr<A>(grad_q, dq_own);
  A* dk = output_ptr<A>(grad_k, dk_own);
  A* dv = output_ptr<A>(grad_v, dv_own);
  const auto* lp = ptr<TrL>(lse);
  // A float32 lse is too coarse for f64 gradient checks: f64 recomputes it exactly.
  const bool recompute_lse = std::is_same_v<A, double> && lse.dtype() != DType::F64;
  // One task per (batch, kv head): it owns dK, dV of that head and dQ of the heads in its group.
  const int64_t tasks = s.b * s.hkv;
  parallel_for(tasks, 0, [&](int64_t tb, int64_t te) {
    std::vector<A> p(static_cast<size_t>(s.sk));
    for (int64_t t = tb; t < te; ++t) {
      const int64_t bi = t / s.hkv, hk = t % s.hkv;
      for (int64_t j = 0; j < s.sk; ++j) {
        std::fill(dk + s.kv_index(bi, j, hk), dk + s.kv_index(bi, j, hk) + s.d, A(0));
        std::fill(dv + s.kv_index(bi, j, hk), dv + s.kv_index(bi, j, hk) + s.d, A(0));
      }
      for (int64_t h = hk * s.group; h < (hk + 1) * s.group; ++h) {
        for (int64_t i = 0; i < s.sq; ++i) {
          const int64_t qi = s.q_index(bi, i, h);
          const A* qr = qp + qi;
          const A* dor = dop + qi;
          A* dqr = dq + qi;
          std::fill(dqr, dqr + s.d, A(0));
          const auto [lo, hi] = keys(bi, i);
          if (lo == hi) continue;
          const A m = scores(s, qr, kp, bi, hk, lo, hi, scale, p.data());
          A row_lse;
          if (recompute_lse) {
            A l = 0;
            for (int64_t j = lo; j < hi; ++j) l += std::exp(p[j - lo] - m);
            row_lse = m + std::log(l);
          } else {
            row_lse = static_cast<A>(TrL::load(lp[(bi * s.hq + h) * s.sq + i]));
          }
          const A di = dot(dor, op + qi, s.d);  // rowsum(dO * O)
          for (int64_t j = lo; j < hi; ++j) {
            const int64_t kj = s.kv_index(bi, j, hk);
            const A pj = std::exp(p[j - lo] - row_lse);
            const A dpj = dot(dor, vp + kj, s.d);
            const A ds = pj * (dpj - di) * scale;
            for (int64_t c = 0; c < s.d; ++c) {
              dv[kj + c] += pj * dor[c];
              dqr[c] += ds * kp[kj + c];
              dk[kj + c] += ds * qr[c];
            }
          }
        }
      }
    }
  });
  finish_output(grad_q, dq_own);
  finish_output(grad_k, dk_own);
  finish_output(grad_v, dv_own);
}

template <class F>
void dispatch_attention(DType q_dtype, DType lse_dtype, const char* op, F&& f) {
  if (!is_floating(q_dtype)) unsupported_dtype(op, q_dtype);
  auto with_lse = [&](auto a_tag) {
    using A = decltype(a_tag);
    if (lse_dtype == DType::F32)
      f(A{}, Traits<DType::F32>{});
    else if (lse_dtype == DType::F64)
      f(A{}, Traits<DType::F64>{});
    else
      throw std::logic_error(std::string("[") + op + "] lse must be f32 or f64");
  };
  if (q_dtype == DType::F64)
    with_lse(double{});
  else
    with_lse(float{});
}

}  // namespace

void CpuBackend::attention(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                           const Tensor& v, const AttentionMask& mask, double scale) {
  const AttnShape s = check_shapes("attention", out, lse, q, k, v, mask);
  if (out.numel() == 0 && lse.numel() == 0) return;
  const KeyRanges keys(s, mask);
  dispatch_attention(q.dtype(), lse.dtype(), "attention", [&](auto a_tag, auto tr_l) {
    using A = decltype(a_tag);
    attention_forward<A, decltype(tr_l)>(s, out, lse, q, k, v, keys, static_cast<A>(scale));
  });
}

void CpuBackend::attention_backward(const Tensor& grad_q, const Tensor& grad_k,
                                    const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const AttentionMask& mask, double scale) {
  const AttnShape s = check_shapes("attention", out, lse, q, k, v, mask);
  if (grad_q.shape() != q.shape() || grad_k.shape() != k.shape() || grad_v.shape() != v.shape() ||
      grad_out.shape() != q.shape() || !grad_q.is_contiguous() || !grad_k.is_contiguous() ||
      !grad_v.is_contiguous() || !grad_out.is_contiguous() || grad_q.dtype() != q.dtype() ||
      grad_k.dtype() != q.dtype() || grad_v.dtype() != q.dtype() || grad_out.dtype() != q.dtype())
    throw std::logic_error("[attention] backward: gradients must be contiguous and match q, k, v");
  const KeyRanges keys(s, mask);
  dispatch_attention(q.dtype(), lse.dtype(), "attention", [&](auto a_tag, auto tr_l) {
    using A = decltype(a_tag);
    attention_backward_impl<A, decltype(tr_l)>(s, grad_q, grad_k, grad_v, grad_out, q, k, v, out,
                                               lse, keys, static_cast<A>(scale));
  });
}

}  // namespace accel
