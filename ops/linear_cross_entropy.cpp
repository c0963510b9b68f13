// linear_cross_entropy: cross_entropy(linear(x, weight), targets) without ever holding the [N, V]
// logits. Rows go through in chunks: each chunk's logits, its loss and its logits gradient live
// in two [chunk, V] buffers, and the gradients of x and of the weight are made right there, in the
// forward (the loss is the end of the graph, so its upstream gradient is only a scalar factor,
// applied in backward). At a 128k vocabulary this saves the two N x V tensors (4 GiB at 8k tokens
// in bf16) and their memory traffic. Kernels: the backend's matmul and cross_entropy(_backward).
#include <algorithm>
#include <memory>
#include <string>

#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {
// A row range [r0, r0 + n) of a contiguous [N, C] matrix as the backend's 3-d GEMM operand.
Tensor rows3(const Tensor& m, int64_t r0, int64_t n) {
  const int64_t c = m.size(1);
  return m.as_strided({1, n, c}, {n * c, c, 1}, m.offset() + r0 * c);
}
Tensor rows1(const Tensor& v, int64_t r0, int64_t n) {
  return v.as_strided({n}, {1}, v.offset() + r0);
}
}  // namespace

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets,
                            int64_t ignore_index, int64_t chunk_rows) {
  detail::check_defined("linear_cross_entropy", x, "x");
  detail::check_defined("linear_cross_entropy", weight, "weight");
  detail::check_floating("linear_cross_entropy", x);
  detail::check_same_device("linear_cross_entropy", x, weight);
  detail::check_same_dtype("linear_cross_entropy", x, weight);
  detail::check_same_device("linear_cross_entropy", x, targets);
  if (weight.dim() != 2 || x.dim() < 1 || x.size(-1) != weight.size(1))
    op_error("linear_cross_entropy", "expected x [..., D] and weight [V, D], got x " +
                                         shape_str(x.shape()) + " and weight " +
                                         shape_str(weight.shape()));
  if (targets.dtype() != DType::I64 && targets.dtype() != DType::I32)
    op_error("linear_cross_entropy", "targets must be i64 or i32, got " + targets.str());
  const int64_t D = weight.size(1), V = weight.size(0);
  const int64_t N = D == 0 ? 0 : x.numel() / D;
  if (targets.numel() != N)
    op_error("linear_cross_entropy", "targets must hold one id per row of x (" + std::to_string(N) +
                                         "), got " + targets.str());
  if (chunk_rows < 0)
    op_error("linear_cross_entropy", "chunk_rows must be >= 0, got " + std::to_string(chunk_rows));

  Backend& be = backend_for(x.device());
  const DType dt = x.dtype(), acc = dt == DType::F64 ? DType::F64 : DType::F32;
  const Device dev = x.device();
  Tensor xc = contiguous(reshape(x.detach(), {N, D}));
  Tensor wc = contiguous(weight.detach());
  Tensor tc = contiguous(reshape(targets, {N}));
  const bool need_x = grad_enabled() && x.requires_grad();
  const bool need_w = grad_enabled() && weight.requires_grad();
  const bool want_grad = need_x || need_w;
  // Everything below is computed directly; the one recorded op is the result.
  auto no_grad = std::make_unique<NoGradGuard>();

  // As cross_entropy: the count of rows not ignored stays on the device (no host sync).
  Tensor ignored = equal(tc, Tensor::full({}, static_cast<double>(ignore_index), tc.dtype(), dev));
  Tensor counted = add(mul(sum(cast(ignored, acc)), -1.0), static_cast<double>(N));
  Tensor scale = div(Tensor::full({}, 1.0, acc, dev), counted);

  // About 2^27 logits per chunk (256 MiB in bf16): large GEMMs, small buffers.
  const int64_t chunk = std::max<int64_t>(
      1, std::min<int64_t>(
             N, chunk_rows > 0 ? chunk_rows : (int64_t{1} << 27) / std::max<int64_t>(V, 1)));
  Tensor loss_rows = Tensor::zeros({N}, acc, dev);
  Tensor lse = Tensor::empty({N}, acc, dev);
  Tensor logits = Tensor::empty({std::min(chunk, N), V}, dt, dev);
  Tensor grad_logits = want_grad ? Tensor::empty(logits.shape(), dt, dev) : Tensor();
  Tensor gx = need_x ? Tensor::empty({N, D}, dt, dev) : Tensor();
  Tensor gw = need_w ? Tensor::zeros({V, D}, dt, dev) : Tensor();
  Tensor w3 = wc.as_strided({1, V, D}, {V * D, D, 1}, wc.offset());
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    Tensor l3 = rows3(logits, 0, n), l2 = l3.as_strided({n, V}, {V, 1}, logits.offset());
    Tensor x3 = rows3(xc, r0, n), lse_c = rows1(lse, r0, n), t_c = rows1(tc, r0, n);
    be.matmul(l3, x3, w3, /*trans_a=*/false, /*trans_b=*/true, 1.0, 0.0);
    be.cross_entropy(rows1(loss_rows, r0, n), lse_c, l2, t_c, ignore_index);
    if (!want_grad) continue;
    Tensor g3 = rows3(grad_logits, 0, n), g2 = g3.as_strided({n, V}, {V, 1}, grad_logits.offset());
    be.cross_entropy_backward(g2, l2, lse_c, t_c, ignore_index, scale);
    if (need_x) be.matmul(rows3(gx, r0, n), g3, w3, false, false, 1.0, 0.0);
    // The weight's gradient accumulates over the chunks (in its dtype, one rounding per chunk).
    if (need_w)
      be.matmul(gw.as_strided({1, V, D}, {V * D, D, 1}, gw.offset()), g3, x3, true, false, 1.0,
                r0 == 0 ? 0.0 : 1.0);
  }
  Tensor loss = div(sum(loss_rows), counted);  // 0/0 = NaN when every target is ignored
  no_grad.reset();
  if (!want_grad) return loss;
  const Shape x_shape = x.shape();
  return record("linear_cross_entropy", loss, {x, weight}, [gx, gw, x_shape](const Tensor& g) {
    Tensor gx_out, gw_out;
    if (gx.defined()) gx_out = reshape(mul(gx, cast(g, gx.dtype())), x_shape);
    if (gw.defined()) gw_out = mul(gw, cast(g, gw.dtype()));
    return std::vector<Tensor>{gx_out, gw_out};
  });
}

}  // namespace accel
