// CPU versions of the runtime's own kernels: strided copy with dtype conversion, fill, accumulate.
#include <cstring>
#include <stdexcept>

#include "runtime/kernels.h"

namespace accel::kernels {
namespace {

template <DType D>
struct Elem;
#define ACCEL_PLAIN_ELEM(D, T)                                                    \
  template <>                                                                     \
  struct Elem<D> {                                                                \
    using Storage = T;                                                            \
    static double load(const T* p) { return static_cast<double>(*p); }            \
    static void store(T* p, double v) { *p = static_cast<T>(v); }                \
  };
ACCEL_PLAIN_ELEM(DType::F32, float)
ACCEL_PLAIN_ELEM(DType::F64, double)
ACCEL_PLAIN_ELEM(DType::I32, int32_t)
ACCEL_PLAIN_ELEM(DType::I64, int64_t)
ACCEL_PLAIN_ELEM(DType::U8, uint8_t)
#undef ACCEL_PLAIN_ELEM
template <>
struct Elem<DType::Bool> {
  using Storage = uint8_t;
  static double load(const uint8_t* p) { return *p ? 1.0 : 0.0; }
  static void store(uint8_t* p, double v) { *p = v != 0.0; }
};
template <>
struct Elem<DType::BF16> {
  using Storage = uint16_t;
  static double load(const uint16_t* p) { return bf16_to_f32(*p); }
  static void store(uint16_t* p, double v) { *p = f32_to_bf16(static_cast<float>(v)); }
};
template <>
struct Elem<DType::F16> {
  using Storage = uint16_t;
  static double load(const uint16_t* p) { return f16_to_f32(*p); }
  static void store(uint16_t* p, double v) { *p = f32_to_f16(static_cast<float>(v)); }
};
template <>
struct Elem<DType::E4M3> {
  using Storage = uint8_t;
  static double load(const uint8_t* p) { return e4m3_to_f32(*p); }
  static void store(uint8_t* p, double v) { *p = f32_to_e4m3(static_cast<float>(v)); }
};
template <>
struct Elem<DType::E5M2> {
  using Storage = uint8_t;
  static double load(const uint8_t* p) { return e5m2_to_f32(*p); }
  static void store(uint8_t* p, double v) { *p = f32_to_e5m2(static_cast<float>(v)); }
};

template <class F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(Elem<DType::F32>{}); break;
    case DType::F64: f(Elem<DType::F64>{}); break;
    case DType::BF16: f(Elem<DType::BF16>{}); break;
    case DType::F16: f(Elem<DType::F16>{}); break;
    case DType::E4M3: f(Elem<DType::E4M3>{}); break;
    case DType::E5M2: f(Elem<DType::E5M2>{}); break;
    case DType::I32: f(Elem<DType::I32>{}); break;
    case DType::I64: f(Elem<DType::I64>{}); break;
    case DType::U8: f(Elem<DType::U8>{}); break;
    case DType::Bool: f(Elem<DType::Bool>{}); break;
  }
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
      auto* d = static_cast<typename DE::Storage*>(dst.data_ptr());
      const auto* s = static_cast<const typename SE::Storage*>(src.data_ptr());
      for_each_offset(dst.shape(), dst.strides(), src.strides(),
                      [&](int64_t od, int64_t os) { DE::store(d + od, SE::load(s + os)); });
    });
  });
}

void fill(const Tensor& dst, double value) {
  dispatch_dtype(dst.dtype(), [&](auto elem) {
    using E = decltype(elem);
    typename E::Storage v;
    E::store(&v, value);
    auto* d = static_cast<typename E::Storage*>(dst.data_ptr());
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
    auto* d = static_cast<typename E::Storage*>(dst.data_ptr());
    const auto* s = static_cast<const typename E::Storage*>(src.data_ptr());
    for_each_offset(dst.shape(), dst.strides(), src.strides(), [&](int64_t od, int64_t os) {
      E::store(d + od, E::load(d + od) + E::load(s + os));
    });
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

}  // namespace accel::kernels
