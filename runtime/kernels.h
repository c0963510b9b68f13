// The few kernels the runtime itself needs (tensor copies, fills, gradient accumulation), per
// device. All math ops live in ops/.
#pragma once

#include "runtime/tensor.h"

namespace accel::kernels {

// dst[i] = convert(src[i]) over the logical index space; any strides, any dtypes; same device.
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
// dst += src, same shape, same dtype, dst contiguous.
void accumulate(const Tensor& dst, const Tensor& src);
// a + b (same shape, dtype and device) as a new contiguous tensor, in one pass: autograd's first
// sum of two gradients, which must leave both unchanged.
Tensor sum_of(const Tensor& a, const Tensor& b);

namespace cpu {
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void accumulate(const Tensor& dst, const Tensor& src);
void add(const Tensor& out, const Tensor& a, const Tensor& b);  // all contiguous
}  // namespace cpu
namespace cuda {  // runtime/cuda/ (or runtime/no_cuda/, which throws)
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void accumulate(const Tensor& dst, const Tensor& src);
void add(const Tensor& out, const Tensor& a, const Tensor& b);  // all contiguous
}  // namespace cuda

}  // namespace accel::kernels
