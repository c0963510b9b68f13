// Batched GEMM through cuBLASLt: bf16/f16 with fp32 accumulation, fp32 (TF32 tensor cores only
// when allowed), f64. Row-major tensors are handed to the column-major library as their
// transposes: out^T = op(b)^T op(a)^T. Each distinct problem (shapes, dtypes, transposes, batch
// strides, pointer alignment) gets its descriptors and heuristic algorithm once and is cached.
#include <cublasLt.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "ops/cuda/cuda_backend.h"
#include "runtime/cuda/context.h"
#include "runtime/kernels.h"

namespace accel {
namespace cuda {
namespace {

void check_lt(cublasStatus_t s, const char* call, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(call) + " failed at ops/cuda/matmul.cpp:" +
                             std::to_string(line) + ": " + cublasLtGetStatusString(s));
}
#define LT_CHECK(expr) check_lt((expr), #expr, __LINE__)

bool tf32_from_env() {
  const char* e = std::getenv("ACCEL_ALLOW_TF32");
  return e && (std::strcmp(e, "1") == 0 || std::strcmp(e, "true") == 0);
}
bool g_allow_tf32 = tf32_from_env();

constexpr size_t kWorkspaceBytes = 32u << 20;

struct Key {
  DType dtype;
  bool ta, tb, tf32;
  int64_t m, n, k, batch, stride_a, stride_b, align;
  bool operator<(const Key& o) const {
    return std::tie(dtype, ta, tb, tf32, m, n, k, batch, stride_a, stride_b, align) <
           std::tie(o.dtype, o.ta, o.tb, o.tf32, o.m, o.n, o.k, o.batch, o.stride_a, o.stride_b,
                    o.align);
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // library's A, B, C=D
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer workspace;
  std::map<Key, std::unique_ptr<Plan>> plans;
};

std::mutex g_mu;
DeviceState* g_state[16] = {};

DeviceState& state(int device) {
  if (!g_state[device]) {
    auto* s = new DeviceState();  // lives for the process: handles outlive static tensors
    LT_CHECK(cublasLtCreate(&s->handle));
    s->workspace = DeviceBuffer(kWorkspaceBytes, device);
    g_state[device] = s;
  }
  return *g_state[device];
}

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
  LT_CHECK(cublasLtMatrixLayoutCreate(&l, t, static_cast<uint64_t>(rows),
                                      static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    int32_t b = static_cast<int32_t>(batch);
    LT_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof(b)));
    LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                              &stride, sizeof(stride)));
  }
  return l;
}

int64_t alignment_of(std::initializer_list<const void*> ps) {
  int64_t a = 256;
  for (const void* p : ps)
    while (a > 1 && (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a)) != 0) a /= 2;
  return a;
}

Plan& get_plan(DeviceState& st, const Key& key) {
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t t = cuda_type(key.dtype);
  const bool f64 = key.dtype == DType::F64;
  cublasComputeType_t compute =
      f64 ? CUBLAS_COMPUTE_64F
          : (key.dtype == DType::F32 && key.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                 : CUBLAS_COMPUTE_32F);
  LT_CHECK(cublasLtMatmulDescCreate(&plan->desc, compute, f64 ? CUDA_R_64F : CUDA_R_32F));
  // Library A = our b, library B = our a (see the file comment).
  cublasOperation_t op_a = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const int64_t m = key.m, n = key.n, k = key.k;
  // b: [K, N] row-major = col-major N x K (ld N); transposed b: [N, K] = col-major K x N (ld K).
  plan->la = key.tb ? make_layout(t, k, n, k, key.batch, key.stride_b)
                    : make_layout(t, n, k, n, key.batch, key.stride_b);
  // a: [M, K] row-major = col-major K x M (ld K); transposed a: [K, M] = col-major M x K (ld M).
  plan->lb = key.ta ? make_layout(t, m, k, m, key.batch, key.stride_a)
                    : make_layout(t, k, m, k, key.batch, key.stride_a);
  plan->lc = make_layout(t, n, m, n, key.batch, m * n);

  cublasLtMatmulPreference_t pref = nullptr;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = kWorkspaceBytes;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                sizeof(ws)));
  uint32_t align = static_cast<uint32_t>(key.align);
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(st.handle, plan->desc, plan->la, plan->lb,
                                                    plan->lc, plan->lc, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0)
    throw std::runtime_error(
        "[matmul] cuBLASLt found no algorithm for " + std::string(dtype_name(key.dtype)) +
        " M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k) +
        " batch=" + std::to_string(key.batch) + " (" + cublasLtGetStatusString(s) + ")");
  plan->algo = result.algo;
  Plan& ref = *plan;
  st.plans.emplace(key, std::move(plan));
  return ref;
}

}  // namespace

void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
bool allow_tf32() { return g_allow_tf32; }

}  // namespace cuda

void CudaBackend::set_allow_tf32(bool allow) { cuda::set_allow_tf32(allow); }

void CudaBackend::matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a,
                         bool trans_b, double alpha, double beta) {
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
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index);
  if (k == 0) {  // empty sum: out = beta * out
    if (beta == 0.0)
      kernels::cuda::fill(out, 0.0);
    else if (beta != 1.0)
      cuda_backend().mul_scalar(out, out, beta);
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  DeviceState& st = state(out.device().index);
  // A batch of row-major a against one shared b is one GEMM with batch * M rows.
  const bool fold = batch > 1 && !trans_a && b.shape()[0] == 1 && a.shape()[0] == batch;
  Key key{a.dtype(),
          trans_a,
          trans_b,
          a.dtype() == DType::F32 && allow_tf32(),
          fold ? batch * m : m,
          n,
          k,
          fold ? 1 : batch,
          a.shape()[0] == 1 ? 0 : m * k,
          b.shape()[0] == 1 ? 0 : k * n,
          alignment_of({a.data_ptr(), b.data_ptr(), out.data_ptr()})};
  Plan& plan = get_plan(st, key);
  cudaStream_t stream = current_stream();
  if (a.dtype() == DType::F64) {
    double al = alpha, be = beta;
    LT_CHECK(cublasLtMatmul(st.handle, plan.desc, &al, b.data_ptr(), plan.la, a.data_ptr(), plan.lb,
                            &be, out.data_ptr(), plan.lc, out.data_ptr(), plan.lc, &plan.algo,
                            st.workspace.get(), kWorkspaceBytes, stream));
  } else {
    float al = static_cast<float>(alpha), be = static_cast<float>(beta);
    LT_CHECK(cublasLtMatmul(st.handle, plan.desc, &al, b.data_ptr(), plan.la, a.data_ptr(), plan.lb,
                            &be, out.data_ptr(), plan.lc, out.data_ptr(), plan.lc, &plan.algo,
                            st.workspace.get(), kWorkspaceBytes, stream));
  }
}

}  // namespace accel
