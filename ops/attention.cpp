// attention: q [B, S, Hq, D], k/v [B, S, Hkv, D]; the backward uses the saved log-sum-exp
// (kernels cpu/attention.cpp, cuda/attention.cu and the files it names).
#include <cmath>
#include <optional>

#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {

// The mask as the backends take it: segment_ids contiguous int32 [B, S] on q's device, or
// undefined.
AttentionMask checked_mask(const AttentionMask& mask, const Tensor& q) {
  if (mask.window < 0)
    op_error("attention",
             "window must be 0 (none) or positive, got " + std::to_string(mask.window));
  if (!mask.causal && (mask.window != 0 || mask.segment_ids.defined()))
    op_error("attention",
             "a sliding window or segment_ids needs causal attention (mask.causal = true)");
  AttentionMask m = mask;
  if (!m.segment_ids.defined()) return m;
  const Tensor& seg = m.segment_ids;
  if (seg.dtype() != DType::I32 || seg.dim() != 2 || seg.size(0) != q.size(0) ||
      seg.size(1) != q.size(1))
    op_error("attention",
             "segment_ids must be int32 [B, S] = " + shape_str({q.size(0), q.size(1)}) + " for q " +
                 shape_str(q.shape()) + ", got " + seg.str());
  if (seg.device() != q.device())
    op_error("attention", "segment_ids must be on q's device (" + q.device().str() + "), got " +
                              seg.device().str());
  m.segment_ids = contiguous(seg).detach();
  return m;
}

}  // namespace

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                 std::optional<double> scale) {
  detail::check_floating("attention", q);
  detail::check_same_device("attention", q, k);
  detail::check_same_device("attention", q, v);
  detail::check_same_dtype("attention", q, k);
  detail::check_same_dtype("attention", q, v);
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.shape() != v.shape() ||
      q.size(0) != k.size(0) || q.size(1) != k.size(1) || q.size(3) != k.size(3) ||
      k.size(2) == 0 || q.size(2) % k.size(2) != 0)
    op_error("attention",
             "expected q [B, S, Hq, D] and k, v [B, S, Hkv, D] with Hq a multiple of "
             "Hkv; got q " +
                 shape_str(q.shape()) + ", k " + shape_str(k.shape()) + ", v " +
                 shape_str(v.shape()));
  const AttentionMask m = checked_mask(mask, q);
  const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  Tensor qc = contiguous(q), kc = contiguous(k), vc = contiguous(v);
  // The log-sum-exp is kept with the output: the backward needs both.
  const std::vector<Tensor> computed = keep_outputs("attention", [&] {
    Tensor o = Tensor::empty(q.shape(), q.dtype(), q.device());
    Tensor l = Tensor::empty({q.size(0), q.size(2), q.size(1)}, DType::F32, q.device());
    backend_for(q.device()).attention(o, l, qc, kc, vc, m, sc);
    return std::vector<Tensor>{o, l};
  });
  Tensor out = computed[0], lse = computed[1];
  Tensor saved_out = out.detach();
  return record("attention", out, {qc, kc, vc},
                [qc, kc, vc, saved_out, lse, m, sc](const Tensor& g) {
                  Tensor gq = Tensor::empty(qc.shape(), qc.dtype(), qc.device());
                  Tensor gk = Tensor::empty(kc.shape(), kc.dtype(), kc.device());
                  Tensor gv = Tensor::empty(vc.shape(), vc.dtype(), vc.device());
                  backend_for(qc.device())
                      .attention_backward(gq, gk, gv, contiguous(g), qc.detach(), kc.detach(),
                                          vc.detach(), saved_out, lse, m, sc);
                  return std::vector<Tensor>{gq, gk, gv};
                });
}

}  // namespace accel
