// Reductions over a set of dims (sum in double / int64, max, max |x|), the gradient of max, the
// sum of squares over a list of tensors (fp64) and the non-finite check.
#include <cmath>
#include <limits>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel {
namespace {
using namespace cpu;

const char* reduce_name(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum:
      return "sum";
    case ReduceKind::Max:
      return "max";
    case ReduceKind::AbsMax:
      return "amax";
  }
  return "reduce";
}

template <class Acc>
struct Reducer {
  ReduceKind op;
  Acc init() const {
    if (op == ReduceKind::Max) {
      if constexpr (std::is_floating_point_v<Acc>) return -std::numeric_limits<Acc>::infinity();
      return std::numeric_limits<Acc>::lowest();
    }
    return Acc(0);
  }
  // NaN propagates through max, as in torch.
  void add(Acc& acc, Acc v) const {
    switch (op) {
      case ReduceKind::Sum:
        acc += v;
        return;
      case ReduceKind::AbsMax:
        v = v < 0 ? -v : v;
        [[fallthrough]];
      case ReduceKind::Max:
        if (acc != acc) return;
        if (!(v <= acc)) acc = v;
        return;
    }
  }
  void merge(Acc& acc, Acc v) const {
    if (op == ReduceKind::Sum)
      acc += v;
    else if (acc == acc && !(v <= acc))
      acc = v;
  }
};

}  // namespace

void CpuBackend::reduce(ReduceKind op, const Tensor& out, const Tensor& x,
                        const std::vector<int64_t>& dims) {
  const char* name = reduce_name(op);
  const int nd = static_cast<int>(x.dim());
  std::vector<bool> reduced(nd, false);
  for (int64_t d : dims) {
    if (d < 0 || d >= nd) throw std::logic_error(std::string("[") + name + "] bad dim");
    reduced[d] = true;
  }
  Shape kept_shape, kept_strides, red_shape, red_strides;
  Shape expect = x.shape();
  for (int d = 0; d < nd; ++d) {
    if (reduced[d]) {
      red_shape.push_back(x.shape()[d]);
      red_strides.push_back(x.strides()[d]);
      expect[d] = 1;
    } else {
      kept_shape.push_back(x.shape()[d]);
      kept_strides.push_back(x.strides()[d]);
    }
  }
  if (out.shape() != expect || !out.is_contiguous())
    throw std::logic_error(std::string("[") + name + "] output " + out.str() +
                           " must be contiguous with shape " + shape_str(expect));
  dispatch_numeric(x.dtype(), name, [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    using Acc = std::conditional_t<std::is_integral_v<C>, int64_t, double>;
    dispatch_numeric(out.dtype(), name, [&](auto tr_out) {
      using TrO = decltype(tr_out);
      using CO = typename TrO::C;
      const Reducer<Acc> red{op};
      const auto* xp = ptr<Tr>(x);
      auto* o = ptr<TrO>(out);
      const int64_t n_out = shape_numel(kept_shape);
      const int64_t n_red = shape_numel(red_shape);
      StridedWalk<1> out_walk(kept_shape, {&kept_strides});
      StridedWalk<1> red_walk(red_shape, {&red_strides});
      auto reduce_range = [&](int64_t base, int64_t b, int64_t e) {
        Acc acc = red.init();
        red_walk.run(b, e, [&](int64_t, const std::array<int64_t, 1>& off) {
          red.add(acc, static_cast<Acc>(Tr::load(xp[base + off[0]])));
        });
        return acc;
      };
      if (n_out >= max_threads() || n_red * n_out <= kGrain) {
        const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(n_red, 1));
        parallel_for(n_out, grain, [&](int64_t b, int64_t e) {
          out_walk.run(b, e, [&](int64_t i, const std::array<int64_t, 1>& base) {
            o[i] = TrO::store(static_cast<CO>(reduce_range(base[0], 0, n_red)));
          });
        });
        return;
      }
      // Few outputs, long reductions: split each reduction across threads.
      out_walk.run(0, n_out, [&](int64_t i, const std::array<int64_t, 1>& base) {
        std::vector<Acc> partial(max_threads(), red.init());
        std::vector<int> used(max_threads(), 0);
        const int64_t chunk = (n_red + max_threads() - 1) / max_threads();
        parallel_for(max_threads(), 0, [&](int64_t tb, int64_t te) {
          for (int64_t t = tb; t < te; ++t) {
            const int64_t b = t * chunk, e = std::min(n_red, b + chunk);
            if (b < e) {
              partial[t] = reduce_range(base[0], b, e);
              used[t] = 1;
            }
          }
        });
        Acc acc = red.init();
        for (size_t t = 0; t < partial.size(); ++t)
          if (used[t]) red.merge(acc, partial[t]);
        o[i] = TrO::store(static_cast<CO>(acc));
      });
    });
  });
}

void CpuBackend::max_backward(const Tensor& grad_in, const Tensor& x, const Tensor& out_keepdim,
                              const Tensor& grad_keepdim, int64_t dim) {
  if (grad_in.shape() != x.shape() || !grad_in.is_contiguous() || dim < 0 || dim >= x.dim())
    throw std::logic_error("[max] backward: grad_in " + grad_in.str() + " must be contiguous " +
                           "and shaped like x " + x.str());
  grad_in.zero_();
  Shape outer = x.shape();
  const int64_t len = outer[dim];
  outer[dim] = 1;
  if (out_keepdim.shape() != outer || grad_keepdim.shape() != outer)
    throw std::logic_error("[max] backward: reduced tensors must have shape " + shape_str(outer));
  const Shape gin_strides = grad_in.strides();
  const int64_t x_step = x.strides()[dim], g_step = gin_strides[dim];
  dispatch_float(x.dtype(), "max", [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    if (grad_in.dtype() != x.dtype() || out_keepdim.dtype() != x.dtype() ||
        grad_keepdim.dtype() != x.dtype())
      throw std::logic_error("[max] backward: dtypes must all be " +
                             std::string(dtype_name(x.dtype())));
    const auto* xp = ptr<Tr>(x);
    const auto* op = ptr<Tr>(out_keepdim);
    const auto* gp = ptr<Tr>(grad_keepdim);
    auto* gi = ptr<Tr>(grad_in);
    StridedWalk<4> walk(
        outer, {&x.strides(), &out_keepdim.strides(), &grad_keepdim.strides(), &gin_strides});
    walk.run(0, walk.numel(), [&](int64_t, const std::array<int64_t, 4>& off) {
      const C target = Tr::load(op[off[1]]);
      const bool nan_target = target != target;
      for (int64_t j = 0; j < len; ++j) {
        const C v = Tr::load(xp[off[0] + j * x_step]);
        if (v == target || (nan_target && v != v)) {
          gi[off[3] + j * g_step] = gp[off[2]];
          break;
        }
      }
    });
  });
}

// ---- sum of squares (the gradient norm), non-finite check ----

double CpuBackend::sum_of_squares(const std::vector<Tensor>& xs) {
  double total = 0.0;
  for (const Tensor& x : xs) {
    if (!x.defined() || x.numel() == 0) continue;
    dispatch_float(x.dtype(), "sum_of_squares", [&](auto tr) {
      using Tr = decltype(tr);
      const auto* xp = ptr<Tr>(x);
      std::vector<double> partial(static_cast<size_t>(max_threads()) + 1, 0.0);
      StridedWalk<1> walk(x.shape(), {&x.strides()});
      const int64_t n = x.numel();
      const int64_t chunks = std::min<int64_t>(max_threads(), std::max<int64_t>(1, n / kGrain));
      const int64_t per = (n + chunks - 1) / chunks;
      parallel_for(chunks, 0, [&](int64_t cb, int64_t ce) {
        for (int64_t c = cb; c < ce; ++c) {
          double s = 0.0;
          walk.run(c * per, std::min(n, (c + 1) * per),
                   [&](int64_t, const std::array<int64_t, 1>& off) {
                     const double v = Tr::load(xp[off[0]]);
                     s += v * v;
                   });
          partial[c] = s;
        }
      });
      for (double s : partial) total += s;
    });
  }
  return total;
}

bool CpuBackend::has_non_finite(const Tensor& x) {
  if (!x.defined() || x.numel() == 0 || !is_floating(x.dtype())) return false;
  bool found = false;
  dispatch_float(x.dtype(), "has_non_finite", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* xp = ptr<Tr>(x);
    StridedWalk<1> walk(x.shape(), {&x.strides()});
    const int64_t n = x.numel();
    const int64_t chunks = std::min<int64_t>(max_threads(), std::max<int64_t>(1, n / kGrain));
    const int64_t per = (n + chunks - 1) / chunks;
    std::vector<char> hit(static_cast<size_t>(chunks), 0);
    parallel_for(chunks, 0, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c)
        walk.run(c * per, std::min(n, (c + 1) * per),
                 [&](int64_t, const std::array<int64_t, 1>& off) {
                   if (!std::isfinite(static_cast<double>(Tr::load(xp[off[0]])))) hit[c] = 1;
                 });
    });
    for (char h : hit) found = found || h;
  });
  return found;
}

}  // namespace accel
