// Elementwise ops with numpy broadcasting, and their gradients written with the same ops.
#include <cmath>

#include "ops/common.h"

namespace accel {
using detail::op_error;

namespace {

Tensor run_binary(const char* op_name, BinaryOp op, const Tensor& a, const Tensor& b,
                  DType out_dtype) {
  detail::check_defined(op_name, a, "first input");
  detail::check_defined(op_name, b, "second input");
  detail::check_same_device(op_name, a, b);
  detail::check_same_dtype(op_name, a, b);
  Shape shape = detail::broadcast_shapes(op_name, a.shape(), b.shape());
  Tensor out = Tensor::empty(shape, out_dtype, a.device());
  backend_for(a.device())
      .binary(op, out, detail::expand_raw(a, shape), detail::expand_raw(b, shape));
  return out;
}

Tensor run_unary(UnaryOp op, const Tensor& x) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).unary(op, out, x);
  return out;
}

Tensor zeros_like(const Tensor& x) { return Tensor::zeros(x.shape(), x.dtype(), x.device()); }

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = run_binary("add", BinaryOp::Add, a, b, a.dtype());
  Shape sa = a.shape(), sb = b.shape();
  return record("add", out, {a, b}, [sa, sb](const Tensor& g) {
    return std::vector<Tensor>{sum_to_shape(g, sa), sum_to_shape(g, sb)};
  });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = run_binary("sub", BinaryOp::Sub, a, b, a.dtype());
  Shape sa = a.shape(), sb = b.shape();
  return record("sub", out, {a, b}, [sa, sb](const Tensor& g) {
    return std::vector<Tensor>{sum_to_shape(g, sa), sum_to_shape(neg(g), sb)};
  });
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = run_binary("mul", BinaryOp::Mul, a, b, a.dtype());
  bool ga = a.requires_grad(), gb = b.requires_grad();
  return record("mul", out, {a, b}, [a, b, ga, gb](const Tensor& g) {
    return std::vector<Tensor>{ga ? sum_to_shape(mul(g, b.detach()), a.shape()) : Tensor(),
                               gb ? sum_to_shape(mul(g, a.detach()), b.shape()) : Tensor()};
  });
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = run_binary("div", BinaryOp::Div, a, b, a.dtype());
  bool gb = b.requires_grad();
  Tensor saved_out = out.detach();
  return record("div", out, {a, b}, [a, b, gb, saved_out](const Tensor& g) {
    Tensor bd = b.detach();
    Tensor ga = sum_to_shape(div(g, bd), a.shape());
    // d(a/b)/db = -(a/b)/b
    Tensor gbv = gb ? sum_to_shape(neg(div(mul(g, saved_out), bd)), b.shape()) : Tensor();
    return std::vector<Tensor>{ga, gbv};
  });
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  Tensor out = run_binary("maximum", BinaryOp::Maximum, a, b, a.dtype());
  return record("maximum", out, {a, b}, [a, b](const Tensor& g) {
    Tensor a_wins = greater(b.detach(), a.detach());  // true where b is strictly larger
    Tensor z = zeros_like(g);
    return std::vector<Tensor>{sum_to_shape(where(a_wins, z, g), a.shape()),
                               sum_to_shape(where(a_wins, g, z), b.shape())};
  });
}

Tensor greater(const Tensor& a, const Tensor& b) {
  return run_binary("greater", BinaryOp::Greater, a, b, DType::Bool);
}

Tensor equal(const Tensor& a, const Tensor& b) {
  return run_binary("equal", BinaryOp::Equal, a, b, DType::Bool);
}

Tensor add(const Tensor& a, double s) {
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  backend_for(a.device()).add_scalar(out, a, s);
  return record("add_scalar", out, {a}, [](const Tensor& g) { return std::vector<Tensor>{g}; });
}

Tensor mul(const Tensor& a, double s) {
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  backend_for(a.device()).mul_scalar(out, a, s);
  return record("mul_scalar", out, {a},
                [s](const Tensor& g) { return std::vector<Tensor>{mul(g, s)}; });
}

Tensor pow(const Tensor& a, double e) {
  detail::check_floating("pow", a);
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  backend_for(a.device()).pow_scalar(out, a, e);
  return record("pow", out, {a}, [a, e](const Tensor& g) {
    return std::vector<Tensor>{mul(mul(g, pow(a.detach(), e - 1.0)), e)};
  });
}

Tensor neg(const Tensor& x) {
  return record("neg", run_unary(UnaryOp::Neg, x), {x},
                [](const Tensor& g) { return std::vector<Tensor>{neg(g)}; });
}

Tensor exp(const Tensor& x) {
  detail::check_floating("exp", x);
  Tensor out = run_unary(UnaryOp::Exp, x);
  Tensor y = out.detach();
  return record("exp", out, {x}, [y](const Tensor& g) { return std::vector<Tensor>{mul(g, y)}; });
}

Tensor log(const Tensor& x) {
  detail::check_floating("log", x);
  return record("log", run_unary(UnaryOp::Log, x), {x},
                [x](const Tensor& g) { return std::vector<Tensor>{div(g, x.detach())}; });
}

Tensor sqrt(const Tensor& x) {
  detail::check_floating("sqrt", x);
  Tensor out = run_unary(UnaryOp::Sqrt, x);
  Tensor y = out.detach();
  return record("sqrt", out, {x},
                [y](const Tensor& g) { return std::vector<Tensor>{mul(div(g, y), 0.5)}; });
}

Tensor rsqrt(const Tensor& x) {
  detail::check_floating("rsqrt", x);
  Tensor out = run_unary(UnaryOp::Rsqrt, x);
  Tensor y = out.detach();
  return record("rsqrt", out, {x}, [y](const Tensor& g) {
    return std::vector<Tensor>{mul(mul(g, pow(y, 3.0)), -0.5)};
  });
}

Tensor abs(const Tensor& x) {
  return record("abs", run_unary(UnaryOp::Abs, x), {x}, [x](const Tensor& g) {
    Tensor xd = x.detach();
    Tensor z = zeros_like(xd);
    return std::vector<Tensor>{where(greater(z, xd), neg(g), g)};
  });
}

Tensor sigmoid(const Tensor& x) {
  detail::check_floating("sigmoid", x);
  Tensor out = run_unary(UnaryOp::Sigmoid, x);
  Tensor y = out.detach();
  return record("sigmoid", out, {x}, [y](const Tensor& g) {
    return std::vector<Tensor>{mul(g, mul(y, add(neg(y), 1.0)))};
  });
}

Tensor silu(const Tensor& x) {
  detail::check_floating("silu", x);
  return record("silu", run_unary(UnaryOp::Silu, x), {x}, [x](const Tensor& g) {
    Tensor xd = x.detach();
    Tensor s = sigmoid(xd);
    // d/dx x*s(x) = s + x*s*(1-s)
    return std::vector<Tensor>{mul(g, add(s, mul(mul(xd, s), add(neg(s), 1.0))))};
  });
}

Tensor gelu(const Tensor& x) {
  detail::check_floating("gelu", x);
  return record("gelu", run_unary(UnaryOp::Gelu, x), {x}, [x](const Tensor& g) {
    const double c = std::sqrt(2.0 / M_PI), k = 0.044715;
    Tensor xd = x.detach();
    Tensor x2 = mul(xd, xd);
    Tensor t = tanh(mul(mul(xd, add(mul(x2, k), 1.0)), c));
    // 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 k x^2)
    Tensor left = mul(add(t, 1.0), 0.5);
    Tensor right = mul(mul(mul(xd, add(neg(mul(t, t)), 1.0)), add(mul(x2, 3.0 * k), 1.0)), 0.5 * c);
    return std::vector<Tensor>{mul(g, add(left, right))};
  });
}

Tensor tanh(const Tensor& x) {
  detail::check_floating("tanh", x);
  Tensor out = run_unary(UnaryOp::Tanh, x);
  Tensor y = out.detach();
  return record("tanh", out, {x}, [y](const Tensor& g) {
    return std::vector<Tensor>{mul(g, add(neg(mul(y, y)), 1.0))};
  });
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (cond.dtype() != DType::Bool) op_error("where", "condition must be bool, got " + cond.str());
  detail::check_same_device("where", cond, a);
  detail::check_same_device("where", a, b);
  detail::check_same_dtype("where", a, b);
  Shape shape = detail::broadcast_shapes(
      "where", detail::broadcast_shapes("where", cond.shape(), a.shape()), b.shape());
  Tensor out = Tensor::empty(shape, a.dtype(), a.device());
  backend_for(a.device())
      .where(out, detail::expand_raw(cond, shape), detail::expand_raw(a, shape),
             detail::expand_raw(b, shape));
  Shape sa = a.shape(), sb = b.shape();
  return record("where", out, {cond, a, b}, [cond, sa, sb](const Tensor& g) {
    Tensor z = zeros_like(g);
    return std::vector<Tensor>{Tensor(), sum_to_shape(where(cond, g, z), sa),
                               sum_to_shape(where(cond, z, g), sb)};
  });
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  return where(mask, Tensor::full({}, value, x.dtype(), x.device()), x);
}

}  // namespace accel
