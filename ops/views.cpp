// Differentiable views and layout ops.
#include <algorithm>
#include <numeric>

#include "ops/common.h"
#include "runtime/kernels.h"

namespace accel {
using detail::normalize_dim;
using detail::op_error;

namespace {
Shape infer_shape(const char* op, Shape shape, int64_t numel) {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) op_error(op, "only one dimension can be -1 in " + shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else if (shape[i] < 0) {
      op_error(op, "negative dimension in " + shape_str(shape));
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0)
      op_error(op, "cannot infer -1 in " + shape_str(shape) + " for " + std::to_string(numel) +
                       " elements");
    shape[infer] = numel / known;
  }
  if (shape_numel(shape) != numel)
    op_error(op,
             "shape " + shape_str(shape) + " does not hold " + std::to_string(numel) + " elements");
  return shape;
}
}  // namespace

Tensor view(const Tensor& x, Shape shape) {
  shape = infer_shape("view", std::move(shape), x.numel());
  if (!x.is_contiguous())
    op_error("view", "tensor " + x.str() + " is not contiguous; use reshape (copies) instead");
  Tensor out = x.as_strided(shape, contiguous_strides(shape), x.offset());
  Shape in_shape = x.shape();
  return record("view", out, {x},
                [in_shape](const Tensor& g) { return std::vector<Tensor>{reshape(g, in_shape)}; });
}

Tensor reshape(const Tensor& x, Shape shape) {
  shape = infer_shape("reshape", std::move(shape), x.numel());
  return view(x.is_contiguous() ? x : contiguous(x), shape);
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  d0 = normalize_dim("transpose", d0, x.dim());
  d1 = normalize_dim("transpose", d1, x.dim());
  Shape shape = x.shape(), strides = x.strides();
  std::swap(shape[d0], shape[d1]);
  std::swap(strides[d0], strides[d1]);
  return record("transpose", x.as_strided(shape, strides, x.offset()), {x},
                [d0, d1](const Tensor& g) { return std::vector<Tensor>{transpose(g, d0, d1)}; });
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  if (static_cast<int64_t>(dims.size()) != x.dim())
    op_error("permute", "needs " + std::to_string(x.dim()) + " dims, got " + shape_str(dims));
  Shape shape(dims.size()), strides(dims.size());
  std::vector<int64_t> inverse(dims.size(), -1);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = normalize_dim("permute", dims[i], x.dim());
    if (inverse[d] >= 0) op_error("permute", "repeated dim in " + shape_str(dims));
    inverse[d] = static_cast<int64_t>(i);
    shape[i] = x.shape()[d];
    strides[i] = x.strides()[d];
  }
  return record("permute", x.as_strided(shape, strides, x.offset()), {x},
                [inverse](const Tensor& g) { return std::vector<Tensor>{permute(g, inverse)}; });
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  dim = normalize_dim("narrow", dim, x.dim());
  if (start < 0 || length < 0 || start + length > x.shape()[dim])
    op_error("narrow", "range [" + std::to_string(start) + ", " + std::to_string(start + length) +
                           ") outside dim " + std::to_string(dim) + " of " + shape_str(x.shape()));
  Shape shape = x.shape();
  shape[dim] = length;
  Tensor out = x.as_strided(shape, x.strides(), x.offset() + start * x.strides()[dim]);
  Shape in_shape = x.shape();
  DType dtype = x.dtype();
  Device device = x.device();
  return record("narrow", out, {x}, [=](const Tensor& g) {
    Tensor full = Tensor::zeros(in_shape, dtype, device);
    Tensor part = full.as_strided(g.shape(), full.strides(), start * full.strides()[dim]);
    kernels::copy(part, g);
    return std::vector<Tensor>{full};
  });
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end) {
  return narrow(x, dim, start, end - start);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  Tensor out = detail::expand_raw(x, shape);
  if (out.same(x)) return x;
  Shape in_shape = x.shape();
  return record("expand", out, {x}, [in_shape](const Tensor& g) {
    return std::vector<Tensor>{sum_to_shape(g, in_shape)};
  });
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  dim = normalize_dim("squeeze", dim, x.dim());
  if (x.shape()[dim] != 1)
    op_error("squeeze", "dim " + std::to_string(dim) + " of " + shape_str(x.shape()) + " is not 1");
  Shape shape = x.shape();
  shape.erase(shape.begin() + dim);
  return reshape(x, shape);
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  dim = normalize_dim("unsqueeze", dim, x.dim() + 1);
  Shape shape = x.shape();
  shape.insert(shape.begin() + dim, 1);
  return reshape(x, shape);
}

Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  return record("contiguous", x.clone(), {x},
                [](const Tensor& g) { return std::vector<Tensor>{g}; });
}

Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = Tensor::empty(x.shape(), dtype, x.device());
  kernels::copy(out, x);
  if (!is_floating(dtype)) return out;
  DType in_dtype = x.dtype();
  return record("cast", out, {x},
                [in_dtype](const Tensor& g) { return std::vector<Tensor>{cast(g, in_dtype)}; });
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  if (xs.empty()) op_error("cat", "needs at least one tensor");
  const Tensor& first = xs[0];
  dim = normalize_dim("cat", dim, first.dim());
  Shape shape = first.shape();
  int64_t total = 0;
  for (const Tensor& t : xs) {
    detail::check_same_dtype("cat", first, t);
    detail::check_same_device("cat", first, t);
    Shape s = t.shape();
    if (s.size() != shape.size())
      op_error("cat", "tensors of different rank: " + first.str() + " and " + t.str());
    for (size_t i = 0; i < s.size(); ++i)
      if (static_cast<int64_t>(i) != dim && s[i] != shape[i])
        op_error("cat", "shapes " + shape_str(first.shape()) + " and " + shape_str(s) +
                            " differ outside dim " + std::to_string(dim));
    total += s[dim];
  }
  shape[dim] = total;
  Tensor out = Tensor::empty(shape, first.dtype(), first.device());
  std::vector<int64_t> sizes;
  int64_t at = 0;
  for (const Tensor& t : xs) {
    Shape s = t.shape();
    kernels::copy(out.as_strided(s, out.strides(), at * out.strides()[dim]), t);
    sizes.push_back(s[dim]);
    at += s[dim];
  }
  return record("cat", out, xs, [sizes, dim](const Tensor& g) {
    std::vector<Tensor> grads;
    int64_t start = 0;
    for (int64_t n : sizes) {
      grads.push_back(narrow(g, dim, start, n));
      start += n;
    }
    return grads;
  });
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  dim = normalize_dim("split", dim, x.dim());
  int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  if (total != x.shape()[dim])
    op_error("split", "sizes " + shape_str(sizes) + " do not add up to dim " + std::to_string(dim) +
                          " of " + shape_str(x.shape()));
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t n : sizes) {
    out.push_back(narrow(x, dim, start, n));
    start += n;
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  if (xs.empty()) op_error("stack", "needs at least one tensor");
  dim = normalize_dim("stack", dim, xs[0].dim() + 1);
  std::vector<Tensor> parts;
  for (const Tensor& t : xs) parts.push_back(unsqueeze(t, dim));
  return cat(parts, dim);
}

}  // namespace accel
