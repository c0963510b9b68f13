// rope: the backward is the transposed rotation (kernels cpu/rope.cpp, cuda/rope.cu).
#include <cmath>

#include "ops/common.h"

namespace accel {
using detail::op_error;

RopeFrequencies default_rope_frequencies(double theta, int64_t dim) {
  if (dim <= 0 || dim % 2 != 0)
    op_error("rope", "the rotary dim must be positive and even, got " + std::to_string(dim));
  RopeFrequencies f;
  f.inv_freq.resize(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(dim);
    f.inv_freq[static_cast<size_t>(i)] = 1.0f / std::pow(static_cast<float>(theta), expo);
  }
  return f;
}

Tensor rope(const Tensor& x, const RopeFrequencies& freqs, int64_t position_offset,
            const Tensor& position_ids) {
  detail::check_floating("rope", x);
  if (x.dim() != 4 || x.size(3) % 2 != 0)
    op_error("rope", "input must be [B, S, H, D] with D even, got " + x.str());
  if (static_cast<int64_t>(freqs.inv_freq.size()) * 2 != x.size(3))
    op_error("rope", "needs D/2 = " + std::to_string(x.size(3) / 2) + " inverse frequencies for " +
                         x.str() + ", got " + std::to_string(freqs.inv_freq.size()));
  if (!std::isfinite(freqs.attention_scaling)) op_error("rope", "attention_scaling must be finite");
  Tensor pids;
  if (position_ids.defined()) {
    if (position_ids.dim() != 2 || position_ids.size(0) != x.size(0) ||
        position_ids.size(1) != x.size(1) ||
        (position_ids.dtype() != DType::I64 && position_ids.dtype() != DType::I32))
      op_error("rope", "position_ids must be I64 or I32 [B, S] = [" + std::to_string(x.size(0)) +
                           ", " + std::to_string(x.size(1)) + "] for " + x.str() + ", got " +
                           position_ids.str());
    if (position_ids.device() != x.device())
      op_error("rope",
               "position_ids must be on x's device, got " + position_ids.str() + " for " + x.str());
    pids = contiguous(position_ids);
  }
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).rope(out, xc, freqs, position_offset, pids, false);
  return record("rope", out, {xc}, [freqs, position_offset, pids](const Tensor& g) {
    Tensor gi = Tensor::empty(g.shape(), g.dtype(), g.device());
    backend_for(g.device()).rope(gi, contiguous(g), freqs, position_offset, pids, true);
    return std::vector<Tensor>{gi};
  });
}

}  // namespace accel
