// Mixture-of-experts kernels on the CPU: topk, permute / unpermute of token rows and the grouped
// GEMM (a loop over the groups through the CPU matmul). Sums run in float (double for f64) and
// are rounded once, as the backend interface asks.
#include <cmath>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

namespace {
// torch.topk's order: larger first, NaN above every number; equal values keep index order.
template <class C>
bool ranks_above(C a, C b) {
  if (std::isnan(a)) return !std::isnan(b);
  if (std::isnan(b)) return false;
  return a > b;
}

const int64_t* i64_ptr(const Tensor& t, const char* op) {
  require(t.dtype() == DType::I64 && t.is_contiguous(), op, "index tensors must be contiguous i64");
  return static_cast<const int64_t*>(t.data_ptr());
}
}  // namespace

void CpuBackend::topk(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t k) {
  require(x.dim() == 2 && x.is_contiguous() && values.is_contiguous() && k >= 1 && k <= x.size(1) &&
              values.dtype() == x.dtype() && values.shape() == Shape{x.size(0), k} &&
              indices.shape() == values.shape(),
          "topk", [&] { return "values / indices must be [R, k] for x " + x.str(); });
  const int64_t R = x.size(0), C = x.size(1);
  auto* idx = static_cast<int64_t*>(indices.data_ptr());
  require(indices.dtype() == DType::I64 && indices.is_contiguous(), "topk", "indices must be i64");
  dispatch_float(x.dtype(), "topk", [&](auto tr) {
    using Tr = decltype(tr);
    using C_ = typename Tr::C;
    const auto* xp = ptr<Tr>(x);
    auto* vp = ptr<Tr>(values);
    parallel_for(R, row_grain(C * k), [&](int64_t b, int64_t e) {
      std::vector<C_> best(static_cast<size_t>(k));
      std::vector<int64_t> best_i(static_cast<size_t>(k));
      for (int64_t r = b; r < e; ++r) {
        const auto* row = xp + r * C;
        int64_t filled = 0;
        // Insertion into the k best so far; a later index never passes an equal value.
        for (int64_t c = 0; c < C; ++c) {
          const C_ v = Tr::load(row[c]);
          if (filled == k && !ranks_above(v, best[k - 1])) continue;
          int64_t pos = filled < k ? filled++ : k - 1;
          while (pos > 0 && ranks_above(v, best[pos - 1])) {
            best[pos] = best[pos - 1];
            best_i[pos] = best_i[pos - 1];
            --pos;
          }
          best[pos] = v;
          best_i[pos] = c;
        }
        for (int64_t j = 0; j < k; ++j) {
          vp[r * k + j] = Tr::store(best[j]);
          idx[r * k + j] = best_i[j];
        }
      }
    });
  });
}

void CpuBackend::topk_backward(const Tensor& grad_x, const Tensor& grad_values,
                               const Tensor& indices) {
  require(grad_x.dim() == 2 && grad_x.is_contiguous() && grad_values.is_contiguous() &&
              grad_values.dtype() == grad_x.dtype() && grad_values.shape() == indices.shape() &&
              grad_values.dim() == 2 && grad_values.size(0) == grad_x.size(0),
          "topk", [&] {
            return "backward: grad_values / indices must be [R, k] for grad_x " + grad_x.str();
          });
  const int64_t R = grad_x.size(0), C = grad_x.size(1), k = grad_values.size(1);
  const int64_t* idx = i64_ptr(indices, "topk");
  dispatch_float(grad_x.dtype(), "topk", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* gv = ptr<Tr>(grad_values);
    auto* gx = ptr<Tr>(grad_x);
    // The k indices of a row are distinct: plain stores.
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < k; ++j) gx[r * C + idx[r * k + j]] = gv[r * k + j];
  });
}

void CpuBackend::moe_permute(const Tensor& out, const Tensor& x, const Tensor& order,
                             int64_t top_k) {
  require(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous() &&
              out.dtype() == x.dtype() && out.size(1) == x.size(1) &&
              out.size(0) == x.size(0) * top_k && order.numel() == out.size(0),
          "moe_permute", [&] { return "out must be [N * k, H] for x " + x.str(); });
  const int64_t rows = out.size(0), H = x.size(1);
  const int64_t* ord = i64_ptr(order, "moe_permute");
  dispatch_float(x.dtype(), "moe_permute", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* xp = ptr<Tr>(x);
    auto* op = ptr<Tr>(out);
    parallel_for(rows, row_grain(H), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) std::copy_n(xp + (ord[i] / top_k) * H, H, op + i * H);
    });
  });
}

void CpuBackend::moe_permute_backward(const Tensor& grad_x, const Tensor& grad_out,
                                      const Tensor& inverse, int64_t top_k) {
  require(grad_x.dim() == 2 && grad_out.dim() == 2 && grad_x.is_contiguous() &&
              grad_out.is_contiguous() && grad_out.dtype() == grad_x.dtype() &&
              grad_out.size(1) == grad_x.size(1) && grad_out.size(0) == grad_x.size(0) * top_k &&
              inverse.numel() == grad_out.size(0),
          "moe_permute",
          [&] { return "backward: grad_out must be [N * k, H] for grad_x " + grad_x.str(); });
  const int64_t N = grad_x.size(0), H = grad_x.size(1);
  const int64_t* inv = i64_ptr(inverse, "moe_permute");
  dispatch_float(grad_x.dtype(), "moe_permute", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    const auto* go = ptr<Tr>(grad_out);
    auto* gx = ptr<Tr>(grad_x);
    parallel_for(N, row_grain(H * top_k), [&](int64_t b, int64_t e) {
      std::vector<A> acc(static_cast<size_t>(H));
      for (int64_t t = b; t < e; ++t) {
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = 0; j < top_k; ++j) {
          const auto* src = go + inv[t * top_k + j] * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += static_cast<A>(Tr::load(src[h]));
        }
        for (int64_t h = 0; h < H; ++h) gx[t * H + h] = Tr::store(acc[h]);
      }
    });
  });
}

void CpuBackend::moe_unpermute(const Tensor& out, const Tensor& y, const Tensor& weights,
                               const Tensor& inverse) {
  require(out.dim() == 2 && y.dim() == 2 && weights.dim() == 2 && out.is_contiguous() &&
              y.is_contiguous() && weights.is_contiguous() && y.dtype() == out.dtype() &&
              weights.dtype() == out.dtype() && weights.size(0) == out.size(0) &&
              y.size(0) == out.size(0) * weights.size(1) && y.size(1) == out.size(1) &&
              inverse.numel() == y.size(0),
          "moe_unpermute", [&] {
            return "y [N * k, H], weights [N, k] and out [N, H] do not line up: " + y.str() + ", " +
                   weights.str() + ", " + out.str();
          });
  const int64_t N = out.size(0), H = out.size(1), k = weights.size(1);
  const int64_t* inv = i64_ptr(inverse, "moe_unpermute");
  dispatch_float(out.dtype(), "moe_unpermute", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    const auto* yp = ptr<Tr>(y);
    const auto* wp = ptr<Tr>(weights);
    auto* op = ptr<Tr>(out);
    parallel_for(N, row_grain(H * k), [&](int64_t b, int64_t e) {
      std::vector<A> acc(static_cast<size_t>(H));
      for (int64_t t = b; t < e; ++t) {
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = 0; j < k; ++j) {
          const A w = static_cast<A>(Tr::load(wp[t * k + j]));
          const auto* src = yp + inv[t * k + j] * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += w * static_cast<A>(Tr::load(src[h]));
        }
        for (int64_t h = 0; h < H; ++h) op[t * H + h] = Tr::store(acc[h]);
      }
    });
  });
}

void CpuBackend::moe_unpermute_backward(const Tensor& grad_y, const Tensor& grad_weights,
                                        const Tensor& grad_out, const Tensor& y,
                                        const Tensor& weights, const Tensor& order) {
  require(grad_y.shape() == y.shape() && grad_weights.shape() == weights.shape() &&
              grad_y.is_contiguous() && grad_weights.is_contiguous() && grad_out.is_contiguous() &&
              y.is_contiguous() && weights.is_contiguous() && grad_out.dim() == 2 &&
              grad_out.size(0) == weights.size(0) && grad_out.size(1) == y.size(1) &&
              grad_out.dtype() == y.dtype() && grad_y.dtype() == y.dtype() &&
              grad_weights.dtype() == weights.dtype() && weights.dtype() == y.dtype() &&
              order.numel() == y.size(0),
          "moe_unpermute", [&] { return "backward: shapes do not line up with y " + y.str(); });
  const int64_t rows = y.size(0), H = y.size(1), k = weights.size(1);
  const int64_t* ord = i64_ptr(order, "moe_unpermute");
  dispatch_float(y.dtype(), "moe_unpermute", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    const auto* go = ptr<Tr>(grad_out);
    const auto* yp = ptr<Tr>(y);
    const auto* wp = ptr<Tr>(weights);
    auto* gy = ptr<Tr>(grad_y);
    auto* gw = ptr<Tr>(grad_weights);
    // Permuted row i holds slot order[i] of token order[i] / k: each grad_weights entry is
    // written by exactly one row.
    parallel_for(rows, row_grain(2 * H), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t slot = ord[i], t = slot / k;
        const A w = static_cast<A>(Tr::load(wp[slot]));
        const auto* g = go + t * H;
        const auto* yr = yp + i * H;
        A dot = 0;
        for (int64_t h = 0; h < H; ++h) {
          const A gh = static_cast<A>(Tr::load(g[h]));
          gy[i * H + h] = Tr::store(w * gh);
          dot += gh * static_cast<A>(Tr::load(yr[h]));
        }
        gw[slot] = Tr::store(dot);
      }
    });
  });
}

void CpuBackend::grouped_matmul(const std::vector<Tensor>& outs, const std::vector<Tensor>& as,
                                const std::vector<Tensor>& bs, bool trans_a, bool trans_b) {
  require(outs.size() == as.size() && as.size() == bs.size(), "grouped_linear",
          "outs, as and bs must have one entry per group");
  auto as3 = [](const Tensor& t) {
    return t.as_strided({1, t.size(0), t.size(1)}, {t.size(0) * t.size(1), t.size(1), 1},
                        t.offset());
  };
  for (size_t g = 0; g < outs.size(); ++g) {
    require(outs[g].dim() == 2 && as[g].dim() == 2 && bs[g].dim() == 2 && outs[g].is_contiguous() &&
                as[g].is_contiguous() && bs[g].is_contiguous(),
            "grouped_linear",
            [&] { return "group " + std::to_string(g) + ": operands must be 2-d row-major"; });
    if (outs[g].numel() == 0) continue;
    matmul(as3(outs[g]), as3(as[g]), as3(bs[g]), trans_a, trans_b, 1.0, 0.0, Tensor());
  }
}

}  // namespace accel
