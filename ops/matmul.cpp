// matmul and linear. Transposed views reach the GEMM as transpose flags, not copies.
#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {
// A [batch, rows, cols] contiguous operand and whether the GEMM should read it transposed.
struct GemmOperand {
  Tensor t;
  bool trans;
};

GemmOperand as_gemm_operand(const Tensor& x, int64_t batch) {
  int64_t r = x.size(-2), c = x.size(-1);
  if (x.is_contiguous()) return {x.as_strided({batch, r, c}, {r * c, c, 1}, x.offset()), false};
  // A transposed view of a contiguous [.., c, r] tensor.
  Shape st = x.strides();
  int64_t n = x.dim();
  bool last_two_swapped = st[n - 2] == 1 && st[n - 1] == r;
  bool batch_ok = true;
  int64_t expect = r * c;
  for (int64_t i = n - 3; i >= 0; --i) {
    if (x.shape()[i] != 1 && st[i] != expect) batch_ok = false;
    expect *= x.shape()[i];
  }
  if (last_two_swapped && batch_ok)
    return {x.as_strided({batch, c, r}, {r * c, r, 1}, x.offset()), true};
  Tensor cx = x.clone();
  return {cx.as_strided({batch, r, c}, {r * c, c, 1}, 0), false};
}
}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  detail::check_defined("matmul", a, "a");
  detail::check_defined("matmul", b, "b");
  detail::check_same_device("matmul", a, b);
  detail::check_same_dtype("matmul", a, b);
  detail::check_floating("matmul", a);
  if (a.dim() < 2 || b.dim() < 2)
    op_error("matmul", "needs at least 2-d inputs, got " + a.str() + " and " + b.str());
  int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  if (b.size(-2) != K)
    op_error("matmul",
             "inner dimensions differ: " + shape_str(a.shape()) + " @ " + shape_str(b.shape()));
  Shape batch_a(a.shape().begin(), a.shape().end() - 2);
  Shape batch_b(b.shape().begin(), b.shape().end() - 2);
  Shape batch = detail::broadcast_shapes("matmul", batch_a, batch_b);
  int64_t nb = shape_numel(batch);
  Tensor ea = a, eb = b;
  // An operand whose batch is neither the full batch nor a single matrix gets expanded (copied).
  auto prepare = [&](const Tensor& x, const Shape& xb) -> GemmOperand {
    if (shape_numel(xb) == 1) return as_gemm_operand(x, 1);
    if (xb == batch) return as_gemm_operand(x, nb);
    Shape full = batch;
    full.push_back(x.size(-2));
    full.push_back(x.size(-1));
    return as_gemm_operand(detail::expand_raw(x, full).clone(), nb);
  };
  Tensor out = keep_output("matmul", [&] {
    GemmOperand ga = prepare(a, batch_a), gb = prepare(b, batch_b);
    Shape out_shape = batch;
    out_shape.push_back(M);
    out_shape.push_back(N);
    Tensor o = Tensor::empty(out_shape, a.dtype(), a.device());
    backend_for(a.device())
        .matmul(o.as_strided({nb, M, N}, {M * N, N, 1}, 0), ga.t, gb.t, ga.trans, gb.trans, 1.0,
                0.0, Tensor());
    return o;
  });
  bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return record("matmul", out, {a, b}, [a, b, need_a, need_b](const Tensor& g) {
    Tensor ad = a.detach(), bd = b.detach();
    Tensor ga = need_a ? sum_to_shape(matmul(g, transpose(bd, -1, -2)), a.shape()) : Tensor();
    Tensor gb;
    if (need_b) {
      // When b is a transposed view of a contiguous matrix (linear's weight^T), compute the
      // gradient in that matrix's own layout (same GEMM, operands swapped): the transpose's
      // backward then hands the weight a contiguous gradient instead of a strided copy.
      const bool b_transposed = a.dim() == 2 && b.dim() == 2 && b.size(1) > 1 &&
                                b.strides()[0] == 1 && b.strides()[1] == b.size(0);
      gb = b_transposed ? transpose(matmul(transpose(g, -1, -2), ad), -1, -2)
                        : sum_to_shape(matmul(transpose(ad, -1, -2), g), b.shape());
    }
    return std::vector<Tensor>{ga, gb};
  });
}

namespace {
// y = x @ weight^T (+ residual) for contiguous x [.., in] and weight [out, in], as one node over
// {x, weight} (and the residual) whose backward folds the gradient x already has into its
// input-gradient GEMM (C = that gradient): the projections that share an input (q, k, v; gate,
// up) then sum their input gradients inside the GEMMs instead of in separate additions. A
// residual (contiguous, of y's shape and dtype) is the forward GEMM's C.
Tensor linear_contiguous(const Tensor& x, const Tensor& weight, const Shape& out_shape,
                         const Tensor& residual) {
  const int64_t in = weight.size(1), out = weight.size(0);
  // The rows are x's leading dims (not numel / in: in_features may be 0).
  const int64_t rows = shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  auto rows3 = [rows](const Tensor& t, int64_t cols) {
    return t.as_strided({1, rows, cols}, {rows * cols, cols, 1}, t.offset());
  };
  const Tensor w3 = weight.as_strided({1, out, in}, {out * in, in, 1}, weight.offset());
  const bool with_residual = residual.defined();
  Tensor y = keep_output("linear", [&] {
    Tensor o = Tensor::empty(out_shape, x.dtype(), x.device());
    const Tensor c = with_residual ? rows3(residual, out) : Tensor();
    backend_for(x.device())
        .matmul(rows3(o, out), rows3(x, in), w3, false, true, 1.0, with_residual ? 1.0 : 0.0, c);
    return o;
  });
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  std::vector<Tensor> inputs{x, weight};
  if (with_residual) inputs.push_back(residual);
  return record_folding(
      "linear", y, std::move(inputs), 0,
      [x, weight, need_x, need_w, with_residual, rows3, w3, in, out](const Tensor& g,
                                                                     const Tensor& pending) {
        const Tensor gc = contiguous(g);
        Backend& be = backend_for(gc.device());
        Tensor gx, gw;
        if (need_x) {
          gx = Tensor::empty(x.shape(), x.dtype(), x.device());
          const Tensor add = pending.defined() ? rows3(contiguous(pending), in) : Tensor();
          be.matmul(rows3(gx, in), rows3(gc, out), w3.detach(), false, false, 1.0,
                    add.defined() ? 1.0 : 0.0, add);
        }
        if (need_w) {
          gw = Tensor::empty(weight.shape(), weight.dtype(), weight.device());
          be.matmul(gw.as_strided({1, out, in}, {out * in, in, 1}, 0), rows3(gc, out),
                    rows3(x.detach(), in), true, false, 1.0, 0.0, Tensor());
        }
        std::vector<Tensor> grads{gx, gw};
        if (with_residual) grads.push_back(g);  // y = residual + ...: the same gradient
        return grads;
      });
}
}  // namespace

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& residual) {
  detail::check_defined("linear", x, "input");
  detail::check_defined("linear", weight, "weight");
  if (weight.dim() != 2) op_error("linear", "weight must be 2-d [out, in], got " + weight.str());
  if (x.dim() < 1 || x.size(-1) != weight.size(1))
    op_error("linear", "input " + shape_str(x.shape()) +
                           " does not end in in_features=" + std::to_string(weight.size(1)) +
                           " of weight " + shape_str(weight.shape()));
  Shape out_shape = x.shape();
  out_shape.back() = weight.size(0);
  detail::check_residual("linear", residual, x, out_shape);
  Tensor y;
  if (x.is_contiguous() && weight.is_contiguous()) {
    detail::check_same_device("linear", x, weight);
    detail::check_same_dtype("linear", x, weight);
    detail::check_floating("linear", x);
    // A bias comes after the product, so a residual then cannot be the GEMM's C (the sum's
    // order would differ from the definition's).
    const bool fold = residual.defined() && !bias.defined();
    y = linear_contiguous(x, weight, out_shape, fold ? contiguous(residual) : Tensor());
    if (fold) return y;
  } else {
    y = reshape(matmul(reshape(x, {-1, weight.size(1)}), transpose(weight, 0, 1)), out_shape);
  }
  if (bias.defined()) y = add(y, bias);
  return residual.defined() ? add(residual, y) : y;
}

}  // namespace accel
