// The per-row / per-block scaled fp8 GEMM on cuBLASLt (Backend::fp8_gemm_scaled): out [M, N] =
// a [M, K] . b [N, K]^T with each operand's scales in a cuBLASLt 13 scale mode. The layout ("TN",
// the library's A = our b) and the plan cache are those of ops/cuda/fp8_gemm.cpp.
#include <cuda_runtime_api.h>

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

constexpr int64_t kFp8Tag =
    3;  // first element of this file's plan keys (matmul.cpp 1, fp8_gemm.cpp 2)

// Our view of the problem: out [M, N] = a [M, K] . b [N, K]^T.
struct Problem {
  DType a, b, out;
  int64_t m, n, k;
  bool fast;
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
            0,  // the scale modes go into key[12], key[13]
            static_cast<int64_t>(align),
            static_cast<int64_t>(CUBLASLT_EPILOGUE_DEFAULT)};
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
         (p.fast ? " (fast accumulation)" : "");
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

// ---- per-row / per-block scaled GEMMs (rowwise and blockwise recipes) -------------------------
//
// cuBLASLt 13's scale modes (CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE), in the library's terms, where
// library A is our b and library B our a (as above):
//   OUTER_VEC_32F   A's scales are a vector over its M (our b's rows), B's over its N (our a's
//   rows) VEC128_32F      one scale per 128 elements along K, each K block's row scales contiguous
//                   (f32 [ceil(K/128), rows])
//   BLK128x128_32F  one scale per 128x128 block, K blocks contiguous, the scale tensor's rows
//                   padded to 4 (f32 [ceil(rows/128), round_up(ceil(K/128), 4)])
// These are Fp8ScaleMode's layouts (ops/fp8.h) for our row-major [rows, K] operands. Hopper runs
// the 1D/2D block modes from CUDA 12.9 on sm_90 only (Blackwell has MX modes instead), outer-vector
// scaling on sm_90 and newer; ops/fp8.cpp admits only the mode pairs cuBLASLt takes, and anything
// the library still refuses (no algorithm for a shape or output type) fails by name here, never
// falling back to another scaling.
int32_t lt_scale_mode(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::Row:
      return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case Fp8ScaleMode::Block1x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8ScaleMode::Block128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  throw std::logic_error("[fp8_gemm_scaled] unknown scale mode");
}

}  // namespace

void CudaBackend::fp8_gemm_scaled(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                                  Fp8ScaleMode a_mode, const Tensor& b, const Tensor& b_scale_inv,
                                  Fp8ScaleMode b_mode, bool fast_accum) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  const std::string modes = std::string(" (a scaled by ") + fp8_scale_mode_name(a_mode) +
                            ", b by " + fp8_scale_mode_name(b_mode) + ")";
  if (K % 16 != 0 || M % 16 != 0 || N % 16 != 0)
    throw std::invalid_argument("[fp8_gemm_scaled] a [" + std::to_string(M) + ", " +
                                std::to_string(K) + "] and b [" + std::to_string(N) + ", " +
                                std::to_string(K) + "] must be padded to multiples of 16" + modes);
  if (!aligned16(a.data_ptr()) || !aligned16(b.data_ptr()) || !aligned16(out.data_ptr()))
    throw std::invalid_argument("[fp8_gemm_scaled] operands must start on 16-byte boundaries");
  DeviceGuard guard(out.device().index);
  const int device = out.device().index;
  const bool block = a_mode != Fp8ScaleMode::Row || b_mode != Fp8ScaleMode::Row;
  const size_t lt_version = cublasLtGetVersion();
  if (lt_version < 120900)
    throw std::runtime_error(
        "[fp8_gemm_scaled] per-row and per-block fp8 scales need cuBLASLt "
        "12.9 or newer; this process loaded cuBLASLt " +
        std::to_string(lt_version) + modes);
  int major = 0;
  ACCEL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (block && major != 9)
    throw std::runtime_error(
        "[fp8_gemm_scaled] cuBLASLt's 1x128 / 128x128 block-scaled fp8 GEMMs run on Hopper "
        "(sm_90) only; this device has compute capability " +
        std::to_string(major) + ".x" + modes);
  if (!block && major < 9)
    throw std::runtime_error(
        "[fp8_gemm_scaled] cuBLASLt's rowwise (outer-vector) fp8 scaling needs compute "
        "capability 9.0 or newer; this device has " +
        std::to_string(major) + ".x" + modes);
  const Problem p{a.dtype(),   b.dtype(),
                  out.dtype(), M,
                  N,           K,
                  fast_accum,  lt::alignment_of({a.data_ptr(), b.data_ptr(), out.data_ptr()})};
  lt::Key key = p.to_key();
  key[12] = lt_scale_mode(b_mode);  // library A
  key[13] = lt_scale_mode(a_mode);  // library B
  const float alpha = 1.0f, beta = 0.0f;
  lt::Operands ops = lt::row_major_operands(a, b, out);
  ops.alpha = &alpha;
  ops.beta = &beta;
  ops.beta_nonzero = false;
  auto lock = lt::lock();
  lt::Plan& plan = lt::plan_for(device, key, [&] {
    auto plan = make_plan(p);
    const int32_t ma = lt_scale_mode(b_mode), mb = lt_scale_mode(a_mode);
    ACCEL_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                  &ma, sizeof(ma)));
    ACCEL_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                  &mb, sizeof(mb)));
    plan->what = problem(p) + modes;
    plan->no_algo_hint =
        "; cuBLASLt 13 has no kernel for this scale-mode pair, shape and output type on this GPU "
        "(nothing else is tried)";
    return plan;
  });
  const void* sa = b_scale_inv.data_ptr();  // library A is our b, library B our a
  const void* sb = a_scale_inv.data_ptr();
  ACCEL_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                &sa, sizeof(sa)));
  ACCEL_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                &sb, sizeof(sb)));
  lt::matmul(device, plan, ops);
}

}  // namespace accel
