// Embedding lookup and its backward (rows grouped by id, so each weight row is summed at full
// precision and rounded once).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/rows.h"

namespace accel {
using namespace cpu;

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
  require(weight.dim() == 2, "embedding",
          [&] { return "weight must be [V, D], got " + weight.str(); });
  const Tensor w = contiguous_copy(weight);
  const int64_t vocab = w.shape()[0], d = w.shape()[1];
  const std::vector<int64_t> id = checked_ids(ids, vocab, w);
  require(out.is_contiguous() && out.numel() == static_cast<int64_t>(id.size()) * d &&
              out.dtype() == w.dtype(),
          "embedding", [&] {
            return "out must be contiguous [..., D] of the weight's dtype, got " + out.str();
          });
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
          [&] { return "grad_weight must be contiguous [V, D], got " + grad_weight.str(); });
  const int64_t vocab = grad_weight.shape()[0], d = grad_weight.shape()[1];
  const std::vector<int64_t> id = checked_ids(ids, vocab, grad_weight);
  const Tensor g = contiguous_copy(grad_out);
  require(g.numel() == static_cast<int64_t>(id.size()) * d && g.dtype() == grad_weight.dtype(),
          "embedding",
          [&] { return "grad_out " + grad_out.str() + " does not match ids and weight"; });
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

}  // namespace accel
