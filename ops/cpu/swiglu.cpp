// swiglu(gate, up) = silu(gate) * up and its backward; the 16-bit paths round silu to the
// activation dtype, as Hugging Face's Llama does.
#include <cmath>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

void CpuBackend::swiglu(const Tensor& out, const Tensor& gate, const Tensor& up) {
  require(out.is_contiguous() && gate.shape() == out.shape() && up.shape() == out.shape() &&
              gate.dtype() == out.dtype() && up.dtype() == out.dtype(),
          "swiglu", "gate, up and out must share shape and dtype");
  const Tensor gc = contiguous_copy(gate), uc = contiguous_copy(up);
  dispatch_float(out.dtype(), "swiglu", [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    const auto* gp = ptr<Tr>(gc);
    const auto* up_ = ptr<Tr>(uc);
    auto* o = ptr<Tr>(out);
    parallel_for(out.numel(), kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const C g = Tr::load(gp[i]);
        const C silu = round_to<Tr>(g / (C(1) + std::exp(-g)));  // HF: act_fn(gate) * up
        o[i] = Tr::store(silu * Tr::load(up_[i]));
      }
    });
  });
}

void CpuBackend::swiglu_backward(const Tensor& grad_gate, const Tensor& grad_up,
                                 const Tensor& grad_out, const Tensor& gate, const Tensor& up) {
  require(grad_gate.is_contiguous() && grad_up.is_contiguous() &&
              grad_gate.shape() == gate.shape() && grad_up.shape() == up.shape() &&
              grad_out.shape() == gate.shape() && up.shape() == gate.shape() &&
              grad_gate.dtype() == gate.dtype() && grad_up.dtype() == gate.dtype() &&
              grad_out.dtype() == gate.dtype() && up.dtype() == gate.dtype(),
          "swiglu",
          [&] { return "backward: shapes and dtypes must all match gate " + gate.str(); });
  const Tensor gc = contiguous_copy(gate), uc = contiguous_copy(up), go = contiguous_copy(grad_out);
  dispatch_float(gate.dtype(), "swiglu", [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    const auto* gp = ptr<Tr>(gc);
    const auto* up_ = ptr<Tr>(uc);
    const auto* dp = ptr<Tr>(go);
    auto* gg = ptr<Tr>(grad_gate);
    auto* gu = ptr<Tr>(grad_up);
    parallel_for(gate.numel(), kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const C g = Tr::load(gp[i]), u = Tr::load(up_[i]), dout = Tr::load(dp[i]);
        const C s = C(1) / (C(1) + std::exp(-g));
        gg[i] = Tr::store(dout * u * s * (C(1) + g * (C(1) - s)));
        gu[i] = Tr::store(dout * g * s);
      }
    });
  });
}

}  // namespace accel
