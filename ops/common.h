// Helpers shared by the op wrappers in ops/*.cpp (not part of the public interface).
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/backend.h"

namespace accel::detail {

[[noreturn]] inline void op_error(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

int64_t normalize_dim(const char* op, int64_t dim, int64_t ndim);
Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b);
// A stride-0 view of x with `shape` (no autograd), for passing broadcast inputs to a backend.
Tensor expand_raw(const Tensor& x, const Shape& shape);
void check_same_device(const char* op, const Tensor& a, const Tensor& b);
void check_same_dtype(const char* op, const Tensor& a, const Tensor& b);
void check_defined(const char* op, const Tensor& x, const char* what);
void check_floating(const char* op, const Tensor& x);
// A residual added to an op's output (undefined: none) has the output's shape and x's dtype and
// device (linear, fp8_swiglu_mlp).
void check_residual(const char* op, const Tensor& residual, const Tensor& x,
                    const Shape& out_shape);

// Rows [begin, begin + rows) of a contiguous 2-d tensor, as a 2-d contiguous view.
Tensor row_block(const Tensor& t, int64_t begin, int64_t rows);
// grouped_linear's arguments (ops/ops.h): x [N, in] floating, one weight [out, in] per group, of
// x's dtype and device, and group sizes that are not negative and sum to N.
void check_grouped_linear(const char* op, const Tensor& x, const std::vector<Tensor>& weights,
                          const std::vector<int64_t>& group_sizes);

// The LM head's GEMMs for chunked_linear_cross_entropy, over row chunks of x2 [N, D] and a weight
// [V, D] (both detached and contiguous): in the compute dtype (linear_cross_entropy) or as
// fp8_linear runs them (fp8_linear_cross_entropy, ops/fp8.cpp).
class ChunkedLinear {
 public:
  virtual ~ChunkedLinear() = default;
  // Every chunk but the last holds a multiple of this many rows.
  virtual int64_t row_multiple() const { return 1; }
  // The logits [n, V] (x's dtype, contiguous) of rows [r0, r0 + n), valid until the next call;
  // the caller may overwrite them (with their gradient).
  virtual Tensor logits(int64_t r0, int64_t n) = 0;
  // For the gradient g [n, V] of the latest logits (possibly in their buffer): their rows' x
  // gradient into gx ([n, D], undefined when x needs none), and the weight's part of its
  // gradient kept.
  virtual void backward(int64_t r0, int64_t n, const Tensor& g, const Tensor& gx) = 0;
  // After the last chunk: the weight's gradient in its dtype (undefined when it needs none).
  virtual Tensor weight_grad() = 0;
};
// Makes the GEMMs for (x2, weight, x needs a gradient, the weight needs one).
using ChunkedLinearFactory = std::function<std::unique_ptr<ChunkedLinear>(
    const Tensor& x2, const Tensor& weight, bool need_x, bool need_w)>;

// cross_entropy(linear(x, weight), targets) over row chunks with the GEMMs `make` gives
// (linear_cross_entropy's arguments, ops/ops.h; x and weight may differ in dtype where the GEMMs
// take that: the logits and x's gradient are in x's dtype).
Tensor chunked_linear_cross_entropy(const char* op, const Tensor& x, const Tensor& weight,
                                    const Tensor& targets, int64_t ignore_index, int64_t chunk_rows,
                                    double grad_scale, const ChunkedLinearFactory& make);

}  // namespace accel::detail
