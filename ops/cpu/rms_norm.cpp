// Row-wise neural-network kernels: softmax, cross-entropy, embedding, rms_norm, rope, swiglu.
// Statistics run in float (double for f64 tensors). Where Hugging Face's Llama rounds an
// intermediate to the activation dtype (rms_norm before the weight, rope's cos/sin and products,
// swiglu's silu), the 16-bit paths round there too, so bf16 results match it bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel {
namespace {
using namespace cpu;

// Accumulation type for a dtype's compute type: double for f64, float otherwise.
template <class Tr>
using AccOf = std::conditional_t<std::is_same_v<typename Tr::C, double>, double, float>;

void require(bool ok, const char* op, const std::string& msg) {
  if (!ok) throw std::logic_error(std::string("[") + op + "] " + msg);
}

// Work per row -> rows per thread chunk.
int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(row_len, 1));
}

// Splits [0, n) into up to max_threads() chunks and calls f(chunk, begin, end), so each chunk can
// own a slot of per-thread scratch.
template <class F>
int64_t chunked(int64_t n, int64_t grain, F&& f) {
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(max_threads(), (n + grain - 1) / grain));
  const int64_t per = (n + chunks - 1) / chunks;
  parallel_for(chunks, 0, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t b = c * per, e = std::min(n, b + per);
      if (b < e) f(c, b, e);
    }
  });
  return chunks;
}

// Loads the row xr[0, d) into `row` in the accumulation type; returns its max in m and the sum of
// exp(row - m) in sum (the parts of a log-sum-exp).
template <class Tr, class A>
void load_row_max_sumexp(const typename Tr::S* xr, int64_t d, std::vector<A>& row, A& m, A& sum) {
  m = -std::numeric_limits<A>::infinity();
  for (int64_t j = 0; j < d; ++j) {
    row[j] = static_cast<A>(Tr::load(xr[j]));
    m = std::max(m, row[j]);
  }
  sum = 0;
  for (int64_t j = 0; j < d; ++j) sum += std::exp(row[j] - m);
}

// The values of a contiguous i32/i64 index tensor (ids, targets) as i64.
std::vector<int64_t> indices_as_i64(const Tensor& t, const char* op) {
  const int64_t n = t.numel();
  std::vector<int64_t> out(static_cast<size_t>(n));
  dispatch_index(t.dtype(), op, [&](auto tr) {
    const auto* p = ptr<decltype(tr)>(t);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int64_t>(p[i]);
  });
  return out;
}

}  // namespace

void CpuBackend::softmax(const Tensor& out, const Tensor& x, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  require(x.is_contiguous() && out.is_contiguous() && out.shape() == x.shape() &&
              out.dtype() == x.dtype(),
          op, "needs contiguous x and out of one shape and dtype");
  if (x.numel() == 0) return;
  const int64_t d = x.dim() == 0 ? 1 : x.shape().back();
  const int64_t rows = x.numel() / d;
  dispatch_float(x.dtype(), op, [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    const auto* xp = ptr<Tr>(x);
    auto* o = ptr<Tr>(out);
    parallel_for(rows, row_grain(d), [&](int64_t rb, int64_t re) {
      std::vector<A> row(d);
      for (int64_t r = rb; r < re; ++r) {
        const auto* xr = xp + r * d;
        auto* orow = o + r * d;
        A m, s;
        load_row_max_sumexp<Tr>(xr, d, row, m, s);
        if (log) {
          const A lse = m + std::log(s);
          for (int64_t j = 0; j < d; ++j) orow[j] = Tr::store(row[j] - lse);
        } else {
          const A inv = A(1) / s;
          for (int64_t j = 0; j < d; ++j) orow[j] = Tr::store(std::exp(row[j] - m) * inv);
        }
      }
    });
  });
}

namespace {
// Targets as i64, each in [0, V) or ignore_index: validated before any parallel work.
std::vector<int64_t> checked_targets(const Tensor& targets, int64_t ignore_index,
                                     const Tensor& logits) {
  const int64_t v = logits.shape()[1];
  std::vector<int64_t> tgt = indices_as_i64(targets, "cross_entropy");
  for (size_t i = 0; i < tgt.size(); ++i) {
    if (tgt[i] != ignore_index && (tgt[i] < 0 || tgt[i] >= v))
      throw std::out_of_range("[cross_entropy] target " + std::to_string(tgt[i]) + " at row " +
                              std::to_string(i) + " is outside [0, " + std::to_string(v) +
                              ") for logits " + shape_str(logits.shape()) +
                              " (and is not ignore_index " + std::to_string(ignore_index) + ")");
  }
  return tgt;
}

void check_ce_rows(const Tensor& logits, const Tensor& targets, const Tensor& per_row,
                   const char* what) {
  require(logits.dim() == 2 && logits.is_contiguous(), "cross_entropy",
          "logits must be contiguous [N, V], got " + logits.str());
  const int64_t n = logits.shape()[0];
  require(targets.numel() == n && targets.is_contiguous() && per_row.numel() == n &&
              per_row.is_contiguous(),
          "cross_entropy", std::string("targets and ") + what + " must be contiguous [N]");
}
}  // namespace

void CpuBackend::cross_entropy(const Tensor& loss_per_row, const Tensor& lse, const Tensor& logits,
                               const Tensor& targets, int64_t ignore_index) {
  check_ce_rows(logits, targets, loss_per_row, "loss");
  if (lse.defined())
    require(lse.numel() == loss_per_row.numel() && lse.is_contiguous() &&
                lse.dtype() == loss_per_row.dtype(),
            "cross_entropy", "lse must be contiguous [N] of the loss's dtype");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  const std::vector<int64_t> tgt = checked_targets(targets, ignore_index, logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    dispatch_float(loss_per_row.dtype(), "cross_entropy", [&](auto tr_loss) {
      using TrL = decltype(tr_loss);
      const auto* lp = ptr<Tr>(logits);
      auto* loss = ptr<TrL>(loss_per_row);
      auto* lse_out = lse.defined() ? ptr<TrL>(lse) : nullptr;
      parallel_for(n, row_grain(v), [&](int64_t rb, int64_t re) {
        std::vector<A> row(v);
        for (int64_t r = rb; r < re; ++r) {
          if (tgt[r] == ignore_index) {
            loss[r] = TrL::store(0);
            if (lse_out) lse_out[r] = TrL::store(0);
            continue;
          }
          A m, s;
          load_row_max_sumexp<Tr>(lp + r * v, v, row, m, s);
          const A l = m + std::log(s);
          loss[r] = TrL::store(static_cast<typename TrL::C>(l - row[tgt[r]]));
          if (lse_out) lse_out[r] = TrL::store(static_cast<typename TrL::C>(l));
        }
      });
    });
  });
}

void CpuBackend::cross_entropy_backward(const Tensor& grad_logits, const Tensor& logits,
                                        const Tensor& lse, const Tensor& targets,
                                        int64_t ignore_index, const Tensor& scale) {
  check_ce_rows(logits, targets, lse, "lse");
  require(grad_logits.shape() == logits.shape() && grad_logits.is_contiguous() &&
              grad_logits.dtype() == logits.dtype(),
          "cross_entropy", "grad_logits must be contiguous and match logits");
  require(scale.numel() == 1 && scale.dtype() == lse.dtype(), "cross_entropy",
          "backward: scale must be one element of lse's dtype, got " + scale.str());
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  const std::vector<int64_t> tgt = checked_targets(targets, ignore_index, logits);
  dispatch_float(logits.dtype(), "cross_entropy", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    dispatch_float(lse.dtype(), "cross_entropy", [&](auto tr_lse) {
      using TrL = decltype(tr_lse);
      const auto* lp = ptr<Tr>(logits);
      const auto* lse_in = ptr<TrL>(lse);
      auto* gp = ptr<Tr>(grad_logits);
      const A k = static_cast<A>(TrL::load(ptr<TrL>(scale)[0]));
      parallel_for(n, row_grain(v), [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; ++r) {
          auto* gr = gp + r * v;
          if (tgt[r] == ignore_index) {
            std::fill(gr, gr + v, Tr::store(0));
            continue;
          }
          const A l = static_cast<A>(TrL::load(lse_in[r]));
          const auto* xr = lp + r * v;
          for (int64_t j = 0; j < v; ++j) {
            A p = std::exp(static_cast<A>(Tr::load(xr[j])) - l);
            if (j == tgt[r]) p -= A(1);
            gr[j] = Tr::store(p * k);
          }
        }
      });
    });
  });
}

namespace {
// ids as i64, each checked against [0, vocab).
std::vector<int64_t> checked_ids(const Tensor& ids, int64_t vocab, const Tensor& weight_like) {
  require(ids.is_contiguous(), "embedding", "ids must be contiguous");
  std::vector<int64_t> out = indices_as_i64(ids, "embedding");
  for (int64_t i = 0; i < ids.numel(); ++i)
    if (out[i] < 0 || out[i] >= vocab)
      throw std::out_of_range("[embedding] id " + std::to_string(out[i]) + " at flat position " +
                              std::to_string(i) + " of ids " + shape_str(ids.shape()) +
                              " is outside [0, " + std::to_string(vocab) + ") for weight " +
                              shape_str(weight_like.shape()));
  return out;
}
}  // namespace

void CpuBackend::embedding(const Tensor& out, const Tensor& weight, const Tensor& ids) {
  require(weight.dim() == 2, "embedding", "weight must be [V, D], got " + weight.str());
  const Tensor w = contiguous_copy(weight);
  const int64_t vocab = w.shape()[0], d = w.shape()[1];
  const std::vector<int64_t> id = checked_ids(ids, vocab, w);
  require(out.is_contiguous() && out.numel() == static_cast<int64_t>(id.size()) * d &&
              out.dtype() == w.dtype(),
          "embedding", "out must be contiguous [..., D] of the weight's dtype, got " + out.str());
  const size_t row_bytes = static_cast<size_t>(d) * w.element_size();
  const auto* src = static_cast<const char*>(w.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  parallel_for(static_cast<int64_t>(id.size()), row_grain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      if (row_bytes) std::memcpy(dst + i * row_bytes, src + id[i] * row_bytes, row_bytes);
  });
}

void CpuBackend::embedding_backward(const Tensor& grad_weight, const Tensor& grad_out,
                                    const Tensor& ids) {
  require(grad_weight.dim() == 2 && grad_weight.is_contiguous(), "embedding",
          "grad_weight must be contiguous [V, D], got " + grad_weight.str());
  const int64_t vocab = grad_weight.shape()[0], d = grad_weight.shape()[1];
  const std::vector<int64_t> id = checked_ids(ids, vocab, grad_weight);
  const Tensor g = contiguous_copy(grad_out);
  require(g.numel() == static_cast<int64_t>(id.size()) * d && g.dtype() == grad_weight.dtype(),
          "embedding", "grad_out " + grad_out.str() + " does not match ids and weight");
  // Group positions by id so each weight row is accumulated by one thread, at full precision, and
  // rounded once.
  std::vector<int64_t> order(id.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
  std::vector<int64_t> group_start;
  for (size_t i = 0; i < order.size(); ++i)
    if (i == 0 || id[order[i]] != id[order[i - 1]]) group_start.push_back(static_cast<int64_t>(i));
  group_start.push_back(static_cast<int64_t>(order.size()));
  const int64_t groups = static_cast<int64_t>(group_start.size()) - 1;
  dispatch_float(grad_weight.dtype(), "embedding", [&](auto tr) {
    using Tr = decltype(tr);
    using A = AccOf<Tr>;
    auto* gw = ptr<Tr>(grad_weight);
    const auto* gp = ptr<Tr>(g);
    parallel_for(groups, row_grain(d), [&](int64_t b, int64_t e) {
      std::vector<A> acc(d);
      for (int64_t k = b; k < e; ++k) {
        auto* row = gw + id[order[group_start[k]]] * d;
        for (int64_t j = 0; j < d; ++j) acc[j] = Tr::load(row[j]);
        for (int64_t p = group_start[k]; p < group_start[k + 1]; ++p) {
          const auto* src = gp + order[p] * d;
          for (int64_t j = 0; j < d; ++j) acc[j] += Tr::load(src[j]);
        }
        for (int64_t j = 0; j < d; ++j) row[j] = Tr::store(acc[j]);
      }
    });
  });
}

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
          "weight " + weight.str() + " must be [D] of x's dtype");
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
      "rms_norm", "backward: grad_out, weight or rstd do not match x " + x.str());
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
          "swiglu", "backward: shapes and dtypes must all match gate " + gate.str());
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
