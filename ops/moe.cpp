// Mixture-of-experts ops: topk, the routing plan (built on the host), permute / unpermute of the
// tokens to and from expert order, and the grouped linear layer of the experts. The kernels are
// the backends' (cpu/moe.cpp, cuda/); the checks and the autograd records live here.
#include <numeric>

#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {

void check_index_dtype(const char* op, const Tensor& t, const char* what) {
  if (t.dtype() != DType::I32 && t.dtype() != DType::I64)
    op_error(op, std::string(what) + " must be i32 or i64, got " + t.str());
}

// The routing's index tensors, checked against the tokens an op is given.
void check_routing(const char* op, const MoeRouting& r, int64_t tokens, const char* what,
                   Device device) {
  if (!r.order.defined() || !r.inverse.defined())
    op_error(op, "the routing has no order / inverse (build it with moe_routing)");
  const int64_t slots = r.num_tokens * r.top_k;
  if (r.order.dim() != 1 || r.order.size(0) != slots || r.inverse.dim() != 1 ||
      r.inverse.size(0) != slots || r.order.dtype() != DType::I64 ||
      r.inverse.dtype() != DType::I64)
    op_error(op, "the routing's order " + r.order.str() + " / inverse " + r.inverse.str() +
                     " are not i64 [num_tokens * top_k = " + std::to_string(slots) + "]");
  if (tokens != r.num_tokens)
    op_error(op, std::string(what) + " has " + std::to_string(tokens) +
                     " rows, but the routing is for " + std::to_string(r.num_tokens) + " tokens");
  if (r.order.device() != device)
    op_error(op, std::string("the routing lives on ") + r.order.device().str() + ", " + what +
                     " on " + device.str() + " (build it from expert ids on the same device)");
}

}  // namespace

namespace detail {

Tensor row_block(const Tensor& t, int64_t begin, int64_t rows) {
  const int64_t cols = t.size(1);
  return t.as_strided({rows, cols}, {cols, 1}, t.offset() + begin * cols);
}

void check_grouped_linear(const char* op, const Tensor& x, const std::vector<Tensor>& weights,
                          const std::vector<int64_t>& group_sizes) {
  check_defined(op, x, "x");
  check_floating(op, x);
  if (x.dim() != 2) op_error(op, "x must be [rows, in], got " + x.str());
  if (weights.empty()) op_error(op, "needs at least one weight");
  if (group_sizes.size() != weights.size())
    op_error(op, std::to_string(group_sizes.size()) + " group sizes for " +
                     std::to_string(weights.size()) + " weights");
  const int64_t in = x.size(1);
  for (size_t g = 0; g < weights.size(); ++g) {
    const std::string what = "weights[" + std::to_string(g) + "]";
    check_defined(op, weights[g], what.c_str());
    check_same_device(op, x, weights[g]);
    check_same_dtype(op, x, weights[g]);
    if (weights[g].dim() != 2 || weights[g].size(1) != in ||
        weights[g].shape() != weights[0].shape())
      op_error(op, what + " " + weights[g].str() + " must be [out, in] like weights[0] " +
                       weights[0].str() + ", with in = " + std::to_string(in) + " (x's columns)");
    if (group_sizes[g] < 0)
      op_error(op, "group_sizes[" + std::to_string(g) + "] = " + std::to_string(group_sizes[g]) +
                       " is negative");
  }
  const int64_t total = std::accumulate(group_sizes.begin(), group_sizes.end(), int64_t{0});
  if (total != x.size(0))
    op_error(op, "group sizes sum to " + std::to_string(total) + ", but x has " +
                     std::to_string(x.size(0)) + " rows");
}

}  // namespace detail

using detail::row_block;

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k) {
  detail::check_defined("topk", x, "x");
  detail::check_floating("topk", x);
  if (x.dim() < 1) op_error("topk", "x must have at least one dimension, got " + x.str());
  const int64_t C = x.size(-1);
  if (k < 1 || k > C)
    op_error("topk", "k must be in [1, " + std::to_string(C) + "] (the last dim of " + x.str() +
                         "), got " + std::to_string(k));
  const int64_t R = C == 0 ? 0 : x.numel() / C;
  Tensor xc = contiguous(x).detach();
  Tensor x2 = xc.as_strided({R, C}, {C, 1}, xc.offset());
  Shape out_shape = x.shape();
  out_shape.back() = k;
  Tensor values = Tensor::empty({R, k}, x.dtype(), x.device());
  Tensor indices = Tensor::empty({R, k}, DType::I64, x.device());
  if (R > 0) backend_for(x.device()).topk(values, indices, x2, k);
  values = values.as_strided(out_shape, contiguous_strides(out_shape), 0);
  indices = indices.as_strided(out_shape, contiguous_strides(out_shape), 0);
  const Shape x_shape = x.shape();
  Tensor recorded = record("topk", values, {x}, [indices, R, C, k, x_shape](const Tensor& g) {
    Tensor gx = Tensor::zeros({R, C}, g.dtype(), g.device());
    Tensor gc = contiguous(g);
    if (R > 0)
      backend_for(g.device())
          .topk_backward(gx, gc.as_strided({R, k}, {k, 1}, gc.offset()),
                         indices.as_strided({R, k}, {k, 1}, 0));
    return std::vector<Tensor>{gx.as_strided(x_shape, contiguous_strides(x_shape), 0)};
  });
  return {recorded, indices};
}

MoeRouting moe_routing(const Tensor& expert_ids, int64_t num_experts) {
  detail::check_defined("moe_routing", expert_ids, "expert_ids");
  check_index_dtype("moe_routing", expert_ids, "expert_ids");
  if (expert_ids.dim() != 2)
    op_error("moe_routing", "expert_ids must be [num_tokens, top_k], got " + expert_ids.str());
  if (num_experts < 1)
    op_error("moe_routing", "num_experts must be positive, got " + std::to_string(num_experts));
  MoeRouting r;
  r.num_tokens = expert_ids.size(0);
  r.top_k = expert_ids.size(1);
  r.num_experts = num_experts;
  if (r.top_k < 1 && r.num_tokens > 0)
    op_error("moe_routing", "expert_ids has no choices per token: " + expert_ids.str());
  // The plan is made on the host: a stable counting sort of the slots by expert.
  const std::vector<double> ids = expert_ids.to(Device::cpu()).to_vector();
  const int64_t slots = r.num_tokens * r.top_k;
  r.expert_counts.assign(static_cast<size_t>(num_experts), 0);
  for (int64_t s = 0; s < slots; ++s) {
    const double e = ids[static_cast<size_t>(s)];
    if (!(e >= 0 && e < static_cast<double>(num_experts)))
      op_error("moe_routing", "expert_ids[" + std::to_string(s / r.top_k) + ", " +
                                  std::to_string(s % r.top_k) +
                                  "] = " + std::to_string(static_cast<int64_t>(e)) +
                                  " is not in [0, " + std::to_string(num_experts) + ")");
    ++r.expert_counts[static_cast<size_t>(e)];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_experts), 0);
  for (int64_t e = 1; e < num_experts; ++e)
    next[static_cast<size_t>(e)] = next[static_cast<size_t>(e - 1)] + r.expert_counts[e - 1];
  std::vector<int64_t> order(static_cast<size_t>(slots)), inverse(static_cast<size_t>(slots));
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t row = next[static_cast<size_t>(ids[static_cast<size_t>(s)])]++;
    order[static_cast<size_t>(row)] = s;
    inverse[static_cast<size_t>(s)] = row;
  }
  r.order = Tensor::from_vector(order, {slots}, DType::I64, expert_ids.device());
  r.inverse = Tensor::from_vector(inverse, {slots}, DType::I64, expert_ids.device());
  return r;
}

Tensor moe_permute(const Tensor& x, const MoeRouting& routing) {
  detail::check_defined("moe_permute", x, "x");
  detail::check_floating("moe_permute", x);
  if (x.dim() != 2) op_error("moe_permute", "x must be [num_tokens, hidden], got " + x.str());
  check_routing("moe_permute", routing, x.size(0), "x", x.device());
  const int64_t k = routing.top_k, H = x.size(1);
  Tensor xc = contiguous(x).detach();
  Tensor out = Tensor::empty({routing.num_tokens * k, H}, x.dtype(), x.device());
  if (out.numel() > 0) backend_for(x.device()).moe_permute(out, xc, routing.order, k);
  Tensor inverse = routing.inverse;
  const int64_t N = routing.num_tokens;
  return record("moe_permute", out, {x}, [inverse, k, N, H](const Tensor& g) {
    Tensor gx = Tensor::empty({N, H}, g.dtype(), g.device());
    if (gx.numel() > 0) backend_for(g.device()).moe_permute_backward(gx, contiguous(g), inverse, k);
    return std::vector<Tensor>{gx};
  });
}

Tensor moe_unpermute(const Tensor& y, const Tensor& weights, const MoeRouting& routing) {
  detail::check_defined("moe_unpermute", y, "y");
  detail::check_defined("moe_unpermute", weights, "weights");
  detail::check_floating("moe_unpermute", y);
  detail::check_same_device("moe_unpermute", y, weights);
  detail::check_same_dtype("moe_unpermute", y, weights);
  const int64_t N = routing.num_tokens, k = routing.top_k;
  if (weights.dim() != 2 || weights.size(0) != N || weights.size(1) != k)
    op_error("moe_unpermute", "weights must be [num_tokens, top_k] = [" + std::to_string(N) + ", " +
                                  std::to_string(k) + "], got " + weights.str());
  if (y.dim() != 2 || y.size(0) != N * k)
    op_error("moe_unpermute", "y must be [num_tokens * top_k = " + std::to_string(N * k) +
                                  ", hidden], got " + y.str());
  check_routing("moe_unpermute", routing, N, "weights", y.device());
  const int64_t H = y.size(1);
  Tensor yc = contiguous(y).detach(), wc = contiguous(weights).detach();
  Tensor out = Tensor::empty({N, H}, y.dtype(), y.device());
  if (out.numel() > 0) backend_for(y.device()).moe_unpermute(out, yc, wc, routing.inverse);
  Tensor order = routing.order;
  return record("moe_unpermute", out, {y, weights}, [yc, wc, order](const Tensor& g) {
    Tensor gy = Tensor::empty(yc.shape(), yc.dtype(), yc.device());
    Tensor gw = Tensor::empty(wc.shape(), wc.dtype(), wc.device());
    if (yc.size(0) > 0)
      backend_for(g.device()).moe_unpermute_backward(gy, gw, contiguous(g), yc, wc, order);
    return std::vector<Tensor>{gy, gw};
  });
}

Tensor grouped_linear(const Tensor& x, const std::vector<Tensor>& weights,
                      const std::vector<int64_t>& group_sizes) {
  detail::check_grouped_linear("grouped_linear", x, weights, group_sizes);
  const int64_t out_features = weights[0].size(0);
  Tensor xc = contiguous(x).detach();
  std::vector<Tensor> wc;
  for (const Tensor& w : weights) wc.push_back(contiguous(w).detach());
  // Views of each group's rows (one GEMM per group, grouped into one call where it can be).
  auto blocks = [sizes = group_sizes](const Tensor& t) {
    std::vector<Tensor> v;
    int64_t begin = 0;
    for (int64_t n : sizes) {
      v.push_back(row_block(t, begin, n));
      begin += n;
    }
    return v;
  };
  Tensor out = keep_output("grouped_linear", [&] {
    Tensor o = Tensor::empty({x.size(0), out_features}, x.dtype(), x.device());
    backend_for(x.device()).grouped_matmul(blocks(o), blocks(xc), wc, false, true);
    return o;
  });
  std::vector<Tensor> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  std::vector<bool> need;
  for (const Tensor& t : inputs) need.push_back(t.requires_grad());
  return record("grouped_linear", out, inputs, [xc, wc, blocks, need](const Tensor& g) {
    Tensor gc = contiguous(g);
    const std::vector<Tensor> g_blocks = blocks(gc);
    std::vector<Tensor> grads(1 + wc.size());
    Backend& b = backend_for(gc.device());
    if (need[0]) {
      grads[0] = Tensor::empty(xc.shape(), xc.dtype(), xc.device());
      b.grouped_matmul(blocks(grads[0]), g_blocks, wc, false, false);  // g_g @ W_g
    }
    bool any_weight = false;
    for (size_t i = 1; i < need.size(); ++i) any_weight |= need[i];
    if (any_weight) {
      std::vector<Tensor> gw;
      for (const Tensor& w : wc) gw.push_back(Tensor::empty(w.shape(), w.dtype(), w.device()));
      b.grouped_matmul(gw, g_blocks, blocks(xc), true, false);  // g_g^T @ x_g
      for (size_t i = 0; i < gw.size(); ++i)
        if (need[i + 1]) grads[i + 1] = gw[i];
    }
    return grads;
  });
}

}  // namespace accel
