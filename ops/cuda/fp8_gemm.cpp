// The fp8 GEMM on cuBLASLt (Hopper/Ada): out [M, N] = (a [M, K] . b [N, K]^T) * sa * sb.
//
// Row-major buffers are column-major transposes, so with the library's A = b (K x N, ld K,
// transposed) and B = a (K x M, ld K, not transposed) it computes D = out^T (N x M, ld N): the
// "TN" layout, the only one Hopper's fp8 kernels run. The per-tensor scale_inv of each operand is
// passed by device pointer (A_SCALE_POINTER / B_SCALE_POINTER), so scales never visit the host.
// Fast accumulation (no periodic promotion of tensor-core partial sums) is chosen by the caller:
// fprop only, as TE and torchao do. Output types: bf16/f16 for fprop and dgrad, fp32 (C and D
// fp32, a supported fp8 configuration) for the weight gradient (ops/fp8.cpp's wgrad). With an
// addend the GEMM adds it (beta 1, C = the addend, of D's type): an input gradient folds the one
// its input already has, and the chunked LM head sums its weight gradient over row chunks in fp32
// (C = D = out).
//
// The handle, workspace, plan cache and the timed algorithm choice are shared with
// ops/cuda/matmul.cpp (ops/cuda/cublaslt.h).
#include <memory>
#include <stdexcept>
#include <string>

#include "ops/cuda/cublaslt.h"
#include "ops/cuda/cuda_backend.h"
#include "runtime/cuda/context.h"

namespace accel {
namespace {

using accel::cuda::DeviceGuard;
namespace lt = accel::cuda::lt;

constexpr int64_t kFp8Tag = 2;          // first element of this file's plan keys (matmul.cpp: 1)
constexpr int64_t kScalePerTensor = 0;  // the one scale mode: an f32 scalar per operand

// Our view of the problem: out [M, N] = a [M, K] . b [N, K]^T.
struct Problem {
  DType a, b, out;
  int64_t m, n, k;
  bool fast, add;
  uint32_t align;
  lt::Key to_key() const {
    return {kFp8Tag,
            static_cast<int64_t>(a),
            static_cast<int64_t>(b),
            static_cast<int64_t>(out),  // C and D
            static_cast<int64_t>(CUBLAS_COMPUTE_32F),
            m,
            n,
            k,
            fast,
            kScalePerTensor,
            static_cast<int64_t>(align),
            static_cast<int64_t>(CUBLASLT_EPILOGUE_DEFAULT),
            add};
  }
};

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::E4M3:
      return CUDA_R_8F_E4M3;
    case DType::E5M2:
      return CUDA_R_8F_E5M2;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    case DType::F32:
      return CUDA_R_32F;
    default:
      throw std::invalid_argument(std::string("[fp8_gemm] no cuBLASLt type for ") + dtype_name(t));
  }
}

std::string problem(const Problem& p) {
  return std::string("[fp8_gemm] ") + dtype_name(p.a) + " a [" + std::to_string(p.m) + ", " +
         std::to_string(p.k) + "] x " + dtype_name(p.b) + " b [" + std::to_string(p.n) + ", " +
         std::to_string(p.k) + "]^T -> " + dtype_name(p.out) +
         (p.fast ? " (fast accumulation)" : "") + (p.add ? " (plus an addend)" : "");
}

std::unique_ptr<lt::Plan> make_plan(const Problem& p) {
  auto plan = std::make_unique<lt::Plan>();
  ACCEL_LT_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  ACCEL_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  ACCEL_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int8_t fast = p.fast ? 1 : 0;
  ACCEL_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                sizeof(fast)));
  // Library A = our b: K x N column-major (ld K), read transposed. Library B = our a: K x M.
  // D = out^T: N x M (ld N).
  ACCEL_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, lt_type(p.b), p.k, p.n, p.k));
  ACCEL_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, lt_type(p.a), p.k, p.m, p.k));
  ACCEL_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->c, lt_type(p.out), p.n, p.m, p.n));
  ACCEL_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->d, lt_type(p.out), p.n, p.m, p.n));
  plan->min_alignment = p.align;
  plan->what = problem(p);
  plan->no_algo_hint = "; fp8 GEMMs need compute capability 8.9 or newer (Ada, Hopper)";
  // The scale pointers (which select scaled kernels) are set per call, before the first call's
  // heuristic query.
  return plan;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void CudaBackend::fp8_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                           const Tensor& b, const Tensor& b_scale_inv, bool fast_accum,
                           const Tensor& addend) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  if (K % 16 != 0)
    throw std::invalid_argument("[fp8_gemm] the contraction dimension K=" + std::to_string(K) +
                                " must be a multiple of 16 for cuBLASLt fp8 GEMMs (pad it)");
  if ((N * static_cast<int64_t>(out.element_size())) % 16 != 0)
    throw std::invalid_argument("[fp8_gemm] N=" + std::to_string(N) + " rows of " +
                                dtype_name(out.dtype()) +
                                " output are not 16-byte aligned (pad N to a multiple of " +
                                std::to_string(16 / out.element_size()) + ")");
  const bool add = addend.defined();
  const Tensor& c = add ? addend : out;
  if (!aligned16(a.data_ptr()) || !aligned16(b.data_ptr()) || !aligned16(out.data_ptr()) ||
      !aligned16(c.data_ptr()))
    throw std::invalid_argument("[fp8_gemm] operands must start on 16-byte boundaries");
  DeviceGuard guard(out.device().index);
  const int device = out.device().index;
  const Problem p{a.dtype(),
                  b.dtype(),
                  out.dtype(),
                  M,
                  N,
                  K,
                  fast_accum,
                  add,
                  lt::alignment_of({a.data_ptr(), b.data_ptr(), out.data_ptr(), c.data_ptr()})};
  const float alpha = 1.0f, beta = add ? 1.0f : 0.0f;
  lt::Operands ops = lt::row_major_operands(a, b, out);
  ops.c = c.data_ptr();
  ops.alpha = &alpha;
  ops.beta = &beta;
  ops.beta_nonzero = add;
  auto lock = lt::lock();
  lt::Plan& plan = lt::plan_for(device, p.to_key(), [&] { return make_plan(p); });
  const void* sa = b_scale_inv.data_ptr();  // library A is our b, library B our a
  const void* sb = a_scale_inv.data_ptr();
  ACCEL_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                &sa, sizeof(sa)));
  ACCEL_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                &sb, sizeof(sb)));
  lt::matmul(device, plan, ops);
}

}  // namespace accel
