// Grouped GEMM for the mixture-of-experts layers: every expert's GEMM in one library call.
//
// cuBLASLt (13.1 here) has no grouped GEMM with per-problem shapes (its pointer-array batch mode
// shares one shape); cuBLAS has cublasGemmGroupedBatchedEx (f16/bf16/f32 inputs, fp32 compute,
// no fp8), which takes per-group m, n, k, leading dimensions on the host and the matrix pointers
// as device arrays; a cuBLAS "group" is a batch of equal-shape GEMMs, so consecutive groups of
// ours with equal shapes share one.
//
// Row-major out = op(a) @ op(b) is handed to the column-major library as out^T = op(b)^T op(a)^T
// (library A = our b, library B = our a), as ops/cuda/matmul.cpp does. Groups with no rows or
// columns are left out; groups with inner dimension 0 are zero-filled and left out.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/cuda/cublaslt.h"
#include "ops/cuda/cuda_backend.h"
#include "runtime/cuda/context.h"

namespace accel {
namespace {

std::mutex g_mu;                         // the handles and staging rings are shared by every caller
std::map<int, cublasHandle_t> g_handle;  // per device; leaked on purpose (outlive static tensors)

// Page-locked staging for the pointer arrays, so their upload is a true asynchronous copy (a
// pageable source may make cudaMemcpyAsync wait for the stream). A slot is reused only after the
// copy that read it has run (its event), kSlots calls later.
struct StagingRing {
  static constexpr int kSlots = 8;
  char* host = nullptr;
  size_t slot_bytes = 0;
  cudaEvent_t done[kSlots] = {};
  bool pending[kSlots] = {};
  int next = 0;
};
std::map<int, StagingRing*> g_ring;  // per device; leaked like the handles

// A host slot of at least `bytes` whose previous copy has finished; `slot` is its index.
void* staging_slot(int device, size_t bytes, int& slot) {
  StagingRing*& r = g_ring[device];
  if (!r) {
    r = new StagingRing();
    for (cudaEvent_t& e : r->done)
      ACCEL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  if (bytes > r->slot_bytes) {  // grow: every slot's copy must be done before freeing
    for (int i = 0; i < StagingRing::kSlots; ++i)
      if (r->pending[i]) ACCEL_CUDA_CHECK(cudaEventSynchronize(r->done[i]));
    std::fill(std::begin(r->pending), std::end(r->pending), false);
    if (r->host) cuda::pinned_free(r->host);
    r->slot_bytes = std::max<size_t>(bytes, 4096);
    r->host = static_cast<char*>(cuda::pinned_alloc(r->slot_bytes * StagingRing::kSlots));
  }
  slot = r->next;
  r->next = (r->next + 1) % StagingRing::kSlots;
  if (r->pending[slot]) ACCEL_CUDA_CHECK(cudaEventSynchronize(r->done[slot]));
  r->pending[slot] = false;
  return r->host + static_cast<size_t>(slot) * r->slot_bytes;
}
void staging_used(int device, int slot, cudaStream_t stream) {
  StagingRing* r = g_ring[device];
  ACCEL_CUDA_CHECK(cudaEventRecord(r->done[slot], stream));
  r->pending[slot] = true;
}

cublasHandle_t handle_for(int device) {
  auto it = g_handle.find(device);
  if (it != g_handle.end()) return it->second;
  cublasHandle_t h = nullptr;
  ACCEL_LT_CHECK(cublasCreate(&h));
  // Split-K partial sums stay fp32 even for 16-bit outputs; TF32 only through the compute type.
  ACCEL_LT_CHECK(cublasSetMathMode(
      h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                   CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  g_handle.emplace(device, h);
  return h;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      throw std::invalid_argument(
          std::string("[grouped_linear] the CUDA grouped GEMM supports f32, "
                      "bf16 and f16, not ") +
          dtype_name(t));
  }
}

int to_int(int64_t v, const char* what, int64_t g) {
  if (v > std::numeric_limits<int>::max())
    throw std::invalid_argument("[grouped_linear] group " + std::to_string(g) + ": " + what +
                                " = " + std::to_string(v) +
                                " exceeds the grouped GEMM's int range");
  return static_cast<int>(v);
}

}  // namespace

void CudaBackend::grouped_matmul(const std::vector<Tensor>& outs, const std::vector<Tensor>& as,
                                 const std::vector<Tensor>& bs, bool trans_a, bool trans_b) {
  using namespace cuda;
  const char* op = "grouped_linear";
  const size_t groups = outs.size();
  if (as.size() != groups || bs.size() != groups)
    throw std::invalid_argument(std::string("[") + op + "] " + std::to_string(groups) +
                                " outputs but " + std::to_string(as.size()) + " a and " +
                                std::to_string(bs.size()) + " b operands");
  if (groups == 0) return;
  const DType dtype = outs[0].dtype();
  const Device device = outs[0].device();
  const cudaDataType_t type = cuda_type(dtype);
  if (!device.is_cuda())
    throw std::invalid_argument(std::string("[") + op + "] outputs on " + device.str() +
                                ", not a CUDA device");

  // The problems cuBLAS sees (library terms: m = our N, n = our M, k = our K).
  std::vector<int> m, n, k, lda, ldb, ldc;
  std::vector<const void*> pa, pb;
  std::vector<void*> pc;
  for (size_t g = 0; g < groups; ++g) {
    const Tensor &o = outs[g], &a = as[g], &b = bs[g];
    const auto gi = static_cast<int64_t>(g);
    const std::string what = "group " + std::to_string(g) + ": " + a.str() + (trans_a ? "^T" : "") +
                             " @ " + b.str() + (trans_b ? "^T" : "") + " -> " + o.str();
    if (a.device() != device || b.device() != device || o.device() != device)
      throw std::invalid_argument(std::string("[") + op + "] operands on different devices, " +
                                  what);
    if (a.dtype() != dtype || b.dtype() != dtype || o.dtype() != dtype)
      throw std::invalid_argument(std::string("[") + op + "] all operands need one dtype (" +
                                  dtype_name(dtype) + "), " + what);
    if (a.dim() != 2 || b.dim() != 2 || o.dim() != 2 || !a.is_contiguous() || !b.is_contiguous() ||
        !o.is_contiguous())
      throw std::logic_error(std::string("[") + op +
                             "] CUDA grouped GEMM needs contiguous 2-d operands, " + what);
    const int64_t M = o.shape()[0], N = o.shape()[1];
    const int64_t K = trans_a ? a.shape()[0] : a.shape()[1];
    const int64_t am = trans_a ? a.shape()[1] : a.shape()[0];
    const int64_t bk = trans_b ? b.shape()[1] : b.shape()[0];
    const int64_t bn = trans_b ? b.shape()[0] : b.shape()[1];
    if (am != M || bk != K || bn != N)
      throw std::invalid_argument(std::string("[") + op + "] shapes do not agree, " + what);
    if (M == 0 || N == 0) continue;  // nothing to write
    if (K == 0) {                    // empty sum (0 is the zero of every float dtype's bits)
      DeviceGuard guard(device.index);
      ACCEL_CUDA_CHECK(cudaMemsetAsync(o.data_ptr(), 0, o.nbytes(), current_stream()));
      continue;
    }
    m.push_back(to_int(N, "N", gi));
    n.push_back(to_int(M, "M", gi));
    k.push_back(to_int(K, "K", gi));
    // b: [K, N] row-major = col-major N x K (ld N); b^T stored [N, K] = col-major K x N (ld K).
    lda.push_back(to_int(trans_b ? K : N, "ld b", gi));
    // a: [M, K] row-major = col-major K x M (ld K); a^T stored [K, M] = col-major M x K (ld M).
    ldb.push_back(to_int(trans_a ? M : K, "ld a", gi));
    ldc.push_back(to_int(N, "N", gi));
    pa.push_back(b.data_ptr());
    pb.push_back(a.data_ptr());
    pc.push_back(o.data_ptr());
  }
  const int count = static_cast<int>(m.size());
  if (count == 0) return;

  DeviceGuard guard(device.index);
  const cudaStream_t stream = current_stream();
  // The pointer arrays go to the device in one stream-ordered copy; the caching allocator keeps
  // the device buffer from reuse until the stream has passed this GEMM.
  std::lock_guard<std::mutex> lock(g_mu);
  const size_t ptr_bytes = 3 * static_cast<size_t>(count) * sizeof(void*);
  int slot = 0;
  void** host = static_cast<void**>(staging_slot(device.index, ptr_bytes, slot));
  for (int i = 0; i < count; ++i) {
    host[i] = const_cast<void*>(pa[i]);
    host[count + i] = const_cast<void*>(pb[i]);
    host[2 * count + i] = pc[i];
  }
  DeviceBuffer dev(ptr_bytes, device.index);
  ACCEL_CUDA_CHECK(cudaMemcpyAsync(dev.get(), host, ptr_bytes, cudaMemcpyHostToDevice, stream));
  staging_used(device.index, slot, stream);
  void** d_ptrs = dev.as<void*>();
  const void* const* d_a = d_ptrs;
  const void* const* d_b = d_ptrs + count;
  void* const* d_c = d_ptrs + 2 * count;

  // Runs of consecutive problems with one shape become one cuBLAS group (a batch of equal GEMMs;
  // the pointer arrays stay in problem order), e.g. all experts under balanced routing.
  std::vector<int> gm, gn, gk, glda, gldb, gldc, group_size;
  for (int i = 0; i < count; ++i) {
    if (i > 0 && m[i] == m[i - 1] && n[i] == n[i - 1] && k[i] == k[i - 1]) {
      ++group_size.back();  // equal m, n, k imply equal leading dimensions
      continue;
    }
    gm.push_back(m[i]);
    gn.push_back(n[i]);
    gk.push_back(k[i]);
    glda.push_back(lda[i]);
    gldb.push_back(ldb[i]);
    gldc.push_back(ldc[i]);
    group_size.push_back(1);
  }
  const int cublas_groups = static_cast<int>(group_size.size());
  const std::vector<cublasOperation_t> op_a(cublas_groups, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  const std::vector<cublasOperation_t> op_b(cublas_groups, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  const std::vector<float> alpha(cublas_groups, 1.0f), beta(cublas_groups, 0.0f);
  const cublasComputeType_t compute =
      dtype == DType::F32 && allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublasHandle_t h = handle_for(device.index);
  ACCEL_LT_CHECK(cublasSetStream(h, stream));
  ACCEL_LT_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  const cublasStatus_t s = cublasGemmGroupedBatchedEx(
      h, op_a.data(), op_b.data(), gm.data(), gn.data(), gk.data(), alpha.data(), d_a, type,
      glda.data(), d_b, type, gldb.data(), beta.data(), d_c, type, gldc.data(), cublas_groups,
      group_size.data(), compute);
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("[") + op + "] cublasGemmGroupedBatchedEx (" +
                             dtype_name(dtype) + ", " + std::to_string(count) + " GEMMs in " +
                             std::to_string(cublas_groups) +
                             " groups) failed: " + cublasGetStatusString(s));
}

}  // namespace accel
