// Reductions and their gradients.
#include <algorithm>

#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {
std::vector<int64_t> normalize_dims(const char* op, std::vector<int64_t> dims, int64_t ndim) {
  if (dims.empty()) {
    for (int64_t i = 0; i < ndim; ++i) dims.push_back(i);
    return dims;
  }
  for (int64_t& d : dims) d = detail::normalize_dim(op, d, ndim);
  std::sort(dims.begin(), dims.end());
  if (std::adjacent_find(dims.begin(), dims.end()) != dims.end())
    op_error(op, "repeated dim in " + shape_str(dims));
  return dims;
}

Shape keep_shape(const Shape& s, const std::vector<int64_t>& dims) {
  Shape k = s;
  for (int64_t d : dims) k[d] = 1;
  return k;
}

Shape drop_shape(const Shape& s, const std::vector<int64_t>& dims) {
  Shape out;
  for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i)
    if (std::find(dims.begin(), dims.end(), i) == dims.end()) out.push_back(s[i]);
  return out;
}

Tensor run_reduce(ReduceKind op, const Tensor& x, const std::vector<int64_t>& dims) {
  Tensor out = Tensor::empty(keep_shape(x.shape(), dims), x.dtype(), x.device());
  backend_for(x.device()).reduce(op, out, x, dims);
  return out;
}
}  // namespace

Tensor sum(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  dims = normalize_dims("sum", std::move(dims), x.dim());
  Tensor out = run_reduce(ReduceKind::Sum, x, dims);
  if (!keepdim)
    out = out.as_strided(drop_shape(x.shape(), dims),
                         contiguous_strides(drop_shape(x.shape(), dims)), 0);
  Shape in_shape = x.shape(), k = keep_shape(x.shape(), dims);
  return record("sum", out, {x}, [in_shape, k](const Tensor& g) {
    return std::vector<Tensor>{expand(reshape(g, k), in_shape)};
  });
}

Tensor mean(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  dims = normalize_dims("mean", std::move(dims), x.dim());
  int64_t n = 1;
  for (int64_t d : dims) n *= x.shape()[d];
  return mul(sum(x, dims, keepdim), n > 0 ? 1.0 / static_cast<double>(n) : 0.0);
}

Tensor max(const Tensor& x, int64_t dim, bool keepdim) {
  dim = detail::normalize_dim("max", dim, x.dim());
  if (x.shape()[dim] == 0) op_error("max", "cannot reduce over an empty dim of " + x.str());
  Tensor out = run_reduce(ReduceKind::Max, x, {dim});
  Tensor out_keep = out;
  if (!keepdim)
    out = out.as_strided(drop_shape(x.shape(), {dim}),
                         contiguous_strides(drop_shape(x.shape(), {dim})), 0);
  Tensor saved = out_keep.detach();
  return record("max", out, {x}, [x, saved, dim](const Tensor& g) {
    Tensor gin = Tensor::zeros(x.shape(), x.dtype(), x.device());
    backend_for(x.device())
        .max_backward(gin, x.detach(), saved, contiguous(reshape(g, saved.shape())), dim);
    return std::vector<Tensor>{gin};
  });
}

Tensor amax(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  dims = normalize_dims("amax", std::move(dims), x.dim());
  Tensor out = run_reduce(ReduceKind::AbsMax, x, dims);
  if (!keepdim)
    out = out.as_strided(drop_shape(x.shape(), dims),
                         contiguous_strides(drop_shape(x.shape(), dims)), 0);
  return out;  // used for scaling statistics; not differentiable
}

Tensor sum_to_shape(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0) op_error("sum_to_shape", "cannot reduce " + x.str() + " to " + shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i < lead) {
      dims.push_back(i);
    } else if (shape[i - lead] == 1 && x.shape()[i] != 1) {
      dims.push_back(i);
    } else if (shape[i - lead] != x.shape()[i]) {
      op_error("sum_to_shape", "cannot reduce " + x.str() + " to " + shape_str(shape));
    }
  }
  return reshape(sum(x, dims, true), shape);
}

double sum_of_squares(const std::vector<Tensor>& xs) {
  if (xs.empty()) return 0.0;
  return backend_for(xs[0].device()).sum_of_squares(xs);
}

bool has_non_finite(const Tensor& x) { return backend_for(x.device()).has_non_finite(x); }

}  // namespace accel
