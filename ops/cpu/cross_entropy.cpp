// Cross-entropy over rows of logits and its backward from the forward's log-sum-exp (in float;
// double for f64).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

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
          [&] { return "logits must be contiguous [N, V], got " + logits.str(); });
  const int64_t n = logits.shape()[0];
  require(targets.numel() == n && targets.is_contiguous() && per_row.numel() == n &&
              per_row.is_contiguous(),
          "cross_entropy",
          [&] { return std::string("targets and ") + what + " must be contiguous [N]"; });
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
          [&] { return "backward: scale must be one element of lse's dtype, got " + scale.str(); });
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

}  // namespace accel
