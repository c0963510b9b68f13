// Rotary position embeddings (and the inverse rotation for the backward). The 16-bit paths round
// cos/sin and the products to the activation dtype where Hugging Face's Llama does.
#include <cmath>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

namespace {
// cos/sin (times attention_scaling) of the angle p * inv_freq[i] for each table row's position p
// and i < D/2, as [rows][D/2]. For f64 the angle and cos/sin are double (of the float32
// inv_freq); otherwise float32 exactly as Hugging Face computes them: angle = float(p) *
// inv_freq in float, cos/sin in float, then the product with the scaling in float.
template <class A>
void rope_table(const std::vector<int64_t>& positions, const RopeFrequencies& f,
                std::vector<A>& cos_t, std::vector<A>& sin_t) {
  const size_t half = f.inv_freq.size();
  cos_t.resize(positions.size() * half);
  sin_t.resize(positions.size() * half);
  const A scale = static_cast<A>(f.attention_scaling);
  for (size_t r = 0; r < positions.size(); ++r) {
    const A pos = static_cast<A>(positions[r]);
    for (size_t i = 0; i < half; ++i) {
      const A angle = pos * static_cast<A>(f.inv_freq[i]);
      cos_t[r * half + i] = std::cos(angle) * scale;
      sin_t[r * half + i] = std::sin(angle) * scale;
    }
  }
}
}  // namespace

void CpuBackend::rope(const Tensor& out, const Tensor& x, const RopeFrequencies& freqs,
                      int64_t position_offset, const Tensor& position_ids, bool inverse) {
  require(rope_layout_ok(out, x, freqs), "rope", [&] { return rope_layout_error(x); });
  const int64_t b_len = x.shape()[0], s_len = x.shape()[1], h_len = x.shape()[2], d = x.shape()[3],
                half = d / 2;
  if (x.numel() == 0) return;
  // One table row per sequence position, or per token when the positions are given.
  std::vector<int64_t> positions;
  if (position_ids.defined()) {
    require(position_ids.is_contiguous() && position_ids.numel() == b_len * s_len, "rope",
            [&] { return "position_ids must be contiguous [B, S], got " + position_ids.str(); });
    for (double p : position_ids.to_vector()) positions.push_back(static_cast<int64_t>(p));
  } else {
    for (int64_t s = 0; s < s_len; ++s) positions.push_back(position_offset + s);
  }
  const bool per_token = position_ids.defined();
  dispatch_float(x.dtype(), "rope", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    using C = typename Tr::C;
    std::vector<A> cos_t, sin_t;
    rope_table<A>(positions, freqs, cos_t, sin_t);
    const auto* xp = ptr<Tr>(x);
    auto* o = ptr<Tr>(out);
    const int64_t rows = b_len * s_len * h_len;
    parallel_for(rows, row_grain(d), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const int64_t token = r / h_len;  // b * S + s
        const int64_t row = per_token ? token : token % s_len;
        const A* ct = cos_t.data() + row * half;
        const A* st = sin_t.data() + row * half;
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
