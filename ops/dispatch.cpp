#include "ops/common.h"

namespace accel {

Backend& backend_for(Device d) { return d.is_cpu() ? cpu_backend() : cuda_backend(); }

void set_allow_tf32(Device device, bool allow) { backend_for(device).set_allow_tf32(allow); }

void Backend::cross_entropy_with_grad(const Tensor& loss_per_row, const Tensor& lse,
                                      const Tensor& grad_logits, const Tensor& logits,
                                      const Tensor& targets, int64_t ignore_index,
                                      const Tensor& scale) {
  cross_entropy(loss_per_row, lse, logits, targets, ignore_index);
  // Each gradient element is made from its own logit only: grad_logits may be logits.
  cross_entropy_backward(grad_logits, logits, lse, targets, ignore_index, scale);
}

// Backends without fused fp8 kernels never accept a layout in fp8_fused_cast_layout, so ops/fp8.cpp
// never calls these there.
void Backend::fp8_swiglu_cast(const Tensor&, const Tensor&, const Fp8CastTarget&) {
  throw std::logic_error(std::string("[fp8_swiglu_cast] the ") + name() +
                         " backend has no fused fp8 kernels (check fp8_fused_cast_layout first)");
}
void Backend::fp8_swiglu_backward_cast(const Tensor&, const Tensor&, const Tensor&,
                                       const Fp8CastTarget&, const Fp8CastTarget&) {
  throw std::logic_error(std::string("[fp8_swiglu_backward_cast] the ") + name() +
                         " backend has no fused fp8 kernels (check fp8_fused_cast_layout first)");
}

void fp8_casts_one_by_one(Backend& b, const std::vector<Fp8CastGroup>& groups,
                          const Fp8GroupScaling& scaling) {
  for (const Fp8CastGroup& g : groups) {
    const Fp8CastTarget& o = g.out;
    if (scaling.from_amax) {
      b.fp8_scale_from_amax(o.amax, o.scale, o.scale_inv, scaling.fp8_max, scaling.margin);
      b.fp8_cast(g.x, o.scale, o.data, o.data_t, Tensor(), o.scale_inv);
    } else {
      b.fp8_cast(g.x, o.scale, o.data, o.data_t, o.amax, o.scale_inv);
    }
  }
}

void fp8_amaxes_one_by_one(Backend& b, const std::vector<Tensor>& xs,
                           const std::vector<Tensor>& outs) {
  for (size_t g = 0; g < xs.size(); ++g) b.fp8_amax(xs[g], outs[g]);
}

namespace {
[[noreturn]] void no_moe_kernel(const Backend& b, const char* op) {
  throw std::logic_error(std::string("[") + op + "] the " + b.name() +
                         " backend has no mixture-of-experts kernels");
}
}  // namespace

void Backend::topk(const Tensor&, const Tensor&, const Tensor&, int64_t) {
  no_moe_kernel(*this, "topk");
}
void Backend::topk_backward(const Tensor&, const Tensor&, const Tensor&) {
  no_moe_kernel(*this, "topk");
}
void Backend::moe_permute(const Tensor&, const Tensor&, const Tensor&, int64_t) {
  no_moe_kernel(*this, "moe_permute");
}
void Backend::moe_permute_backward(const Tensor&, const Tensor&, const Tensor&, int64_t) {
  no_moe_kernel(*this, "moe_permute");
}
void Backend::moe_unpermute(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_moe_kernel(*this, "moe_unpermute");
}
void Backend::moe_unpermute_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&) {
  no_moe_kernel(*this, "moe_unpermute");
}
void Backend::grouped_matmul(const std::vector<Tensor>&, const std::vector<Tensor>&,
                             const std::vector<Tensor>&, bool, bool) {
  no_moe_kernel(*this, "grouped_linear");
}

namespace detail {

int64_t normalize_dim(const char* op, int64_t dim, int64_t ndim) {
  if (dim < -ndim || dim >= ndim)
    op_error(op, "dim " + std::to_string(dim) + " out of range for a " + std::to_string(ndim) +
                     "-d tensor");
  return dim < 0 ? dim + ndim : dim;
}

Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      op_error(op, "shapes " + shape_str(a) + " and " + shape_str(b) + " cannot be broadcast");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor expand_raw(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  size_t n = shape.size(), xd = x.shape().size();
  if (xd > n)
    op_error("expand", "cannot expand " + shape_str(x.shape()) + " to " + shape_str(shape));
  Shape strides(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (i < n - xd) continue;
    int64_t sx = x.shape()[i - (n - xd)];
    if (sx == shape[i]) {
      strides[i] = x.strides()[i - (n - xd)];
    } else if (sx != 1) {
      op_error("expand", "cannot expand " + shape_str(x.shape()) + " to " + shape_str(shape));
    }
  }
  return x.as_strided(shape, strides, x.offset());
}

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  if (a.device() != b.device())
    op_error(op, "inputs on different devices: " + a.str() + " and " + b.str());
}

void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    op_error(op, "inputs of different dtypes: " + a.str() + " and " + b.str() +
                     " (cast one of them first)");
}

void check_defined(const char* op, const Tensor& x, const char* what) {
  if (!x.defined()) op_error(op, std::string(what) + " is an undefined tensor");
}

void check_floating(const char* op, const Tensor& x) {
  if (!is_floating(x.dtype())) op_error(op, "needs a floating-point tensor, got " + x.str());
}

void check_residual(const char* op, const Tensor& residual, const Tensor& x,
                    const Shape& out_shape) {
  if (residual.defined() && (residual.shape() != out_shape || residual.dtype() != x.dtype() ||
                             residual.device() != x.device()))
    op_error(op, "residual " + residual.str() + " must have the output's shape " +
                     shape_str(out_shape) + ", dtype and device (" + x.str() + ")");
}

}  // namespace detail
}  // namespace accel
