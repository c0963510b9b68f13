// softmax and log_softmax along the last dim: one pass for the max and the sum of exponentials
// (in float; double for f64), then the outputs.
#include <cmath>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

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

}  // namespace accel
