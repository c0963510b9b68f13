// Tensor: a cheap shared handle to storage + dtype + shape + strides + offset + device, with the
// autograd state of the value it names. Copying a Tensor copies the handle, not the data.
//
// Math, including the differentiable views (reshape, transpose, narrow, expand ...), lives in
// ops/ops.h as free functions. This header holds what every layer needs: metadata, factories,
// raw data access, device/dtype moves and the autograd hooks.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/dtype.h"

namespace accel {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3]"
// Largest element count of a tensor: its bytes in the widest dtype (8 bytes) still fit in int64.
constexpr int64_t kMaxNumel = INT64_MAX / 8;
// The element count of `s`, or -1 when a dimension is negative or the count exceeds kMaxNumel.
int64_t checked_numel(const Shape& s);
// The element count; throws std::length_error when it exceeds kMaxNumel (an overflowed count
// would allocate too little and be written past its end).
int64_t shape_numel(const Shape& s);
// Row-major strides; throws std::length_error when they overflow (a zero-size shape whose other
// dimensions multiply past kMaxNumel).
Shape contiguous_strides(const Shape& s);

struct Node;
class Tensor;
// Called once for a leaf tensor when its gradient for the current backward pass is complete.
using GradReadyHook = std::function<void(const Tensor& leaf)>;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  DType dtype = DType::F32;
  Shape shape;
  Shape strides;       // in elements
  int64_t offset = 0;  // in elements

  // Autograd.
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  std::shared_ptr<TensorImpl> grad;
  std::vector<GradReadyHook> grad_ready_hooks;
  std::string name;  // parameter name, for messages
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  DType dtype() const { return impl_->dtype; }
  const Shape& shape() const { return impl_->shape; }
  const Shape& strides() const { return impl_->strides; }
  int64_t offset() const { return impl_->offset; }
  int64_t dim() const { return static_cast<int64_t>(impl_->shape.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(impl_->shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
  size_t element_size() const { return dtype_size(dtype()); }
  Device device() const { return impl_->storage->device; }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl_->storage; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& o) const { return impl_ == o.impl_; }
  std::string str() const;  // "Tensor(f32, [2, 3], cpu)"

  // Address of element 0 (storage + offset). data<T>() checks T against dtype().
  void* data_ptr() const;
  template <class T>
  T* data() const;
  // Value of a one-element tensor as double (any device, any dtype).
  double item() const;
  // Copy out/in as float64 values in logical (row-major) order; for tests and small tensors.
  std::vector<double> to_vector() const;

  // Factories. `category` only matters for memory accounting.
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(),
                      MemCategory category = MemCategory::Activations);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(),
                      MemCategory category = MemCategory::Activations);
  static Tensor ones(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32,
                     Device device = Device::cpu());
  static Tensor arange(int64_t n, DType dtype = DType::I64, Device device = Device::cpu());
  // From host values in row-major order, converted (rounded) to dtype.
  static Tensor from_vector(const std::vector<double>& values, const Shape& shape,
                            DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape,
                            DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape,
                            DType dtype = DType::I64, Device device = Device::cpu());
  // A tensor viewing `storage` with the given layout (no copy, no autograd).
  static Tensor from_storage(std::shared_ptr<Storage> storage, DType dtype, const Shape& shape,
                             const Shape& strides, int64_t offset);

  // Non-differentiable layout change sharing storage; ops/ wraps it with autograd.
  Tensor as_strided(const Shape& shape, const Shape& strides, int64_t offset) const;

  // Copies. These are not recorded by autograd: the result is a new leaf.
  Tensor to(Device device) const;
  Tensor clone(MemCategory category = MemCategory::Activations) const;  // contiguous copy
  // Copy src into this tensor element by element (shapes must match; dtypes may differ; any
  // strides; devices may differ when both sides are contiguous).
  void copy_(const Tensor& src) const;
  void fill_(double value) const;
  void zero_() const { fill_(0.0); }

  // Autograd.
  bool requires_grad() const { return impl_->requires_grad; }
  const Tensor& set_requires_grad(bool r = true) const;
  Tensor grad() const;
  void set_grad(const Tensor& g) const;
  void zero_grad() const;  // drops the gradient (set to none)
  const std::shared_ptr<Node>& grad_fn() const { return impl_->grad_fn; }
  bool is_leaf() const { return impl_->grad_fn == nullptr; }
  Tensor detach() const;  // same storage, no history
  // Runs reverse-mode autograd from this tensor. With no argument the tensor must hold one element
  // and the seed gradient is 1.
  void backward(const Tensor& grad_output = Tensor(), bool retain_graph = false) const;
  void add_grad_ready_hook(GradReadyHook hook) const;
  const std::string& name() const { return impl_->name; }
  void set_name(const std::string& n) const { impl_->name = n; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::F32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::F64;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::I32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::I64;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::U8;
};
template <>
struct dtype_of<uint16_t> {  // raw bf16 bits; f16 tensors are read as uint16_t too
  static constexpr DType value = DType::BF16;
};

void check_data_type(const Tensor& t, DType requested, size_t requested_size);

template <class T>
T* Tensor::data() const {
  check_data_type(*this, dtype_of<T>::value, sizeof(T));
  return static_cast<T*>(data_ptr());
}

}  // namespace accel
