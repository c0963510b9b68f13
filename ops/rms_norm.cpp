// Neural-network ops: each one autograd node with a fused backward in the backend.
#include <cmath>

#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {
// Moves `dim` last (copying when needed) so a backend can work on contiguous rows.
Tensor dim_last(const Tensor& x, int64_t dim) {
  return dim == x.dim() - 1 ? contiguous(x) : contiguous(transpose(x, dim, -1));
}
}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  detail::check_floating("softmax", x);
  dim = detail::normalize_dim("softmax", dim, x.dim());
  if (dim != x.dim() - 1) return transpose(softmax(dim_last(x, dim), -1), dim, -1);
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).softmax(out, xc, false);
  Tensor y = out.detach();
  return record("softmax", out, {xc}, [y](const Tensor& g) {
    return std::vector<Tensor>{mul(y, sub(g, sum(mul(g, y), {-1}, true)))};
  });
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  detail::check_floating("log_softmax", x);
  dim = detail::normalize_dim("log_softmax", dim, x.dim());
  if (dim != x.dim() - 1) return transpose(log_softmax(dim_last(x, dim), -1), dim, -1);
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).softmax(out, xc, true);
  Tensor y = out.detach();
  return record("log_softmax", out, {xc}, [y](const Tensor& g) {
    return std::vector<Tensor>{sub(g, mul(exp(y), sum(g, {-1}, true)))};
  });
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  detail::check_floating("cross_entropy", logits);
  if (logits.dim() != 2) op_error("cross_entropy", "logits must be [N, V], got " + logits.str());
  if (targets.dim() != 1 || targets.size(0) != logits.size(0))
    op_error("cross_entropy",
             "targets must be [N=" + std::to_string(logits.size(0)) + "], got " + targets.str());
  if (targets.dtype() != DType::I64 && targets.dtype() != DType::I32)
    op_error("cross_entropy", "targets must be i64 or i32, got " + targets.str());
  detail::check_same_device("cross_entropy", logits, targets);
  Backend& be = backend_for(logits.device());
  Tensor lc = contiguous(logits), tc = contiguous(targets);
  DType acc = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const int64_t n = logits.size(0);
  // The count of rows whose target is not ignore_index stays on the device: no host sync.
  Tensor ignored =
      equal(tc, Tensor::full({}, static_cast<double>(ignore_index), tc.dtype(), tc.device()));
  Tensor counted = add(mul(sum(cast(ignored, acc)), -1.0), static_cast<double>(n));
  const bool want_grad = grad_enabled() && logits.requires_grad();
  Tensor loss_rows = Tensor::empty({n}, acc, logits.device());
  Tensor lse = want_grad ? Tensor::empty({n}, acc, logits.device()) : Tensor();
  be.cross_entropy(loss_rows, lse, lc, tc, ignore_index);
  Tensor loss = div(sum(loss_rows), counted);  // 0/0 = NaN when every target is ignored
  if (!want_grad) return loss;
  // The gradient is made in backward from the saved lse: the logits are read once more and the
  // upstream gradient folds into the same pass (no gradient held from forward, no extra scaling).
  Tensor saved = lc.detach();
  return record("cross_entropy", loss.detach(), {lc},
                [saved, tc, lse, counted, ignore_index](const Tensor& g) {
                  Tensor scale = div(cast(g, counted.dtype()), counted);
                  Tensor grad = Tensor::empty(saved.shape(), saved.dtype(), saved.device());
                  backend_for(saved.device())
                      .cross_entropy_backward(grad, saved, lse, tc, ignore_index, scale);
                  return std::vector<Tensor>{grad};
                });
}

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  detail::check_same_device("embedding", weight, ids);
  if (weight.dim() != 2) op_error("embedding", "weight must be [V, D], got " + weight.str());
  if (ids.dtype() != DType::I64 && ids.dtype() != DType::I32)
    op_error("embedding", "ids must be i64 or i32, got " + ids.str());
  Shape out_shape = ids.shape();
  out_shape.push_back(weight.size(1));
  Tensor out = Tensor::empty(out_shape, weight.dtype(), weight.device());
  Tensor idc = contiguous(ids);
  backend_for(weight.device()).embedding(out, contiguous(weight), idc);
  Shape wshape = weight.shape();
  DType dtype = weight.dtype();
  return record("embedding", out, {weight}, [idc, wshape, dtype](const Tensor& g) {
    Tensor gw = Tensor::zeros(wshape, dtype, g.device(), MemCategory::Grads);
    backend_for(g.device()).embedding_backward(gw, contiguous(g), idc);
    return std::vector<Tensor>{gw};
  });
}

namespace {
void check_rms_norm_args(const char* op, const Tensor& x, const Tensor& weight) {
  detail::check_floating(op, x);
  detail::check_same_device(op, x, weight);
  detail::check_same_dtype(op, x, weight);
  if (weight.dim() != 1 || x.dim() < 1 || x.size(-1) != weight.size(0))
    op_error(op, "weight " + shape_str(weight.shape()) + " does not match the last dim of " +
                     shape_str(x.shape()));
}

Tensor new_rstd(const Tensor& x, int64_t d) {
  const int64_t rows = d ? x.numel() / d : 0;
  return Tensor::empty({rows}, x.dtype() == DType::F64 ? DType::F64 : DType::F32, x.device());
}

// Records rms_norm's node on `out` (inputs xc, wc contiguous). Its backward folds the gradient
// that xc has accumulated so far (the residual stream's, in a Llama block) into the same kernel.
Tensor record_rms_norm(Tensor out, const Tensor& xc, const Tensor& wc, const Tensor& rstd) {
  return record_folding("rms_norm", std::move(out), {xc, wc}, 0,
                        [xc, wc, rstd](const Tensor& g, const Tensor& pending) {
                          Tensor gx = Tensor::empty(xc.shape(), xc.dtype(), xc.device());
                          Tensor gw = Tensor::empty(wc.shape(), wc.dtype(), wc.device());
                          backend_for(xc.device())
                              .rms_norm_backward(gx, gw, contiguous(g), xc.detach(), wc.detach(),
                                                 rstd, pending);
                          return std::vector<Tensor>{gx, gw};
                        });
}
}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm", x, weight);
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = new_rstd(x, weight.size(0));
  Tensor wc = contiguous(weight);
  backend_for(x.device()).rms_norm(out, rstd, xc, wc, eps);
  return record_rms_norm(out, xc, wc, rstd);
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& r, const Tensor& weight,
                                       double eps) {
  check_rms_norm_args("add_rms_norm", x, weight);
  detail::check_same_device("add_rms_norm", x, r);
  detail::check_same_dtype("add_rms_norm", x, r);
  if (x.shape() != r.shape())
    op_error("add_rms_norm", "x " + shape_str(x.shape()) + " and r " + shape_str(r.shape()) +
                                 " must have one shape (no broadcasting)");
  // Plain copies (not recorded): the add node's inputs are x and r themselves, as add's are.
  Tensor xc = x.is_contiguous() ? x : x.clone(), rc = r.is_contiguous() ? r : r.clone();
  Tensor sum = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = new_rstd(x, weight.size(0));
  Tensor wc = contiguous(weight);
  backend_for(x.device()).add_rms_norm(sum, out, rstd, xc, rc, wc, eps);
  // The same two nodes as add then rms_norm record, so the gradients are identical.
  sum = record("add", sum, {x, r}, [](const Tensor& g) { return std::vector<Tensor>{g, g}; });
  return {sum, record_rms_norm(out, sum, wc, rstd)};
}

Tensor rope(const Tensor& x, double theta, int64_t position_offset) {
  detail::check_floating("rope", x);
  if (x.dim() != 4 || x.size(3) % 2 != 0)
    op_error("rope", "input must be [B, S, H, D] with D even, got " + x.str());
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).rope(out, xc, theta, position_offset, false);
  return record("rope", out, {xc}, [theta, position_offset](const Tensor& g) {
    Tensor gi = Tensor::empty(g.shape(), g.dtype(), g.device());
    backend_for(g.device()).rope(gi, contiguous(g), theta, position_offset, true);
    return std::vector<Tensor>{gi};
  });
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  detail::check_floating("swiglu", gate);
  detail::check_same_device("swiglu", gate, up);
  detail::check_same_dtype("swiglu", gate, up);
  if (gate.shape() != up.shape())
    op_error("swiglu",
             "gate " + shape_str(gate.shape()) + " and up " + shape_str(up.shape()) + " differ");
  Tensor gc = contiguous(gate), uc = contiguous(up);
  Tensor out = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  backend_for(gate.device()).swiglu(out, gc, uc);
  return record("swiglu", out, {gc, uc}, [gc, uc](const Tensor& g) {
    Tensor gg = Tensor::empty(gc.shape(), gc.dtype(), gc.device());
    Tensor gu = Tensor::empty(uc.shape(), uc.dtype(), uc.device());
    backend_for(gc.device()).swiglu_backward(gg, gu, contiguous(g), gc.detach(), uc.detach());
    return std::vector<Tensor>{gg, gu};
  });
}

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

}  // namespace accel
