// embedding: a row gather; the backward scatters into a zeroed weight gradient (kernels
// cpu/embedding.cpp, cuda/embedding.cu).
#include "ops/common.h"

namespace accel {
using detail::op_error;

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

}  // namespace accel
