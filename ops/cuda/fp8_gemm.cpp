// The fp8 GEMM on cuBLASLt (Hopper/Ada): out [M, N] = (a [M, K] . b [N, K]^T) * sa * sb.
//
// Row-major buffers are column-major transposes, so with the library's A = b (K x N, ld K,
// transposed) and B = a (K x M, ld K, not transposed) it computes D = out^T (N x M, ld N): the
// "TN" layout, the only one Hopper's fp8 kernels run. The per-tensor scale_inv of each operand is
// passed by device pointer (A_SCALE_POINTER / B_SCALE_POINTER), so scales never visit the host.
// Fast accumulation (no periodic promotion of tensor-core partial sums) is chosen by the caller:
// fprop only, as TE and torchao do. Output types: bf16/f16 for fprop and dgrad, fp32 (C and D
// fp32, a supported fp8 configuration) for the weight gradient (ops/fp8.cpp's wgrad).
//
// The handle, workspace and plans are this file's own (one per device); ops/cuda/matmul.cpp keeps
// its cuBLASLt state private.
#include <cublasLt.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "ops/cuda/cuda_backend.h"
#include "ops/fp8_kernels.h"
#include "runtime/cuda/context.h"

namespace accel::fp8_kernels::cuda {
namespace {

using accel::cuda::current_stream;
using accel::cuda::DeviceBuffer;
using accel::cuda::DeviceGuard;

void check_lt(cublasStatus_t s, const char* call, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("[fp8_gemm] ") + call +
                             " failed at ops/cuda/fp8_gemm.cpp:" + std::to_string(line) + ": " +
                             cublasLtGetStatusString(s));
}
#define FP8_LT_CHECK(expr) check_lt((expr), #expr, __LINE__)

constexpr size_t kWorkspaceBytes = 32u << 20;

struct Key {
  DType a, b, out;
  int64_t m, n, k;
  bool fast;
  bool operator<(const Key& o) const {
    return std::tie(a, b, out, m, n, k, fast) < std::tie(o.a, o.b, o.out, o.m, o.n, o.k, o.fast);
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer workspace;
  std::map<Key, std::unique_ptr<Plan>> plans;
};

std::mutex g_mu;
DeviceState* g_state[64] = {};

DeviceState& state(int device) {
  if (device < 0 || device >= 64) throw std::logic_error("[fp8_gemm] device index out of range");
  if (!g_state[device]) {
    auto* s = new DeviceState();  // lives for the process, like the tensors that may use it
    FP8_LT_CHECK(cublasLtCreate(&s->handle));
    s->workspace = DeviceBuffer(kWorkspaceBytes, device);
    g_state[device] = s;
  }
  return *g_state[device];
}

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

std::string problem(const Key& k) {
  return std::string(dtype_name(k.a)) + " a [" + std::to_string(k.n) + ", " + std::to_string(k.k) +
         "] x " + dtype_name(k.b) + " b [" + std::to_string(k.m) + ", " + std::to_string(k.k) +
         "] -> " + dtype_name(k.out);
}

// Key in cuBLAS terms: m = N (rows of D), n = M, k = K; a/b are OUR operands.
Plan& get_plan(DeviceState& st, const Key& key) {
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>();
  FP8_LT_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP8_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  FP8_LT_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int8_t fast = key.fast ? 1 : 0;
  FP8_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                              sizeof(fast)));
  // Library A = our b: K x N column-major (ld K), read transposed. Library B = our a: K x M.
  FP8_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->la, lt_type(key.b), key.k, key.m, key.k));
  FP8_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, lt_type(key.a), key.k, key.n, key.k));
  FP8_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->ld, lt_type(key.out), key.m, key.n, key.m));
  // Scale pointers must be set before the heuristic query (they select scaled kernels); any
  // device address will do here, the real ones are set per call.
  cublasLtMatmulPreference_t pref = nullptr;
  FP8_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = kWorkspaceBytes;
  FP8_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof(ws)));
  float* dummy = st.workspace.as<float>();
  FP8_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                              &dummy, sizeof(dummy)));
  FP8_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                              &dummy, sizeof(dummy)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(st.handle, plan->desc, plan->la, plan->lb,
                                                    plan->ld, plan->ld, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0)
    throw std::runtime_error("[fp8_gemm] cuBLASLt has no fp8 kernel for " + problem(key) + " (" +
                             cublasLtGetStatusString(s) +
                             "); fp8 GEMMs need compute capability 8.9 or newer (Ada, Hopper)");
  plan->algo = result.algo;
  Plan& ref = *plan;
  st.plans.emplace(key, std::move(plan));
  return ref;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
          const Tensor& b_scale_inv, bool fast_accum) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  if (K % 16 != 0)
    throw std::invalid_argument("[fp8_gemm] the contraction dimension K=" + std::to_string(K) +
                                " must be a multiple of 16 for cuBLASLt fp8 GEMMs (pad it)");
  if ((N * static_cast<int64_t>(out.element_size())) % 16 != 0)
    throw std::invalid_argument("[fp8_gemm] N=" + std::to_string(N) + " rows of " +
                                dtype_name(out.dtype()) +
                                " output are not 16-byte aligned (pad N to a multiple of " +
                                std::to_string(16 / out.element_size()) + ")");
  if (!aligned16(a.data_ptr()) || !aligned16(b.data_ptr()) || !aligned16(out.data_ptr()))
    throw std::invalid_argument("[fp8_gemm] operands must start on 16-byte boundaries");
  DeviceGuard guard(out.device().index);
  std::lock_guard<std::mutex> lock(g_mu);
  DeviceState& st = state(out.device().index);
  Key key{a.dtype(), b.dtype(), out.dtype(), N, M, K, fast_accum};
  Plan& plan = get_plan(st, key);
  // Library A is our b, library B our a.
  const void* sa = b_scale_inv.data_ptr();
  const void* sb = a_scale_inv.data_ptr();
  FP8_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa,
                                              sizeof(sa)));
  FP8_LT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb,
                                              sizeof(sb)));
  const float alpha = 1.0f, beta = 0.0f;
  FP8_LT_CHECK(cublasLtMatmul(st.handle, plan.desc, &alpha, b.data_ptr(), plan.la, a.data_ptr(),
                              plan.lb, &beta, out.data_ptr(), plan.ld, out.data_ptr(), plan.ld,
                              &plan.algo, st.workspace.get(), kWorkspaceBytes, current_stream()));
}

}  // namespace accel::fp8_kernels::cuda
