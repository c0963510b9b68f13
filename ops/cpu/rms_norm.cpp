// rms_norm, the residual add fused into it (add_rms_norm) and the backward. Statistics in float
// (double for f64); the 16-bit paths round x * rstd to the activation dtype before the weight, as
// Hugging Face's Llama does, so bf16 results match it bit for bit.
#include <cmath>
#include <utility>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

namespace {
// One row of rms_norm: orow = weight * round(xr * rstd); returns rstd. Shared by rms_norm and
// add_rms_norm so that both round alike.
template <class Tr, class A = AccOf<Tr>>
A rms_norm_row(const typename Tr::S* xr, const typename Tr::S* wp, typename Tr::S* orow, int64_t d,
               double eps) {
  double ss = 0;
  for (int64_t j = 0; j < d; ++j) {
    const double v = Tr::load(xr[j]);
    ss += v * v;
  }
  const A ms = static_cast<A>(ss / static_cast<double>(d));
  const A inv = A(1) / std::sqrt(ms + static_cast<A>(eps));
  for (int64_t j = 0; j < d; ++j) {
    // HF: weight * (x * rstd).to(input_dtype)
    const A normed = round_to<Tr>(static_cast<typename Tr::C>(Tr::load(xr[j]) * inv));
    orow[j] = Tr::store(static_cast<typename Tr::C>(Tr::load(wp[j]) * normed));
  }
  return inv;
}

// Checks shared by rms_norm and add_rms_norm; returns {d, rows}.
std::pair<int64_t, int64_t> check_norm_args(const char* op, const Tensor& out, const Tensor& rstd,
                                            const Tensor& x, const Tensor& weight) {
  require(x.is_contiguous() && out.is_contiguous() && out.shape() == x.shape() &&
              out.dtype() == x.dtype() && x.dim() >= 1,
          op, "needs contiguous x and out of one shape and dtype");
  const int64_t d = x.shape().back();
  const int64_t rows = d ? x.numel() / d : 0;
  require(weight.numel() == d && weight.dtype() == x.dtype(), op,
          [&] { return "weight " + weight.str() + " must be [D] of x's dtype"; });
  require(rstd.numel() == rows && rstd.is_contiguous(), op, "rstd must be [rows]");
  return {d, rows};
}
}  // namespace

void CpuBackend::rms_norm(const Tensor& out, const Tensor& rstd, const Tensor& x,
                          const Tensor& weight, double eps) {
  // Plain variables, not a structured binding: the lambdas below capture them (C++17).
  const std::pair<int64_t, int64_t> shape = check_norm_args("rms_norm", out, rstd, x, weight);
  const int64_t d = shape.first, rows = shape.second;
  const Tensor w = contiguous_copy(weight);
  dispatch_float(x.dtype(), "rms_norm", [&](auto tr) {
    using Tr = decltype(tr);
    dispatch_float(rstd.dtype(), "rms_norm", [&](auto tr_r) {
      using TrR = decltype(tr_r);
      const auto* xp = ptr<Tr>(x);
      const auto* wp = ptr<Tr>(w);
      auto* o = ptr<Tr>(out);
      auto* rp = ptr<TrR>(rstd);
      parallel_for(rows, row_grain(d), [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; ++r) {
          const auto inv = rms_norm_row<Tr>(xp + r * d, wp, o + r * d, d, eps);
          rp[r] = TrR::store(static_cast<typename TrR::C>(inv));
        }
      });
    });
  });
}

void CpuBackend::add_rms_norm(const Tensor& sum, const Tensor& out, const Tensor& rstd,
                              const Tensor& x, const Tensor& r, const Tensor& weight, double eps) {
  // Plain variables, not a structured binding: the lambdas below capture them (C++17).
  const std::pair<int64_t, int64_t> shape = check_norm_args("add_rms_norm", out, rstd, x, weight);
  const int64_t d = shape.first, rows = shape.second;
  require(r.is_contiguous() && r.shape() == x.shape() && r.dtype() == x.dtype() &&
              sum.is_contiguous() && sum.shape() == x.shape() && sum.dtype() == x.dtype(),
          "add_rms_norm", "needs contiguous x, r and sum of one shape and dtype");
  const Tensor w = contiguous_copy(weight);
  dispatch_float(x.dtype(), "add_rms_norm", [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    dispatch_float(rstd.dtype(), "add_rms_norm", [&](auto tr_r) {
      using TrR = decltype(tr_r);
      const auto* xp = ptr<Tr>(x);
      const auto* rp_in = ptr<Tr>(r);
      const auto* wp = ptr<Tr>(w);
      auto* sp = ptr<Tr>(sum);
      auto* o = ptr<Tr>(out);
      auto* rp = ptr<TrR>(rstd);
      parallel_for(rows, row_grain(d), [&](int64_t rb, int64_t re) {
        for (int64_t row = rb; row < re; ++row) {
          const int64_t base = row * d;
          // Exactly binary Add: the sum in the compute type, stored (rounded) once.
          for (int64_t j = 0; j < d; ++j)
            sp[base + j] = Tr::store(C(Tr::load(xp[base + j]) + Tr::load(rp_in[base + j])));
          const auto inv = rms_norm_row<Tr>(sp + base, wp, o + base, d, eps);
          rp[row] = TrR::store(static_cast<typename TrR::C>(inv));
        }
      });
    });
  });
}

void CpuBackend::rms_norm_backward(const Tensor& grad_x, const Tensor& grad_weight,
                                   const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                   const Tensor& rstd, const Tensor& grad_x_add) {
  require(x.is_contiguous() && x.dim() >= 1, "rms_norm", "x must be contiguous");
  const int64_t d = x.shape().back();
  const int64_t rows = d ? x.numel() / d : 0;
  const Tensor g = contiguous_copy(grad_out);
  const Tensor w = contiguous_copy(weight);
  require(
      g.shape() == x.shape() && g.dtype() == x.dtype() && w.numel() == d && rstd.numel() == rows,
      "rms_norm", [&] { return "backward: grad_out, weight or rstd do not match x " + x.str(); });
  if (grad_x.defined())
    require(grad_x.is_contiguous() && grad_x.shape() == x.shape() && grad_x.dtype() == x.dtype(),
            "rms_norm", "grad_x must be contiguous and match x");
  // The pending gradient to fold in (contiguous: a strided one is copied first).
  const Tensor gadd = grad_x_add.defined() ? contiguous_copy(grad_x_add) : Tensor();
  if (gadd.defined())
    require(grad_x.defined() && gadd.shape() == x.shape() && gadd.dtype() == x.dtype(), "rms_norm",
            "grad_x_add must match x and needs grad_x");
  if (grad_weight.defined())
    require(
        grad_weight.is_contiguous() && grad_weight.numel() == d && grad_weight.dtype() == w.dtype(),
        "rms_norm", "grad_weight must be contiguous and match weight");
  dispatch_float(x.dtype(), "rms_norm", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    dispatch_float(rstd.dtype(), "rms_norm", [&](auto tr_r) {
      using TrR = decltype(tr_r);
      const auto* xp = ptr<Tr>(x);
      const auto* wp = ptr<Tr>(w);
      const auto* gp = ptr<Tr>(g);
      const auto* rp = ptr<TrR>(rstd);
      auto* gx = grad_x.defined() ? ptr<Tr>(grad_x) : nullptr;
      const auto* ga = gadd.defined() ? ptr<Tr>(gadd) : nullptr;
      std::vector<std::vector<double>> partial(static_cast<size_t>(max_threads()));
      const int64_t chunks = chunked(rows, row_grain(d), [&](int64_t c, int64_t rb, int64_t re) {
        std::vector<double>& dw = partial[c];
        dw.assign(d, 0.0);
        for (int64_t r = rb; r < re; ++r) {
          const auto* xr = xp + r * d;
          const auto* gr = gp + r * d;
          const A inv = static_cast<A>(TrR::load(rp[r]));
          A dot = 0;  // sum_j x_j * w_j * g_j
          for (int64_t j = 0; j < d; ++j) {
            const A xv = Tr::load(xr[j]), gv = Tr::load(gr[j]);
            dot += xv * static_cast<A>(Tr::load(wp[j])) * gv;
            dw[j] += static_cast<double>(gv * xv * inv);
          }
          if (!gx) continue;
          const A c2 = inv * inv * dot / static_cast<A>(d);
          for (int64_t j = 0; j < d; ++j) {
            const A xv = Tr::load(xr[j]), gv = Tr::load(gr[j]);
            A v = inv * (static_cast<A>(Tr::load(wp[j])) * gv - xv * c2);
            if (ga) v += static_cast<A>(Tr::load(ga[r * d + j]));
            gx[r * d + j] = Tr::store(static_cast<typename Tr::C>(v));
          }
        }
      });
      if (!grad_weight.defined()) return;
      std::vector<double> total(d, 0.0);
      for (int64_t c = 0; c < chunks; ++c)
        if (!partial[c].empty())
          for (int64_t j = 0; j < d; ++j) total[j] += partial[c][j];
      auto* gw = ptr<Tr>(grad_weight);
      for (int64_t j = 0; j < d; ++j) gw[j] = Tr::store(static_cast<typename Tr::C>(total[j]));
    });
  });
}

}  // namespace accel
