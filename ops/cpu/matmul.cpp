// Batched GEMM through Eigen: f32 and f64 natively, the 16- and 8-bit floats through float copies
// rounded back on store. Eigen threads each GEMM (OpenMP); many small GEMMs run one per thread.
#include <Eigen/Core>
#include <cstring>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel {
namespace {
using namespace cpu;

template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct GemmShape {
  int64_t batch, a_batch, b_batch, a_rows, a_cols, b_rows, b_cols, m, n, k;
};

// out = alpha * op(a) @ op(b) + beta * out for one matrix each; a is [a_rows, a_cols] row-major.
template <class T>
void gemm_one(T* out, const T* a, const T* b, const GemmShape& s, bool ta, bool tb, T alpha,
              T beta) {
  Eigen::Map<RowMat<T>> o(out, s.m, s.n);
  if (s.k == 0) {
    if (beta == T(0))
      o.setZero();
    else
      o *= beta;
    return;
  }
  Eigen::Map<const RowMat<T>> am(a, s.a_rows, s.a_cols);
  Eigen::Map<const RowMat<T>> bm(b, s.b_rows, s.b_cols);
  auto run = [&](const auto& A, const auto& B) {
    if (beta == T(0)) {
      o.noalias() = alpha * (A * B);  // never reads out (it may hold garbage)
    } else {
      if (beta != T(1)) o *= beta;
      o.noalias() += alpha * (A * B);
    }
  };
  if (!ta && !tb)
    run(am, bm);
  else if (ta && !tb)
    run(am.transpose(), bm);
  else if (!ta && tb)
    run(am, bm.transpose());
  else
    run(am.transpose(), bm.transpose());
}

template <class T>
void gemm_batched(T* out, const T* a, const T* b, const GemmShape& s, bool ta, bool tb, T alpha,
                  T beta) {
  const int64_t a_size = s.a_rows * s.a_cols, b_size = s.b_rows * s.b_cols, o_size = s.m * s.n;
  auto one = [&](int64_t i) {
    gemm_one<T>(out + i * o_size, a + (s.a_batch == 1 ? 0 : i * a_size),
                b + (s.b_batch == 1 ? 0 : i * b_size), s, ta, tb, alpha, beta);
  };
  // Small matrices: one GEMM per thread (Eigen stays single-threaded inside a parallel region).
  // Large ones: one at a time, each threaded by Eigen.
  const int64_t work = s.m * s.n * std::max<int64_t>(s.k, 1);
  if (s.batch > 1 && work < (int64_t{1} << 21)) {
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(work, 1));
    parallel_for(s.batch, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) one(i);
    });
  } else {
    for (int64_t i = 0; i < s.batch; ++i) one(i);
  }
}

}  // namespace

void CpuBackend::matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a,
                        bool trans_b, double alpha, double beta, const Tensor& addend) {
  if (a.dim() != 3 || b.dim() != 3 || out.dim() != 3 || !a.is_contiguous() || !b.is_contiguous() ||
      !out.is_contiguous())
    throw std::logic_error("[matmul] CPU backend needs contiguous 3-d operands; got " + a.str() +
                           " @ " + b.str() + " -> " + out.str());
  if (a.dtype() != b.dtype() || out.dtype() != a.dtype())
    throw std::invalid_argument(std::string("[matmul] dtype mismatch: ") + a.str() + " @ " +
                                b.str() + " -> " + out.str());
  GemmShape s;
  s.a_batch = a.shape()[0];
  s.b_batch = b.shape()[0];
  s.batch = out.shape()[0];
  s.a_rows = a.shape()[1];
  s.a_cols = a.shape()[2];
  s.b_rows = b.shape()[1];
  s.b_cols = b.shape()[2];
  s.m = trans_a ? s.a_cols : s.a_rows;
  s.k = trans_a ? s.a_rows : s.a_cols;
  s.n = trans_b ? s.b_rows : s.b_cols;
  const int64_t kb = trans_b ? s.b_cols : s.b_rows;
  if (kb != s.k || out.shape()[1] != s.m || out.shape()[2] != s.n ||
      (s.a_batch != s.batch && s.a_batch != 1) || (s.b_batch != s.batch && s.b_batch != 1))
    throw std::logic_error("[matmul] shapes do not line up: " + a.str() + (trans_a ? "^T" : "") +
                           " @ " + b.str() + (trans_b ? "^T" : "") + " -> " + out.str());
  const bool add = addend.defined() && beta != 0.0;
  check_matmul_addend(out, addend);
  if (out.numel() == 0) return;
  // f32 / f64 accumulate into out itself: the addend is copied there first (exactly).
  const bool wide = a.dtype() == DType::F32 || a.dtype() == DType::F64;
  if (add && wide && addend.data_ptr() != out.data_ptr())
    std::memcpy(out.data_ptr(), addend.data_ptr(), out.nbytes());
  switch (a.dtype()) {
    case DType::F32:
      gemm_batched<float>(out.data<float>(), a.data<float>(), b.data<float>(), s, trans_a, trans_b,
                          static_cast<float>(alpha), static_cast<float>(beta));
      return;
    case DType::F64:
      gemm_batched<double>(out.data<double>(), a.data<double>(), b.data<double>(), s, trans_a,
                           trans_b, alpha, beta);
      return;
    default: {
      if (!is_floating(a.dtype())) unsupported_dtype("matmul", a.dtype());
      std::vector<float> af = load_as<float>(a), bf = load_as<float>(b);
      std::vector<float> of = beta != 0.0 ? load_as<float>(add ? addend : out)
                                          : std::vector<float>(static_cast<size_t>(out.numel()));
      gemm_batched<float>(of.data(), af.data(), bf.data(), s, trans_a, trans_b,
                          static_cast<float>(alpha), static_cast<float>(beta));
      store_from(out, of);
      return;
    }
  }
}

}  // namespace accel
