// Elementwise kernels: unary, scalar, binary, where (swiglu.cu and random.cu hold those ops).
// Contiguous float tensors take a vectorized path (16 bytes per thread and access); everything
// else (broadcast views, integer dtypes) takes a strided path with run-time dtypes, computing in
// float for the float dtypes and in double for f64 and the integers.
#include "ops/cuda/common.cuh"
#include "ops/cuda/vec.cuh"

namespace accel {
namespace {
using namespace cuda;

constexpr int kThreads = 256;

__device__ __forceinline__ float d_exp(float v) { return expf(v); }
__device__ __forceinline__ double d_exp(double v) { return ::exp(v); }
__device__ __forceinline__ float d_log(float v) { return logf(v); }
__device__ __forceinline__ double d_log(double v) { return ::log(v); }
__device__ __forceinline__ float d_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double d_sqrt(double v) { return ::sqrt(v); }
__device__ __forceinline__ float d_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double d_tanh(double v) { return ::tanh(v); }
__device__ __forceinline__ float d_pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double d_pow(double a, double b) { return ::pow(a, b); }

struct UnaryF {
  UnaryOp op;
  template <class C>
  __device__ __forceinline__ C operator()(C v) const {
    switch (op) {
      case UnaryOp::Neg:
        return -v;
      case UnaryOp::Exp:
        return d_exp(v);
      case UnaryOp::Log:
        return d_log(v);
      case UnaryOp::Sqrt:
        return d_sqrt(v);
      case UnaryOp::Rsqrt:
        return C(1) / d_sqrt(v);
      case UnaryOp::Abs:
        return v < C(0) ? -v : v;
      case UnaryOp::Sigmoid:
        return C(1) / (C(1) + d_exp(-v));
      case UnaryOp::Silu:
        return v * (C(1) / (C(1) + d_exp(-v)));
      case UnaryOp::Gelu: {
        const C k0 = C(0.7978845608028654), k1 = C(0.044715);
        return C(0.5) * v * (C(1) + d_tanh(k0 * (v + k1 * v * v * v)));
      }
      case UnaryOp::Tanh:
        return d_tanh(v);
      case UnaryOp::Square:
        return v * v;
    }
    return v;
  }
};

enum class ScalarKind { Add, Mul, Pow };
struct ScalarF {
  ScalarKind kind;
  double s;
  template <class C>
  __device__ __forceinline__ C operator()(C v) const {
    const C c = static_cast<C>(s);
    switch (kind) {
      case ScalarKind::Add:
        return v + c;
      case ScalarKind::Mul:
        return v * c;
      case ScalarKind::Pow:
        if (s == 2.0) return v * v;
        if (s == 1.0) return v;
        if (s == 0.5) return d_sqrt(v);
        return d_pow(v, c);
    }
    return v;
  }
};

struct BinaryF {
  BinaryOp op;
  template <class C>
  __device__ __forceinline__ C operator()(C x, C y) const {
    switch (op) {
      case BinaryOp::Add:
        return x + y;
      case BinaryOp::Sub:
        return x - y;
      case BinaryOp::Mul:
        return x * y;
      case BinaryOp::Div:
        return x / y;
      case BinaryOp::Maximum:
        return (x != x || x > y) ? x : y;
      case BinaryOp::Greater:
        return x > y ? C(1) : C(0);
      case BinaryOp::Equal:
        return x == y ? C(1) : C(0);
    }
    return x;
  }
};

// ---- strided paths --------------------------------------------------------------------------
template <class C>
__device__ __forceinline__ C load_c(const void* p, DType t, int64_t i);
template <>
__device__ __forceinline__ float load_c<float>(const void* p, DType t, int64_t i) {
  return load_f(p, t, i);
}
template <>
__device__ __forceinline__ double load_c<double>(const void* p, DType t, int64_t i) {
  return load_as_double(p, t, i);
}
__device__ __forceinline__ void store_c(void* p, DType t, int64_t i, float v) {
  store_f(p, t, i, v);
}
__device__ __forceinline__ void store_c(void* p, DType t, int64_t i, double v) {
  store_from_double(p, t, i, v);
}

struct Operand {
  const void* p;
  DType t;
  StridedLayout l;
};

template <class C, class F>
__global__ void map1_strided(void* out, DType ot, StridedLayout ol, Operand a, int64_t n, F f) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store_c(out, ot, ol.offset(i), f(load_c<C>(a.p, a.t, a.l.offset(i))));
}

template <class C, class F>
__global__ void map2_strided(void* out, DType ot, StridedLayout ol, Operand a, Operand b, int64_t n,
                             F f) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store_c(out, ot, ol.offset(i),
            f(load_c<C>(a.p, a.t, a.l.offset(i)), load_c<C>(b.p, b.t, b.l.offset(i))));
}

// Copies the chosen element's bytes (exact for every dtype; `size` is the element size).
__global__ void where_strided(void* out, int size, StridedLayout ol, Operand c, Operand a,
                              Operand b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool cond = static_cast<const uint8_t*>(c.p)[c.l.offset(i)] != 0;
    const Operand& s = cond ? a : b;
    const int64_t si = s.l.offset(i), oi = ol.offset(i);
    switch (size) {
      case 1:
        static_cast<uint8_t*>(out)[oi] = static_cast<const uint8_t*>(s.p)[si];
        break;
      case 2:
        static_cast<uint16_t*>(out)[oi] = static_cast<const uint16_t*>(s.p)[si];
        break;
      case 4:
        static_cast<uint32_t*>(out)[oi] = static_cast<const uint32_t*>(s.p)[si];
        break;
      default:
        static_cast<uint64_t*>(out)[oi] = static_cast<const uint64_t*>(s.p)[si];
        break;
    }
  }
}

// ---- vectorized contiguous paths ------------------------------------------------------------
template <class T, class F>
__global__ void map1_vec(T* __restrict__ out, const T* __restrict__ a, int64_t n, F f) {
  constexpr int N = Vec<T>::N;
  const int64_t nv = n / N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv;
       i += int64_t(gridDim.x) * blockDim.x) {
    Vec<T> x = load_vec(a, i * N), y;
#pragma unroll
    for (int k = 0; k < N; ++k) y.v[k] = from_f<T>(f(to_f(x.v[k])));
    store_vec(out, i * N, y);
  }
  for (int64_t i = nv * N + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(f(to_f(a[i])));
}

template <class T, class F>
__global__ void map2_vec(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
                         int64_t n, F f) {
  constexpr int N = Vec<T>::N;
  const int64_t nv = n / N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv;
       i += int64_t(gridDim.x) * blockDim.x) {
    Vec<T> x = load_vec(a, i * N), y = load_vec(b, i * N), z;
#pragma unroll
    for (int k = 0; k < N; ++k) z.v[k] = from_f<T>(f(to_f(x.v[k]), to_f(y.v[k])));
    store_vec(out, i * N, z);
  }
  for (int64_t i = nv * N + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(f(to_f(a[i]), to_f(b[i])));
}

// One operand contiguous, the other a single broadcast element (read once per thread).
template <class T, bool kScalarFirst, class F>
__global__ void map2_vec_scalar(T* __restrict__ out, const T* __restrict__ x,
                                const T* __restrict__ sp, int64_t n, F f) {
  constexpr int N = Vec<T>::N;
  const float sv = to_f(*sp);
  const int64_t nv = n / N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv;
       i += int64_t(gridDim.x) * blockDim.x) {
    Vec<T> a = load_vec(x, i * N), z;
#pragma unroll
    for (int k = 0; k < N; ++k)
      z.v[k] = from_f<T>(kScalarFirst ? f(sv, to_f(a.v[k])) : f(to_f(a.v[k]), sv));
    store_vec(out, i * N, z);
  }
  for (int64_t i = nv * N + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(kScalarFirst ? f(sv, to_f(x[i])) : f(to_f(x[i]), sv));
}

bool all_zero_strides(const Tensor& t) {
  for (int64_t st : t.strides())
    if (st != 0) return false;
  return true;
}

bool is_float_compute(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

Operand operand(const Tensor& t, const StridedLayout& l) {
  return Operand{t.data_ptr(), t.dtype(), l};
}

template <class F>
void launch_map1(const char* op, const Tensor& out, const Tensor& x, F f) {
  require_cuda(x, op, "input");
  const int64_t n = out.numel();
  if (n == 0) return;
  OpScope sc(out);
  if (out.dtype() == x.dtype() && x.is_contiguous() && out.is_contiguous() &&
      is_float_compute(x.dtype()) && aligned16(x.data_ptr()) && aligned16(out.data_ptr())) {
    dispatch_float(x.dtype(), op, [&](auto t) {
      using T = decltype(t);
      map1_vec<T><<<grid_for(n / Vec<T>::N + 1, kThreads), kThreads, 0, sc.stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), n, f);
    });
  } else {
    auto l = make_layouts(out.shape(), {out.strides(), x.strides()}, op);
    if (is_float_compute(x.dtype()) && is_float_compute(out.dtype()))
      map1_strided<float><<<grid_for(n, kThreads), kThreads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), l[0], operand(x, l[1]), n, f);
    else
      map1_strided<double><<<grid_for(n, kThreads), kThreads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), l[0], operand(x, l[1]), n, f);
  }
  ACCEL_CUDA_CHECK_LAUNCH("elementwise");
}

bool is_integer(DType t) {
  return t == DType::I32 || t == DType::I64 || t == DType::U8 || t == DType::Bool;
}

}  // namespace

void CudaBackend::unary(UnaryOp op, const Tensor& out, const Tensor& x) {
  require(out.dtype() == x.dtype(), "unary", "out and x dtypes differ");
  if (is_integer(x.dtype()) && op != UnaryOp::Neg && op != UnaryOp::Abs && op != UnaryOp::Square)
    unsupported_dtype("unary", x.dtype());
  launch_map1("unary", out, x, UnaryF{op});
}

void CudaBackend::add_scalar(const Tensor& out, const Tensor& x, double s) {
  launch_map1("add", out, x, ScalarF{ScalarKind::Add, s});
}
void CudaBackend::mul_scalar(const Tensor& out, const Tensor& x, double s) {
  launch_map1("mul", out, x, ScalarF{ScalarKind::Mul, s});
}
void CudaBackend::pow_scalar(const Tensor& out, const Tensor& x, double e) {
  if (!is_floating(x.dtype())) unsupported_dtype("pow", x.dtype());
  launch_map1("pow", out, x, ScalarF{ScalarKind::Pow, e});
}

void CudaBackend::binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* name = "binary";
  require_cuda(a, name, "a");
  require_cuda(b, name, "b");
  require(a.shape() == out.shape() && b.shape() == out.shape() && a.dtype() == b.dtype(), name,
          [&] {
            return "inputs must be expanded to out's shape and share a dtype: " + a.str() + ", " +
                   b.str() + " -> " + out.str();
          });
  const bool cmp = op == BinaryOp::Greater || op == BinaryOp::Equal;
  require(cmp ? out.dtype() == DType::Bool : out.dtype() == a.dtype(), name,
          [&] { return "wrong output dtype " + out.str(); });
  if (op == BinaryOp::Div && is_integer(a.dtype()))
    throw std::invalid_argument(std::string("[div] integer division is not supported (") +
                                dtype_name(a.dtype()) + "); cast to a float dtype first");
  const int64_t n = out.numel();
  if (n == 0) return;
  OpScope sc(out);
  BinaryF f{op};
  if (!cmp && a.is_contiguous() && b.is_contiguous() && is_float_compute(a.dtype()) &&
      aligned16(a.data_ptr()) && aligned16(b.data_ptr()) && aligned16(out.data_ptr())) {
    dispatch_float(a.dtype(), name, [&](auto t) {
      using T = decltype(t);
      map2_vec<T><<<grid_for(n / Vec<T>::N + 1, kThreads), kThreads, 0, sc.stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(a.data_ptr()),
          static_cast<const T*>(b.data_ptr()), n, f);
    });
  } else if (!cmp && is_float_compute(a.dtype()) && out.is_contiguous() &&
             aligned16(out.data_ptr()) &&
             ((a.is_contiguous() && aligned16(a.data_ptr()) && all_zero_strides(b)) ||
              (b.is_contiguous() && aligned16(b.data_ptr()) && all_zero_strides(a)))) {
    // A tensor times/plus a broadcast scalar (e.g. a gradient scaled by a device scalar).
    const bool scalar_first =
        !(a.is_contiguous() && aligned16(a.data_ptr()) && all_zero_strides(b));
    dispatch_float(a.dtype(), name, [&](auto t) {
      using T = decltype(t);
      const T* x = static_cast<const T*>(scalar_first ? b.data_ptr() : a.data_ptr());
      const T* sp = static_cast<const T*>(scalar_first ? a.data_ptr() : b.data_ptr());
      auto grid = grid_for(n / Vec<T>::N + 1, kThreads);
      if (scalar_first)
        map2_vec_scalar<T, true>
            <<<grid, kThreads, 0, sc.stream>>>(static_cast<T*>(out.data_ptr()), x, sp, n, f);
      else
        map2_vec_scalar<T, false>
            <<<grid, kThreads, 0, sc.stream>>>(static_cast<T*>(out.data_ptr()), x, sp, n, f);
    });
  } else {
    auto l = make_layouts(out.shape(), {out.strides(), a.strides(), b.strides()}, name);
    if (is_float_compute(a.dtype()))
      map2_strided<float><<<grid_for(n, kThreads), kThreads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), l[0], operand(a, l[1]), operand(b, l[2]), n, f);
    else
      map2_strided<double><<<grid_for(n, kThreads), kThreads, 0, sc.stream>>>(
          out.data_ptr(), out.dtype(), l[0], operand(a, l[1]), operand(b, l[2]), n, f);
  }
  ACCEL_CUDA_CHECK_LAUNCH("binary");
}

void CudaBackend::where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  require_cuda(cond, "where", "condition");
  require(cond.shape() == out.shape() && a.shape() == out.shape() && b.shape() == out.shape(),
          "where", "inputs must be expanded to out's shape");
  if (cond.dtype() != DType::Bool && cond.dtype() != DType::U8)
    throw std::invalid_argument("[where] condition must be bool, got " + cond.str());
  require(a.dtype() == b.dtype() && out.dtype() == a.dtype(), "where", "dtypes differ");
  const int64_t n = out.numel();
  if (n == 0) return;
  OpScope sc(out);
  auto l =
      make_layouts(out.shape(), {out.strides(), cond.strides(), a.strides(), b.strides()}, "where");
  where_strided<<<grid_for(n, kThreads), kThreads, 0, sc.stream>>>(
      out.data_ptr(), static_cast<int>(out.element_size()), l[0], operand(cond, l[1]),
      operand(a, l[2]), operand(b, l[3]), n);
  ACCEL_CUDA_CHECK_LAUNCH("where");
}

}  // namespace accel
