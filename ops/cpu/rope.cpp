// Rotary position embeddings (and the inverse rotation for the backward). The 16-bit paths round
// cos/sin and the products to the activation dtype where Hugging Face's Llama does.
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

namespace {
// cos/sin of angle (position_offset + s) * inv_freq[i] for s < S, i < D/2, as [S][D/2]. For f64
// everything is double; otherwise float32 exactly as Hugging Face computes it: inv_freq =
// 1 / theta^(float(2i) / D) in float, angle = float(pos) * inv_freq in float, cos/sin in float.
template <class A>
void rope_table(int64_t s_len, int64_t half, int64_t d, double theta, int64_t position_offset,
                std::vector<A>& cos_t, std::vector<A>& sin_t) {
  cos_t.resize(static_cast<size_t>(s_len * half));
  sin_t.resize(static_cast<size_t>(s_len * half));
  std::vector<A> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    if constexpr (std::is_same_v<A, double>) {
      inv[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(d));
    } else {
      const float expo = static_cast<float>(2 * i) / static_cast<float>(d);
      inv[i] = 1.0f / std::pow(static_cast<float>(theta), expo);
    }
  }
  for (int64_t s = 0; s < s_len; ++s) {
    const A pos = static_cast<A>(position_offset + s);
    for (int64_t i = 0; i < half; ++i) {
      const A angle = pos * inv[i];
      cos_t[s * half + i] = std::cos(angle);
      sin_t[s * half + i] = std::sin(angle);
    }
  }
}
}  // namespace

void CpuBackend::rope(const Tensor& out, const Tensor& x, double theta, int64_t position_offset,
                      bool inverse) {
  require(x.dim() == 4 && x.is_contiguous() && out.is_contiguous() && out.shape() == x.shape() &&
              out.dtype() == x.dtype() && x.shape()[3] % 2 == 0,
          "rope", "needs contiguous [B, S, H, D] x and out with D even, got " + x.str());
  const int64_t b_len = x.shape()[0], s_len = x.shape()[1], h_len = x.shape()[2], d = x.shape()[3],
                half = d / 2;
  if (x.numel() == 0) return;
  dispatch_float(x.dtype(), "rope", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    using C = typename Tr::C;
    std::vector<A> cos_t, sin_t;
    rope_table<A>(s_len, half, d, theta, position_offset, cos_t, sin_t);
    const auto* xp = ptr<Tr>(x);
    auto* o = ptr<Tr>(out);
    const int64_t rows = b_len * s_len * h_len;
    parallel_for(rows, row_grain(d), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const int64_t s = (r / h_len) % s_len;
        const A* ct = cos_t.data() + s * half;
        const A* st = sin_t.data() + s * half;
        const auto* xr = xp + r * d;
        auto* orow = o + r * d;
        for (int64_t i = 0; i < half; ++i) {
          const C x1 = Tr::load(xr[i]), x2 = Tr::load(xr[i + half]);
          if (!inverse) {
            // HF in the activation dtype: (x * cos) + (rotate_half(x) * sin), each op rounded.
            const C c = round_to<Tr>(static_cast<C>(ct[i])),
                    sn = round_to<Tr>(static_cast<C>(st[i]));
            orow[i] = Tr::store(round_to<Tr>(x1 * c) + round_to<Tr>(-x2 * sn));
            orow[i + half] = Tr::store(round_to<Tr>(x2 * c) + round_to<Tr>(x1 * sn));
          } else {
            const A c = ct[i], sn = st[i];
            orow[i] = Tr::store(static_cast<C>(x1 * c + x2 * sn));
            orow[i + half] = Tr::store(static_cast<C>(x2 * c - x1 * sn));
          }
        }
      }
    });
  });
}

}  // namespace accel
