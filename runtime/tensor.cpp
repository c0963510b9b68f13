#include "runtime/tensor.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "runtime/autograd.h"
#include "runtime/kernels.h"

namespace accel {

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

int64_t checked_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) return -1;
    if (d == 0) n = 0;
  }
  if (n == 0) return 0;
  for (int64_t d : s)
    if (__builtin_mul_overflow(n, d, &n) || n > kMaxNumel) return -1;
  return n;
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d == 0) return 0;
    if (__builtin_mul_overflow(n, d, &n) || n > kMaxNumel || n < -kMaxNumel)
      throw std::length_error("[shape] " + shape_str(s) + " holds more than 2^60 elements");
  }
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int i = static_cast<int>(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    if (i > 0 && (__builtin_mul_overflow(acc, s[i], &acc) || acc > kMaxNumel || acc < -kMaxNumel))
      throw std::length_error("[shape] the strides of " + shape_str(s) + " exceed 2^60 elements");
  }
  return st;
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  if (d < -n || d >= n)
    throw std::out_of_range("[size] dim " + std::to_string(d) + " out of range for shape " +
                            shape_str(shape()));
  return shape()[d < 0 ? d + n : d];
}

bool Tensor::is_contiguous() const {
  int64_t acc = 1;
  for (int i = static_cast<int>(shape().size()) - 1; i >= 0; --i) {
    if (shape()[i] != 1 && strides()[i] != acc) return false;
    acc *= shape()[i];
  }
  return true;
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return std::string("Tensor(") + dtype_name(dtype()) + ", " + shape_str(shape()) + ", " +
         device().str() + ")";
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(impl_->storage->data) +
         impl_->offset * static_cast<int64_t>(dtype_size(impl_->dtype));
}

void check_data_type(const Tensor& t, DType requested, size_t requested_size) {
  if (!t.defined()) throw std::invalid_argument("[data] undefined tensor");
  bool ok = t.dtype() == requested ||
            (requested_size == 2 && (t.dtype() == DType::BF16 || t.dtype() == DType::F16)) ||
            (requested_size == 1 && dtype_size(t.dtype()) == 1);
  if (!ok)
    throw std::invalid_argument(std::string("[data] tensor holds ") + dtype_name(t.dtype()) +
                                ", not " + dtype_name(requested));
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, DType dtype, const Shape& shape,
                            const Shape& strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->dtype = dtype;
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  return Tensor(std::move(impl));
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, MemCategory category) {
  for (int64_t d : shape)
    if (d < 0)
      throw std::invalid_argument("[empty] negative dimension in shape " + shape_str(shape));
  // shape_numel bounds the count at kMaxNumel, so the byte count cannot overflow.
  auto storage = allocate_storage(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype),
                                  device, category);
  return from_storage(std::move(storage), dtype, shape, contiguous_strides(shape), 0);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, MemCategory category) {
  Tensor t = empty(shape, dtype, device, category);
  t.fill_(0.0);
  return t;
}

Tensor Tensor::ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::arange(int64_t n, DType dtype, Device device) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(i);
  return from_vector(v, {n}, dtype, device);
}

namespace {

// Host values of `host_dtype` (double or int64) -> a tensor of `dtype` on `device`.
template <typename T>
Tensor from_host_values(const std::vector<T>& values, DType host_dtype, const Shape& shape,
                        DType dtype, Device device) {
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    throw std::invalid_argument("[from_vector] " + std::to_string(values.size()) +
                                " values for shape " + shape_str(shape));
  Tensor host = Tensor::empty(shape, host_dtype);
  if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), values.size() * sizeof(T));
  Tensor out = host;
  if (dtype != host_dtype) {
    out = Tensor::empty(shape, dtype);
    out.copy_(host);
  }
  return device.is_cpu() ? out : out.to(device);
}

}  // namespace

Tensor Tensor::from_vector(const std::vector<double>& values, const Shape& shape, DType dtype,
                           Device device) {
  return from_host_values(values, DType::F64, shape, dtype, device);
}

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape, DType dtype,
                           Device device) {
  return from_vector(std::vector<double>(values.begin(), values.end()), shape, dtype, device);
}

Tensor Tensor::from_vector(const std::vector<int64_t>& values, const Shape& shape, DType dtype,
                           Device device) {
  return from_host_values(values, DType::I64, shape, dtype, device);
}

Tensor Tensor::as_strided(const Shape& shape, const Shape& strides, int64_t offset) const {
  if (shape.size() != strides.size())
    throw std::invalid_argument("[as_strided] shape " + shape_str(shape) + " and strides " +
                                shape_str(strides) + " differ in rank");
  return from_storage(impl_->storage, impl_->dtype, shape, strides, offset);
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor src = is_contiguous() ? *this : clone();
  Tensor out = empty(shape(), dtype(), device, storage()->category);
  if (nbytes()) cuda::copy_bytes(out.data_ptr(), device, src.data_ptr(), src.device(), nbytes());
  return out;
}

Tensor Tensor::clone(MemCategory category) const {
  Tensor out = empty(shape(), dtype(), device(), category);
  kernels::copy(out, *this);
  return out;
}

void Tensor::copy_(const Tensor& src) const {
  if (src.device() != device()) {
    if (shape() != src.shape())
      throw std::invalid_argument("[copy_] shape mismatch: " + str() + " <- " + src.str());
    Tensor moved = src.to(device());
    kernels::copy(*this, moved);
    return;
  }
  kernels::copy(*this, src);
}

void Tensor::fill_(double value) const { kernels::fill(*this, value); }

std::vector<double> Tensor::to_vector() const {
  Tensor host = to(Device::cpu());
  Tensor f = empty(shape(), DType::F64);
  kernels::copy(f, host);
  const double* p = f.data<double>();
  return std::vector<double>(p, p + numel());
}

double Tensor::item() const {
  if (numel() != 1)
    throw std::invalid_argument("[item] tensor of shape " + shape_str(shape()) +
                                " does not hold exactly one element");
  return to_vector()[0];
}

const Tensor& Tensor::set_requires_grad(bool r) const {
  if (r && !is_floating(dtype()))
    throw std::invalid_argument(std::string("[requires_grad] only floating tensors can require "
                                            "gradients, not ") +
                                dtype_name(dtype()));
  impl_->requires_grad = r;
  return *this;
}

Tensor Tensor::grad() const { return Tensor(impl_->grad); }

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined() && g.shape() != shape())
    throw std::invalid_argument("[set_grad] gradient " + g.str() + " does not match " + str());
  impl_->grad = g.impl_ptr();
}

void Tensor::zero_grad() const { impl_->grad.reset(); }

Tensor Tensor::detach() const {
  Tensor out =
      from_storage(impl_->storage, impl_->dtype, impl_->shape, impl_->strides, impl_->offset);
  out.impl()->name = impl_->name;
  return out;
}

void Tensor::backward(const Tensor& grad_output, bool retain_graph) const {
  run_backward(*this, grad_output, retain_graph);
}

void Tensor::add_grad_ready_hook(GradReadyHook hook) const {
  impl_->grad_ready_hooks.push_back(std::move(hook));
}

}  // namespace accel
