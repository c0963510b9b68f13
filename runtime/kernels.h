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

namespace cpu {
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void accumulate(const Tensor& dst, const Tensor& src);
}  // namespace cpu
namespace cuda {  // runtime/cuda/ (or runtime/no_cuda/, which throws)
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void accumulate(const Tensor& dst, const Tensor& src);
}  // namespace cuda

}  // namespace accel::kernels
