// Helpers shared by the row-wise CPU kernels (softmax, cross_entropy, embedding, rms_norm, rope,
// swiglu). Statistics run in float (double for f64 tensors).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel::cpu {

// Accumulation type for a dtype's compute type: double for f64, float otherwise.
template <class Tr>
using AccOf = std::conditional_t<std::is_same_v<typename Tr::C, double>, double, float>;

// backend_require (ops/backend.h) for the CPU kernels.
template <class Msg>
void require(bool ok, const char* op, Msg&& msg) {
  backend_require(ok, op, "", std::forward<Msg>(msg));
}

// Work per row -> rows per thread chunk.
inline int64_t row_grain(int64_t row_len) {
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
inline std::vector<int64_t> indices_as_i64(const Tensor& t, const char* op) {
  const int64_t n = t.numel();
  std::vector<int64_t> out(static_cast<size_t>(n));
  dispatch_index(t.dtype(), op, [&](auto tr) {
    const auto* p = ptr<decltype(tr)>(t);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int64_t>(p[i]);
  });
  return out;
}

}  // namespace accel::cpu
