// Helpers shared by the op wrappers in ops/*.cpp (not part of the public interface).
#pragma once

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

// Rows [begin, begin + rows) of a contiguous 2-d tensor, as a 2-d contiguous view.
Tensor row_block(const Tensor& t, int64_t begin, int64_t rows);
// grouped_linear's arguments (ops/ops.h): x [N, in] floating, one weight [out, in] per group, of
// x's dtype and device, and group sizes that are not negative and sum to N.
void check_grouped_linear(const char* op, const Tensor& x, const std::vector<Tensor>& weights,
                          const std::vector<int64_t>& group_sizes);

}  // namespace accel::detail
