// Batched GEMM through cuBLASLt: bf16/f16 with fp32 accumulation, fp32 (TF32 tensor cores only
// when allowed), f64. Row-major tensors are handed to the column-major library as their
// transposes: out^T = op(b)^T op(a)^T. Each distinct problem (shapes, dtypes, compute type,
// transposes, batch strides, pointer alignment, beta != 0) gets its descriptors once; the handle,
// workspace, plan cache and the timed algorithm choice are ops/cuda/cublaslt.h's.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "ops/cuda/cublaslt.h"
#include "ops/cuda/cuda_backend.h"
#include "runtime/cuda/context.h"
#include "runtime/kernels.h"

namespace accel {
namespace cuda {
namespace {

bool tf32_from_env() {
  const char* e = std::getenv("ACCEL_ALLOW_TF32");
  return e && (std::strcmp(e, "1") == 0 || std::strcmp(e, "true") == 0);
}
bool g_allow_tf32 = tf32_from_env();

constexpr int64_t kMatmulTag = 1;  // first element of this file's plan keys (fp8_gemm.cpp: 2)

// What defines a problem; to_key() lists every field.
struct Problem {
  DType dtype;  // of a, b, out (= library A, B, C, D)
  bool ta, tb, tf32, beta_nonzero;
  int64_t m, n, k, batch, stride_a, stride_b;
  uint32_t align;
  lt::Key to_key() const {
    return {kMatmulTag,
            static_cast<int64_t>(dtype),
            ta,
            tb,
            tf32,
            beta_nonzero,
            m,
            n,
            k,
            batch,
            stride_a,
            stride_b,
            static_cast<int64_t>(align),
            static_cast<int64_t>(CUBLASLT_EPILOGUE_DEFAULT)};
  }
  std::string str() const {
    return std::string("[matmul] ") + dtype_name(dtype) + " M=" + std::to_string(m) +
           " N=" + std::to_string(n) + " K=" + std::to_string(k) +
           " batch=" + std::to_string(batch) + (ta ? " a^T" : "") + (tb ? " b^T" : "");
  }
};

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::F64:
      return CUDA_R_64F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      throw std::invalid_argument(std::string("[matmul] the CUDA backend has no GEMM for dtype ") +
                                  dtype_name(t));
  }
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                                   int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  ACCEL_LT_CHECK(cublasLtMatrixLayoutCreate(&l, t, static_cast<uint64_t>(rows),
                                            static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    int32_t b = static_cast<int32_t>(batch);
    ACCEL_LT_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof(b)));
    ACCEL_LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                    &stride, sizeof(stride)));
  }
  return l;
}

std::unique_ptr<lt::Plan> make_plan(const Problem& p) {
  auto plan = std::make_unique<lt::Plan>();
  const cudaDataType_t t = cuda_type(p.dtype);
  const bool f64 = p.dtype == DType::F64;
  cublasComputeType_t compute =
      f64 ? CUBLAS_COMPUTE_64F
          : (p.dtype == DType::F32 && p.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  ACCEL_LT_CHECK(cublasLtMatmulDescCreate(&plan->desc, compute, f64 ? CUDA_R_64F : CUDA_R_32F));
  // Library A = our b, library B = our a (see the file comment).
  cublasOperation_t op_a = p.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = p.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  ACCEL_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  ACCEL_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const int64_t m = p.m, n = p.n, k = p.k;
  // b: [K, N] row-major = col-major N x K (ld N); transposed b: [N, K] = col-major K x N (ld K).
  plan->a = p.tb ? make_layout(t, k, n, k, p.batch, p.stride_b)
                 : make_layout(t, n, k, n, p.batch, p.stride_b);
  // a: [M, K] row-major = col-major K x M (ld K); transposed a: [K, M] = col-major M x K (ld M).
  plan->b = p.ta ? make_layout(t, m, k, m, p.batch, p.stride_a)
                 : make_layout(t, k, m, k, p.batch, p.stride_a);
  plan->c = make_layout(t, n, m, n, p.batch, m * n);
  plan->d = make_layout(t, n, m, n, p.batch, m * n);
  plan->min_alignment = p.align;
  plan->what = p.str();
  return plan;
}

}  // namespace

void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
bool allow_tf32() { return g_allow_tf32; }

}  // namespace cuda

void CudaBackend::set_allow_tf32(bool allow) { cuda::set_allow_tf32(allow); }

void CudaBackend::matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a,
                         bool trans_b, double alpha, double beta, const Tensor& addend) {
  using namespace cuda;
  if (!a.device().is_cuda() || !b.device().is_cuda() || a.device() != out.device() ||
      b.device() != out.device())
    throw std::invalid_argument("[matmul] operands on different devices: " + a.str() + ", " +
                                b.str() + " -> " + out.str());
  if (a.dtype() != b.dtype() || out.dtype() != a.dtype())
    throw std::invalid_argument("[matmul] CUDA GEMM needs one dtype for a, b and out; got " +
                                a.str() + ", " + b.str() + " -> " + out.str());
  if (a.dim() != 3 || b.dim() != 3 || out.dim() != 3 || !a.is_contiguous() || !b.is_contiguous() ||
      !out.is_contiguous())
    throw std::logic_error("[matmul] CUDA backend needs contiguous 3-d a, b, out; got " + a.str() +
                           ", " + b.str() + " -> " + out.str());
  const int64_t batch = out.shape()[0], m = out.shape()[1], n = out.shape()[2];
  const int64_t k = trans_a ? a.shape()[1] : a.shape()[2];
  const int64_t am = trans_a ? a.shape()[2] : a.shape()[1];
  const int64_t bk = trans_b ? b.shape()[2] : b.shape()[1];
  const int64_t bn = trans_b ? b.shape()[1] : b.shape()[2];
  if (am != m || bk != k || bn != n || (a.shape()[0] != batch && a.shape()[0] != 1) ||
      (b.shape()[0] != batch && b.shape()[0] != 1))
    throw std::logic_error("[matmul] shapes do not agree: " + a.str() + (trans_a ? "^T" : "") +
                           " @ " + b.str() + (trans_b ? "^T" : "") + " -> " + out.str());
  check_matmul_addend(out, addend);
  // C: the addend, or out itself.
  const Tensor& c = addend.defined() && beta != 0.0 ? addend : out;
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index);
  if (k == 0) {  // empty sum: out = beta * c
    if (beta == 0.0)
      kernels::cuda::fill(out, 0.0);
    else if (beta != 1.0 || c.data_ptr() != out.data_ptr())
      cuda_backend().mul_scalar(out, c, beta);
    return;
  }
  // A batch of row-major a against one shared b is one GEMM with batch * M rows.
  const bool fold = batch > 1 && !trans_a && b.shape()[0] == 1 && a.shape()[0] == batch;
  const Problem p{a.dtype(),
                  trans_a,
                  trans_b,
                  a.dtype() == DType::F32 && allow_tf32(),
                  beta != 0.0,
                  fold ? batch * m : m,
                  n,
                  k,
                  fold ? 1 : batch,
                  a.shape()[0] == 1 ? 0 : m * k,
                  b.shape()[0] == 1 ? 0 : k * n,
                  lt::alignment_of({a.data_ptr(), b.data_ptr(), out.data_ptr(), c.data_ptr()})};
  const int device = out.device().index;
  double al64 = alpha, be64 = beta;
  float al32 = static_cast<float>(alpha), be32 = static_cast<float>(beta);
  const bool f64 = a.dtype() == DType::F64;
  lt::Operands ops = lt::row_major_operands(a, b, out);
  ops.c = c.data_ptr();
  ops.alpha = f64 ? static_cast<const void*>(&al64) : &al32;
  ops.beta = f64 ? static_cast<const void*>(&be64) : &be32;
  ops.beta_nonzero = p.beta_nonzero;
  auto lock = lt::lock();
  lt::matmul(device, lt::plan_for(device, p.to_key(), [&] { return make_plan(p); }), ops);
}

}  // namespace accel
