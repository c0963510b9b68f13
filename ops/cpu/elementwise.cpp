// Elementwise kernels: unary math, scalar forms, binary ops on broadcast (stride-0) views, where.
#include <cmath>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel {
namespace {
using namespace cpu;

void check_out(const char* op, const Tensor& out, const Tensor& x) {
  if (!out.is_contiguous() || out.shape() != x.shape())
    throw std::logic_error(std::string("[") + op + "] CPU backend needs a contiguous output of " +
                           "the input's shape; got " + out.str() + " for " + x.str());
}

void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    throw std::invalid_argument(std::string("[") + op + "] dtype mismatch: " + a.str() + " vs " +
                                b.str());
}

// out[i] = store(f(load(x[i]))) for a contiguous out and any-strided x.
template <class TrOut, class TrIn, class F>
void map1(const Tensor& out, const Tensor& x, F f) {
  auto* o = ptr<TrOut>(out);
  const auto* xp = ptr<TrIn>(x);
  const int64_t n = out.numel();
  if (x.is_contiguous()) {
    parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) o[i] = TrOut::store(f(TrIn::load(xp[i])));
    });
    return;
  }
  StridedWalk<1> walk(x.shape(), {&x.strides()});
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    walk.run(b, e, [&](int64_t i, const std::array<int64_t, 1>& off) {
      o[i] = TrOut::store(f(TrIn::load(xp[off[0]])));
    });
  });
}

// out[i] = store(f(load(a[i]), load(b[i]))) with a and b already expanded to out's shape.
template <class TrOut, class TrIn, class F>
void map2(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
  auto* o = ptr<TrOut>(out);
  const auto* ap = ptr<TrIn>(a);
  const auto* bp = ptr<TrIn>(b);
  const int64_t n = out.numel();
  if (a.is_contiguous() && b.is_contiguous()) {
    parallel_for(n, kGrain, [&](int64_t s, int64_t e) {
      for (int64_t i = s; i < e; ++i) o[i] = TrOut::store(f(TrIn::load(ap[i]), TrIn::load(bp[i])));
    });
    return;
  }
  StridedWalk<2> walk(out.shape(), {&a.strides(), &b.strides()});
  parallel_for(n, kGrain, [&](int64_t s, int64_t e) {
    walk.run(s, e, [&](int64_t i, const std::array<int64_t, 2>& off) {
      o[i] = TrOut::store(f(TrIn::load(ap[off[0]]), TrIn::load(bp[off[1]])));
    });
  });
}

// out = f(x, s) elementwise, s converted to x's compute type: the scalar forms of add and mul.
template <class F>
void map_scalar(const char* op, const Tensor& out, const Tensor& x, double s, F f) {
  check_out(op, out, x);
  check_same_dtype(op, out, x);
  dispatch_numeric(x.dtype(), op, [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    const C c = static_cast<C>(s);
    map1<Tr, Tr>(out, x, [c, f](C v) { return C(f(v, c)); });
  });
}

template <class C>
C sigmoid_of(C x) {
  return C(1) / (C(1) + std::exp(-x));
}

template <class C>
C gelu_tanh(C x) {
  const C k0 = C(0.7978845608028654);  // sqrt(2 / pi)
  const C k1 = C(0.044715);
  return C(0.5) * x * (C(1) + std::tanh(k0 * (x + k1 * x * x * x)));
}

const char* unary_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::Neg:
      return "neg";
    case UnaryOp::Exp:
      return "exp";
    case UnaryOp::Log:
      return "log";
    case UnaryOp::Sqrt:
      return "sqrt";
    case UnaryOp::Rsqrt:
      return "rsqrt";
    case UnaryOp::Abs:
      return "abs";
    case UnaryOp::Sigmoid:
      return "sigmoid";
    case UnaryOp::Silu:
      return "silu";
    case UnaryOp::Gelu:
      return "gelu";
    case UnaryOp::Tanh:
      return "tanh";
    case UnaryOp::Square:
      return "square";
  }
  return "unary";
}

const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add:
      return "add";
    case BinaryOp::Sub:
      return "sub";
    case BinaryOp::Mul:
      return "mul";
    case BinaryOp::Div:
      return "div";
    case BinaryOp::Maximum:
      return "maximum";
    case BinaryOp::Greater:
      return "greater";
    case BinaryOp::Equal:
      return "equal";
  }
  return "binary";
}

}  // namespace

void CpuBackend::unary(UnaryOp op, const Tensor& out, const Tensor& x) {
  const char* name = unary_name(op);
  check_out(name, out, x);
  check_same_dtype(name, out, x);
  dispatch_numeric(x.dtype(), name, [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    if constexpr (std::is_integral_v<C>) {
      switch (op) {
        case UnaryOp::Neg:
          map1<Tr, Tr>(out, x, [](C v) { return C(-v); });
          return;
        case UnaryOp::Abs:
          map1<Tr, Tr>(out, x, [](C v) { return C(v < 0 ? -v : v); });
          return;
        case UnaryOp::Square:
          map1<Tr, Tr>(out, x, [](C v) { return C(v * v); });
          return;
        default:
          unsupported_dtype(name, x.dtype());
      }
    } else {
      switch (op) {
        case UnaryOp::Neg:
          map1<Tr, Tr>(out, x, [](C v) { return -v; });
          return;
        case UnaryOp::Exp:
          map1<Tr, Tr>(out, x, [](C v) { return std::exp(v); });
          return;
        case UnaryOp::Log:
          map1<Tr, Tr>(out, x, [](C v) { return std::log(v); });
          return;
        case UnaryOp::Sqrt:
          map1<Tr, Tr>(out, x, [](C v) { return std::sqrt(v); });
          return;
        case UnaryOp::Rsqrt:
          map1<Tr, Tr>(out, x, [](C v) { return C(1) / std::sqrt(v); });
          return;
        case UnaryOp::Abs:
          map1<Tr, Tr>(out, x, [](C v) { return std::abs(v); });
          return;
        case UnaryOp::Sigmoid:
          map1<Tr, Tr>(out, x, [](C v) { return sigmoid_of(v); });
          return;
        case UnaryOp::Silu:
          map1<Tr, Tr>(out, x, [](C v) { return v * sigmoid_of(v); });
          return;
        case UnaryOp::Gelu:
          map1<Tr, Tr>(out, x, [](C v) { return gelu_tanh(v); });
          return;
        case UnaryOp::Tanh:
          map1<Tr, Tr>(out, x, [](C v) { return std::tanh(v); });
          return;
        case UnaryOp::Square:
          map1<Tr, Tr>(out, x, [](C v) { return v * v; });
          return;
      }
    }
  });
}

void CpuBackend::add_scalar(const Tensor& out, const Tensor& x, double s) {
  map_scalar("add", out, x, s, [](auto v, auto c) { return v + c; });
}

void CpuBackend::mul_scalar(const Tensor& out, const Tensor& x, double s) {
  map_scalar("mul", out, x, s, [](auto v, auto c) { return v * c; });
}

void CpuBackend::pow_scalar(const Tensor& out, const Tensor& x, double e) {
  check_out("pow", out, x);
  check_same_dtype("pow", out, x);
  dispatch_float(x.dtype(), "pow", [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    const C c = static_cast<C>(e);
    if (e == 2.0)
      map1<Tr, Tr>(out, x, [](C v) { return v * v; });
    else if (e == 1.0)
      map1<Tr, Tr>(out, x, [](C v) { return v; });
    else if (e == 0.5)
      map1<Tr, Tr>(out, x, [](C v) { return std::sqrt(v); });
    else
      map1<Tr, Tr>(out, x, [c](C v) { return std::pow(v, c); });
  });
}

void CpuBackend::binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  if (!out.is_contiguous() || a.shape() != out.shape() || b.shape() != out.shape())
    throw std::logic_error(std::string("[") + name + "] CPU backend needs inputs expanded to the " +
                           "contiguous output's shape; got " + a.str() + ", " + b.str() + " -> " +
                           out.str());
  check_same_dtype(name, a, b);
  if (op == BinaryOp::Greater || op == BinaryOp::Equal) {
    if (out.dtype() != DType::Bool)
      throw std::logic_error(std::string("[") + name + "] output must be bool, got " + out.str());
    dispatch_all(a.dtype(), name, [&](auto tr) {
      using Tr = decltype(tr);
      using C = typename Tr::C;
      using TrB = Traits<DType::Bool>;
      if (op == BinaryOp::Greater)
        map2<TrB, Tr>(out, a, b, [](C x, C y) { return x > y; });
      else
        map2<TrB, Tr>(out, a, b, [](C x, C y) { return x == y; });
    });
    return;
  }
  check_same_dtype(name, out, a);
  dispatch_numeric(a.dtype(), name, [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    switch (op) {
      case BinaryOp::Add:
        map2<Tr, Tr>(out, a, b, [](C x, C y) { return C(x + y); });
        return;
      case BinaryOp::Sub:
        map2<Tr, Tr>(out, a, b, [](C x, C y) { return C(x - y); });
        return;
      case BinaryOp::Mul:
        map2<Tr, Tr>(out, a, b, [](C x, C y) { return C(x * y); });
        return;
      case BinaryOp::Div:
        if constexpr (std::is_integral_v<C>) {
          throw std::invalid_argument(std::string("[div] integer division is not supported (") +
                                      dtype_name(a.dtype()) + "); cast to a float dtype first");
        } else {
          map2<Tr, Tr>(out, a, b, [](C x, C y) { return x / y; });
        }
        return;
      case BinaryOp::Maximum:
        // NaN propagates, as torch.maximum.
        map2<Tr, Tr>(out, a, b, [](C x, C y) { return (x != x || x > y) ? x : y; });
        return;
      default:
        return;
    }
  });
}

void CpuBackend::where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (!out.is_contiguous() || cond.shape() != out.shape() || a.shape() != out.shape() ||
      b.shape() != out.shape())
    throw std::logic_error(
        "[where] CPU backend needs inputs expanded to the contiguous output's "
        "shape; got " +
        cond.str() + ", " + a.str() + ", " + b.str() + " -> " + out.str());
  if (cond.dtype() != DType::Bool && cond.dtype() != DType::U8)
    throw std::invalid_argument("[where] condition must be bool, got " + cond.str());
  check_same_dtype("where", a, b);
  check_same_dtype("where", out, a);
  const auto* c = static_cast<const uint8_t*>(cond.data_ptr());
  dispatch_all(a.dtype(), "where", [&](auto tr) {
    using Tr = decltype(tr);
    using S = typename Tr::S;
    auto* o = ptr<Tr>(out);
    const S* ap = ptr<Tr>(a);
    const S* bp = ptr<Tr>(b);
    StridedWalk<3> walk(out.shape(), {&cond.strides(), &a.strides(), &b.strides()});
    parallel_for(out.numel(), kGrain, [&](int64_t s, int64_t e) {
      walk.run(s, e, [&](int64_t i, const std::array<int64_t, 3>& off) {
        o[i] = c[off[0]] ? ap[off[1]] : bp[off[2]];
      });
    });
  });
}

}  // namespace accel
