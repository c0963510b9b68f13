// attention: q [B, S, Hq, D], k/v [B, S, Hkv, D]; the backward uses the saved log-sum-exp
// (kernels cpu/attention.cpp, cuda/attention.cu and the files it names).
#include <cmath>
#include <optional>

#include "ops/common.h"

namespace accel {
using detail::op_error;

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
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
  const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  Tensor qc = contiguous(q), kc = contiguous(k), vc = contiguous(v);
  Tensor out = Tensor::empty(q.shape(), q.dtype(), q.device());
  Tensor lse = Tensor::empty({q.size(0), q.size(2), q.size(1)}, DType::F32, q.device());
  backend_for(q.device()).attention(out, lse, qc, kc, vc, causal, sc);
  Tensor saved_out = out.detach();
  return record("attention", out, {qc, kc, vc},
                [qc, kc, vc, saved_out, lse, causal, sc](const Tensor& g) {
                  Tensor gq = Tensor::empty(qc.shape(), qc.dtype(), qc.device());
                  Tensor gk = Tensor::empty(kc.shape(), kc.dtype(), kc.device());
                  Tensor gv = Tensor::empty(vc.shape(), vc.dtype(), vc.device());
                  backend_for(qc.device())
                      .attention_backward(gq, gk, gv, contiguous(g), qc.detach(), kc.detach(),
                                          vc.detach(), saved_out, lse, causal, sc);
                  return std::vector<Tensor>{gq, gk, gv};
                });
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                 std::optional<double> scale) {
  if (mask.window != 0 || mask.segment_ids.defined())
    op_error("attention", "sliding windows and document masks are not implemented yet");
  return attention(q, k, v, mask.causal, scale);
}

}  // namespace accel
