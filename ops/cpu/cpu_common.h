// What the CPU kernels share: dtype dispatch over the element traits of runtime/cpu_dtype.h, a
// strided index walker and a parallel loop that stays on the calling thread for small work (OpenMP
// dispatch costs more than a tiny kernel).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "runtime/cpu_dtype.h"
#include "runtime/dtype.h"
#include "runtime/tensor.h"

namespace accel::cpu {

// Rounds a compute value to what the dtype can hold (identity for f32/f64).
template <class Tr>
typename Tr::C round_to(typename Tr::C c) {
  return Tr::load(Tr::store(c));
}

template <class Tr>
typename Tr::S* ptr(const Tensor& t) {
  return static_cast<typename Tr::S*>(t.data_ptr());
}

[[noreturn]] inline void unsupported_dtype(const char* op, DType t) {
  throw std::invalid_argument(std::string("[") + op + "] dtype " + dtype_name(t) +
                              " is not supported by the CPU backend for this op");
}

// Calls f(Traits<D>{}) for the floating dtypes; throws for others.
template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  using D = DType;
  if (!dispatch_among<D::F32, D::F64, D::BF16, D::F16, D::E4M3, D::E5M2>(t, f))
    unsupported_dtype(op, t);
}

// Floating dtypes plus i32 and i64.
template <class F>
void dispatch_numeric(DType t, const char* op, F&& f) {
  if (!dispatch_among<DType::I32, DType::I64>(t, f)) dispatch_float(t, op, f);
}

// Every dtype.
template <class F>
void dispatch_all(DType t, const char* op, F&& f) {
  if (!dispatch_among<DType::U8, DType::Bool>(t, f)) dispatch_numeric(t, op, f);
}

// Index types for ids and targets.
template <class F>
void dispatch_index(DType t, const char* op, F&& f) {
  if (!dispatch_among<DType::I32, DType::I64>(t, f))
    throw std::invalid_argument(std::string("[") + op + "] indices must be i32 or i64, not " +
                                dtype_name(t));
}

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Runs f(begin, end) over [0, n) split into one contiguous chunk per thread when n > grain, else
// f(0, n) on the calling thread. f must not throw: validate before calling.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
  if (n > grain && threads > 1 && !omp_in_parallel()) {
    const int64_t g = std::max<int64_t>(grain, 1);
    const int64_t chunks = std::min<int64_t>(threads, (n + g - 1) / g);
    if (chunks <= 1) {
      f(int64_t{0}, n);
      return;
    }
    const int64_t chunk = (n + chunks - 1) / chunks;
    const int team = static_cast<int>(chunks);
#pragma omp parallel for num_threads(team) schedule(static, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t b = c * chunk, e = std::min(n, b + chunk);
      if (b < e) f(b, e);
    }
    return;
  }
#endif
  f(int64_t{0}, n);
}

// Elementwise work below this many elements stays on one thread.
constexpr int64_t kGrain = 32768;

// Walks a logical (row-major) index space for N operands with their own element strides. Size-1
// dims are dropped and dims that are contiguous for every operand are merged, so broadcasting over
// a contiguous inner block runs as one flat inner loop.
template <size_t N>
class StridedWalk {
 public:
  StridedWalk(const Shape& shape, const std::array<const Shape*, N>& strides) {
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 1) continue;
      if (!shape_.empty()) {
        bool mergeable = true;
        for (size_t k = 0; k < N; ++k)
          mergeable = mergeable && strides_[k].back() == (*strides[k])[d] * shape[d];
        if (mergeable) {
          shape_.back() *= shape[d];
          for (size_t k = 0; k < N; ++k) strides_[k].back() = (*strides[k])[d];
          continue;
        }
      }
      shape_.push_back(shape[d]);
      for (size_t k = 0; k < N; ++k) strides_[k].push_back((*strides[k])[d]);
    }
    numel_ = shape_numel(shape);
  }

  int64_t numel() const { return numel_; }

  // Calls f(i, offsets) for the logical indices i in [begin, end), offsets[k] being the element
  // offset of operand k.
  template <class F>
  void run(int64_t begin, int64_t end, F&& f) const {
    if (begin >= end) return;
    const int nd = static_cast<int>(shape_.size());
    std::array<int64_t, N> off{};
    if (nd == 0) {
      f(begin, off);
      return;
    }
    std::vector<int64_t> idx(nd);
    int64_t rest = begin;
    for (int d = nd - 1; d >= 0; --d) {
      idx[d] = rest % shape_[d];
      rest /= shape_[d];
      for (size_t k = 0; k < N; ++k) off[k] += idx[d] * strides_[k][d];
    }
    const int64_t inner = shape_[nd - 1];
    std::array<int64_t, N> inner_stride;
    for (size_t k = 0; k < N; ++k) inner_stride[k] = strides_[k][nd - 1];
    int64_t i = begin;
    while (i < end) {
      const int64_t count = std::min(inner - idx[nd - 1], end - i);
      std::array<int64_t, N> o = off;
      for (int64_t j = 0; j < count; ++j) {
        f(i + j, o);
        for (size_t k = 0; k < N; ++k) o[k] += inner_stride[k];
      }
      i += count;
      idx[nd - 1] += count;
      for (size_t k = 0; k < N; ++k) off[k] += count * inner_stride[k];
      if (idx[nd - 1] < inner) break;  // only happens when i == end
      for (size_t k = 0; k < N; ++k) off[k] -= inner * inner_stride[k];
      idx[nd - 1] = 0;
      for (int d = nd - 2; d >= 0; --d) {
        for (size_t k = 0; k < N; ++k) off[k] += strides_[k][d];
        if (++idx[d] < shape_[d]) break;
        for (size_t k = 0; k < N; ++k) off[k] -= shape_[d] * strides_[k][d];
        idx[d] = 0;
      }
    }
  }

 private:
  Shape shape_;
  std::array<Shape, N> strides_;
  int64_t numel_ = 0;
};

// A contiguous version of t (t itself when it already is).
inline Tensor contiguous_copy(const Tensor& t) { return t.is_contiguous() ? t : t.clone(); }

// Loads a whole tensor (any strides) as a contiguous vector of compute values of type T.
template <class T>
std::vector<T> load_as(const Tensor& t) {
  std::vector<T> out(static_cast<size_t>(t.numel()));
  if (out.empty()) return out;
  Tensor src = contiguous_copy(t);
  dispatch_float(t.dtype(), "load", [&](auto tr) {
    using Tr = decltype(tr);
    const auto* p = ptr<Tr>(src);
    const int64_t n = t.numel();
    parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) out[i] = static_cast<T>(Tr::load(p[i]));
    });
  });
  return out;
}

// Stores compute values into a contiguous tensor, rounding to its dtype.
template <class T>
void store_from(const Tensor& t, const std::vector<T>& values) {
  dispatch_float(t.dtype(), "store", [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    auto* p = ptr<Tr>(t);
    const int64_t n = t.numel();
    parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) p[i] = Tr::store(static_cast<C>(values[i]));
    });
  });
}

}  // namespace accel::cpu
