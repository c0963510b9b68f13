// CPU versions of the runtime's own kernels: strided copy with dtype conversion, fill, accumulate.
#include <cstring>
#include <stdexcept>

#include "runtime/cpu_dtype.h"
#include "runtime/kernels.h"

namespace accel::kernels {
namespace {

// Element access through the CPU element traits; copy, fill and accumulate convert through double.
template <class Tr>
double load(const typename Tr::S* p) {
  return static_cast<double>(Tr::load(*p));
}
template <class Tr>
void store(typename Tr::S* p, double v) {
  *p = Tr::store(static_cast<typename Tr::C>(v));
}

// Calls f(accel::cpu::Traits<D>{}) for t.
template <class F>
void dispatch_dtype(DType t, F&& f) {
  accel::cpu::dispatch_among<DType::F32, DType::F64, DType::BF16, DType::F16, DType::E4M3,
                             DType::E5M2, DType::I32, DType::I64, DType::U8, DType::Bool>(t, f);
}

// Calls f(dst_offset, src_offset) for every logical index, in row-major order.
template <class F>
void for_each_offset(const Shape& shape, const Shape& dst_strides, const Shape& src_strides,
                     F&& f) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const int nd = static_cast<int>(shape.size());
  if (nd == 0) {
    f(0, 0);
    return;
  }
  std::vector<int64_t> idx(nd, 0);
  int64_t d_off = 0, s_off = 0;
  const int64_t inner = shape[nd - 1], ds = dst_strides[nd - 1], ss = src_strides[nd - 1];
  for (int64_t done = 0; done < n; done += inner) {
    for (int64_t i = 0; i < inner; ++i) f(d_off + i * ds, s_off + i * ss);
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        d_off += dst_strides[d];
        s_off += src_strides[d];
        break;
      }
      d_off -= dst_strides[d] * (shape[d] - 1);
      s_off -= src_strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

}  // namespace

namespace cpu {

void copy(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (dst.nbytes()) std::memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    return;
  }
  dispatch_dtype(dst.dtype(), [&](auto dst_elem) {
    using DE = decltype(dst_elem);
    dispatch_dtype(src.dtype(), [&](auto src_elem) {
      using SE = decltype(src_elem);
      auto* d = static_cast<typename DE::S*>(dst.data_ptr());
      const auto* s = static_cast<const typename SE::S*>(src.data_ptr());
      for_each_offset(dst.shape(), dst.strides(), src.strides(),
                      [&](int64_t od, int64_t os) { store<DE>(d + od, load<SE>(s + os)); });
    });
  });
}

void fill(const Tensor& dst, double value) {
  dispatch_dtype(dst.dtype(), [&](auto elem) {
    using E = decltype(elem);
    typename E::S v;
    store<E>(&v, value);
    auto* d = static_cast<typename E::S*>(dst.data_ptr());
    for_each_offset(dst.shape(), dst.strides(), dst.strides(),
                    [&](int64_t od, int64_t) { d[od] = v; });
  });
}

void accumulate(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == DType::F32 && src.is_contiguous()) {
    float* d = dst.data<float>();
    const float* s = src.data<float>();
    const int64_t n = dst.numel();
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
    return;
  }
  dispatch_dtype(dst.dtype(), [&](auto elem) {
    using E = decltype(elem);
    auto* d = static_cast<typename E::S*>(dst.data_ptr());
    const auto* s = static_cast<const typename E::S*>(src.data_ptr());
    for_each_offset(dst.shape(), dst.strides(), src.strides(), [&](int64_t od, int64_t os) {
      store<E>(d + od, load<E>(d + od) + load<E>(s + os));
    });
  });
}

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
  dispatch_dtype(out.dtype(), [&](auto elem) {
    using E = decltype(elem);
    auto* o = static_cast<typename E::S*>(out.data_ptr());
    const auto* pa = static_cast<const typename E::S*>(a.data_ptr());
    const auto* pb = static_cast<const typename E::S*>(b.data_ptr());
    const int64_t n = out.numel();
    for (int64_t i = 0; i < n; ++i) store<E>(o + i, load<E>(pa + i) + load<E>(pb + i));
  });
}

}  // namespace cpu

void copy(const Tensor& dst, const Tensor& src) {
  if (dst.shape() != src.shape())
    throw std::invalid_argument("[copy] shape mismatch: dst " + shape_str(dst.shape()) + " src " +
                                shape_str(src.shape()));
  if (dst.device() != src.device())
    throw std::invalid_argument("[copy] device mismatch: dst " + dst.device().str() + " src " +
                                src.device().str());
  if (dst.device().is_cpu())
    cpu::copy(dst, src);
  else
    cuda::copy(dst, src);
}

void fill(const Tensor& dst, double value) {
  if (dst.device().is_cpu())
    cpu::fill(dst, value);
  else
    cuda::fill(dst, value);
}

void accumulate(const Tensor& dst, const Tensor& src) {
  if (dst.shape() != src.shape() || dst.dtype() != src.dtype() || dst.device() != src.device() ||
      !dst.is_contiguous())
    throw std::invalid_argument("[accumulate] dst " + dst.str() + " and src " + src.str() +
                                " must match, dst contiguous");
  if (dst.device().is_cpu())
    cpu::accumulate(dst, src);
  else
    cuda::accumulate(dst, src);
}

Tensor sum_of(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype() || a.device() != b.device())
    throw std::invalid_argument("[sum_of] " + a.str() + " and " + b.str() + " must match");
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (!a.is_contiguous() || !b.is_contiguous()) {
    copy(out, a);
    accumulate(out, b);
  } else if (a.device().is_cpu()) {
    cpu::add(out, a, b);
  } else {
    cuda::add(out, a, b);
  }
  return out;
}

}  // namespace accel::kernels
