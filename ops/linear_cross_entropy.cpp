// linear_cross_entropy: cross_entropy(linear(x, weight), targets) without ever holding the [N, V]
// logits. Rows go through in chunks: each chunk's logits live in one [chunk, V] buffer, which
// its logits gradient then overwrites, and the gradients of x and of the weight are made right
// there, in the forward (the loss is the end of the graph, so its upstream gradient is only a
// scalar factor, expected to be grad_scale and applied in backward relative to it). At a 128k
// vocabulary this saves the two N x V tensors (4 GiB at 8k tokens in bf16) and their memory
// traffic. The chunk loop (chunked_linear_cross_entropy) takes its GEMMs from a ChunkedLinear: here
// the backend's matmuls in the compute dtype; fp8_linear_cross_entropy (ops/fp8.cpp) gives
// fp8_linear's. Kernels: the GEMMs' and the backend's cross_entropy_with_grad.
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
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
Tensor as2(const Tensor& m3) {
  return m3.as_strided({m3.size(1), m3.size(2)}, {m3.size(2), 1}, m3.offset());
}

// The GEMMs in x's dtype. The weight's gradient accumulates over the chunks in its dtype (one
// rounding per chunk in 16 bits), the first chunk's GEMM writing it.
class DtypeLinear : public detail::ChunkedLinear {
 public:
  DtypeLinear(const Tensor& x2, const Tensor& w, bool need_w)
      : be_(backend_for(x2.device())),
        x2_(x2),
        w3_(w.as_strided({1, w.size(0), w.size(1)}, {w.numel(), w.size(1), 1}, w.offset())) {
    // The first chunk's GEMM writes it (beta 0); only no rows at all leave the zeros.
    if (need_w)
      gw_ = x2.size(0) > 0 ? Tensor::empty(w.shape(), w.dtype(), w.device())
                           : Tensor::zeros(w.shape(), w.dtype(), w.device());
  }
  Tensor logits(int64_t r0, int64_t n) override {
    const int64_t V = w3_.size(1);
    if (!logits_.defined())
      logits_ = Tensor::empty({n, V}, x2_.dtype(), x2_.device());  // 1st: largest
    Tensor l3 = rows3(logits_, 0, n);
    be_.matmul(l3, rows3(x2_, r0, n), w3_, /*trans_a=*/false, /*trans_b=*/true, 1.0, 0.0, Tensor());
    return as2(l3);
  }
  void backward(int64_t r0, int64_t n, const Tensor& g, const Tensor& gx) override {
    Tensor g3 = rows3(g, 0, n);
    if (gx.defined()) be_.matmul(rows3(gx, 0, n), g3, w3_, false, false, 1.0, 0.0, Tensor());
    if (gw_.defined())
      be_.matmul(rows3(gw_, 0, gw_.size(0)), g3, rows3(x2_, r0, n), true, false, 1.0,
                 r0 == 0 ? 0.0 : 1.0, Tensor());
  }
  Tensor weight_grad() override { return gw_; }

 private:
  Backend& be_;
  Tensor x2_, w3_, logits_, gw_;
};
}  // namespace

Tensor detail::chunked_linear_cross_entropy(const char* op, const Tensor& x, const Tensor& weight,
                                            const Tensor& targets, int64_t ignore_index,
                                            int64_t chunk_rows, double grad_scale,
                                            const ChunkedLinearFactory& make) {
  detail::check_defined(op, x, "x");
  detail::check_defined(op, weight, "weight");
  detail::check_floating(op, x);
  detail::check_same_device(op, x, weight);
  detail::check_same_device(op, x, targets);
  if (weight.dim() != 2 || x.dim() < 1 || x.size(-1) != weight.size(1))
    op_error(op, "expected x [..., D] and weight [V, D], got x " + shape_str(x.shape()) +
                     " and weight " + shape_str(weight.shape()));
  if (targets.dtype() != DType::I64 && targets.dtype() != DType::I32)
    op_error(op, "targets must be i64 or i32, got " + targets.str());
  const int64_t D = weight.size(1), V = weight.size(0);
  const int64_t N = D == 0 ? 0 : x.numel() / D;
  if (targets.numel() != N)
    op_error(op, "targets must hold one id per row of x (" + std::to_string(N) + "), got " +
                     targets.str());
  if (chunk_rows < 0) op_error(op, "chunk_rows must be >= 0, got " + std::to_string(chunk_rows));
  // A factor that cannot be divided out again (0: a micro-batch without trained tokens) is left to
  // backward: the gradients are made for 1.
  if (!std::isfinite(grad_scale) || grad_scale == 0.0) grad_scale = 1.0;

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
  // cross_entropy's backward scale for an upstream gradient of grad_scale: grad_scale / count.
  Tensor expected = Tensor::full({}, grad_scale, acc, dev);
  Tensor scale = div(expected, counted);

  std::unique_ptr<detail::ChunkedLinear> gemms = make(xc, wc, need_x, need_w);
  // About 2^27 logits per chunk (256 MiB in bf16): large GEMMs, small buffers.
  const int64_t multiple = gemms->row_multiple();
  int64_t chunk = chunk_rows > 0 ? chunk_rows : (int64_t{1} << 27) / std::max<int64_t>(V, 1);
  chunk = std::max<int64_t>(1, std::min<int64_t>(N, (chunk + multiple - 1) / multiple * multiple));
  Tensor loss_rows = Tensor::zeros({N}, acc, dev);
  Tensor lse = Tensor::empty({N}, acc, dev);
  Tensor gx = need_x ? Tensor::empty({N, D}, dt, dev) : Tensor();
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    Tensor l2 = gemms->logits(r0, n);
    Tensor loss_c = rows1(loss_rows, r0, n), lse_c = rows1(lse, r0, n), t_c = rows1(tc, r0, n);
    if (!want_grad) {
      be.cross_entropy(loss_c, lse_c, l2, t_c, ignore_index);
      continue;
    }
    // The logits' gradient replaces them (one read of each row for both, no second buffer). The
    // head runs outside the layers' checkpoints, so the logits are never a selective
    // checkpoint's kept output (which a recomputation would hand back).
    be.cross_entropy_with_grad(loss_c, lse_c, l2, l2, t_c, ignore_index, scale);
    gemms->backward(r0, n, l2, need_x ? as2(rows3(gx, r0, n)) : Tensor());
  }
  Tensor gw = gemms->weight_grad();
  gemms.reset();
  Tensor loss = div(sum(loss_rows), counted);  // 0/0 = NaN when every target is ignored
  no_grad.reset();
  if (!want_grad) return loss;
  const Shape x_shape = x.shape();
  return record(op, loss, {x, weight}, [gx, gw, x_shape, expected, grad_scale](const Tensor& g) {
    // The gradients were made for an upstream gradient of grad_scale. The trainer's seed of that
    // number (backward_with_seed) takes them as made: no pass over them, no second weight-sized
    // buffer (the engine frees this closure before the weight takes its gradient, so that one is
    // kept without a copy). Any other upstream gradient multiplies by g / grad_scale on the device.
    const std::optional<double> seed = backward_seed_value(g);
    if (seed && *seed == grad_scale)
      return std::vector<Tensor>{gx.defined() ? reshape(gx, x_shape) : Tensor(), gw};
    Tensor factor = div(cast(g, expected.dtype()), expected);
    Tensor gx_out, gw_out;
    if (gx.defined()) gx_out = reshape(mul(gx, cast(factor, gx.dtype())), x_shape);
    if (gw.defined()) gw_out = mul(gw, cast(factor, gw.dtype()));
    return std::vector<Tensor>{gx_out, gw_out};
  });
}

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets,
                            int64_t ignore_index, int64_t chunk_rows, double grad_scale) {
  detail::check_defined("linear_cross_entropy", x, "x");
  detail::check_defined("linear_cross_entropy", weight, "weight");
  detail::check_same_dtype("linear_cross_entropy", x, weight);
  return detail::chunked_linear_cross_entropy(
      "linear_cross_entropy", x, weight, targets, ignore_index, chunk_rows, grad_scale,
      [](const Tensor& x2, const Tensor& w, bool, bool need_w) {
        return std::make_unique<DtypeLinear>(x2, w, need_w);
      });
}

}  // namespace accel
