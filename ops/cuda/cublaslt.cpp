// Shared cuBLASLt handle/workspace, plan cache and timed algorithm choice (see cublaslt.h).
#include "ops/cuda/cublaslt.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "runtime/cuda/context.h"

namespace accel::cuda::lt {
namespace {

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer workspace;
  std::map<Key, std::unique_ptr<Plan>> plans;
};

std::mutex g_mu;
std::map<int, DeviceState*> g_states;  // leaked on purpose: handles outlive static tensors

bool tuning_from_env() {
  const char* e = std::getenv("ACCEL_GEMM_TUNING");
  if (!e) return true;
  return !(std::strcmp(e, "0") == 0 || std::strcmp(e, "false") == 0 || std::strcmp(e, "off") == 0);
}
bool g_tuning = tuning_from_env();
TuningStats g_stats;

DeviceState& state(int device) {
  auto it = g_states.find(device);
  if (it != g_states.end()) return *it->second;
  auto* s = new DeviceState();
  ACCEL_LT_CHECK(cublasLtCreate(&s->handle));
  s->workspace = DeviceBuffer(kWorkspaceBytes, device);
  g_states.emplace(device, s);
  return *s;
}

bool overlaps(const void* p, size_t np, const void* q, size_t nq) {
  if (!p || !q || np == 0 || nq == 0) return false;
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return a < b + nq && b < a + np;
}

cublasStatus_t run_algo(const DeviceState& st, const Plan& plan, const cublasLtMatmulAlgo_t& algo,
                        const Operands& ops, void* d, cudaStream_t stream) {
  return cublasLtMatmul(st.handle, plan.desc, ops.alpha, ops.a, plan.a, ops.b, plan.b, ops.beta,
                        ops.c, plan.c, d, plan.d, &algo, st.workspace.get(), kWorkspaceBytes,
                        stream);
}

struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  Preference() { ACCEL_LT_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(p); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

// Up to kMaxCandidates usable algorithms, the heuristic's best first.
std::vector<cublasLtMatmulAlgo_t> candidates(const DeviceState& st, const Plan& plan) {
  Preference pref;
  const uint64_t ws = kWorkspaceBytes;
  ACCEL_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t align = plan.min_alignment;
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    ACCEL_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, attr, &align, sizeof(align)));
  cublasLtMatmulHeuristicResult_t results[kMaxCandidates] = {};
  int found = 0;
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(st.handle, plan.desc, plan.a, plan.b, plan.c, plan.d, pref.p,
                                     kMaxCandidates, results, &found);
  std::vector<cublasLtMatmulAlgo_t> out;
  if (s == CUBLAS_STATUS_SUCCESS)
    for (int i = 0; i < found && i < kMaxCandidates; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kWorkspaceBytes)
        out.push_back(results[i].algo);
  if (out.empty())
    throw std::runtime_error(plan.what + ": cuBLASLt found no algorithm (" +
                             cublasLtGetStatusString(s) + ")" + plan.no_algo_hint);
  return out;
}

// Sets plan.algo: the fastest candidate on the caller's operands, or the heuristic's first.
void choose(int device, DeviceState& st, Plan& plan, const Operands& ops, cudaStream_t stream) {
  const std::vector<cublasLtMatmulAlgo_t> cands = candidates(st, plan);
  auto take_first = [&] {
    plan.algo = cands.front();
    plan.has_algo = true;
    g_stats.heuristic_only++;
  };
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  ACCEL_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (!g_tuning || cands.size() == 1 || capture != cudaStreamCaptureStatusNone) {
    take_first();  // (no synchronizing timing inside a graph capture)
    return;
  }
  // Timing runs must not touch the caller's result where it is read (beta != 0) or aliases an
  // input: they then write a scratch D (C is only read, so it stays the caller's).
  void* target = ops.d;
  DeviceBuffer scratch;
  if (ops.beta_nonzero || overlaps(ops.d, ops.d_bytes, ops.a, ops.a_bytes) ||
      overlaps(ops.d, ops.d_bytes, ops.b, ops.b_bytes)) {
    try {
      scratch = DeviceBuffer(ops.d_bytes, device);
    } catch (const std::exception&) {  // no room for a scratch output: don't tune this one
      take_first();
      return;
    }
    target = scratch.get();
  }
  Event start, stop;
  float best_ms = std::numeric_limits<float>::infinity();
  size_t best = 0;
  bool any = false;
  for (size_t i = 0; i < cands.size(); ++i) {
    bool ok =
        run_algo(st, plan, cands[i], ops, target, stream) == CUBLAS_STATUS_SUCCESS;  // warm-up
    if (ok) {
      start.record(stream);
      for (int r = 0; r < 3 && ok; ++r)
        ok = run_algo(st, plan, cands[i], ops, target, stream) == CUBLAS_STATUS_SUCCESS;
      stop.record(stream);
      stop.synchronize();
    }
    if (!ok) {
      (void)cudaGetLastError();  // clear a failed launch so later launch checks don't see it
      g_stats.skipped_candidates++;
      continue;
    }
    const float ms = start.elapsed_ms(stop);
    if (!any || ms < best_ms) {
      best_ms = ms;
      best = i;
      any = true;
    }
  }
  plan.algo = cands[best];  // none ran: the first, whose real run reports the error
  plan.has_algo = true;
  g_stats.tuned++;
}

}  // namespace

void check(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                             ": " + cublasLtGetStatusString(s));
}

Plan::~Plan() {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (d) cublasLtMatrixLayoutDestroy(d);
  if (desc) cublasLtMatmulDescDestroy(desc);
}

std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(g_mu); }

Plan* find_plan(int device, const Key& key) {
  DeviceState& st = state(device);
  auto it = st.plans.find(key);
  return it == st.plans.end() ? nullptr : it->second.get();
}

Plan& add_plan(int device, const Key& key, std::unique_ptr<Plan> plan) {
  auto& slot = state(device).plans[key];
  slot = std::move(plan);
  return *slot;
}

Operands row_major_operands(const Tensor& a, const Tensor& b, const Tensor& out) {
  Operands ops;
  ops.a = b.data_ptr();
  ops.a_bytes = b.nbytes();
  ops.b = a.data_ptr();
  ops.b_bytes = a.nbytes();
  ops.c = out.data_ptr();
  ops.d = out.data_ptr();
  ops.d_bytes = out.nbytes();
  return ops;
}

void matmul(int device, Plan& plan, const Operands& ops) {
  DeviceState& st = state(device);
  cudaStream_t stream = current_stream();
  if (!plan.has_algo)
    choose(device, st, plan, ops, stream);
  else
    g_stats.cached_runs++;
  const cublasStatus_t s = run_algo(st, plan, plan.algo, ops, ops.d, stream);
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(plan.what + ": cublasLtMatmul failed: " + cublasLtGetStatusString(s));
}

uint32_t alignment_of(std::initializer_list<const void*> ptrs) {
  uint32_t a = 256;
  for (const void* p : ptrs)
    while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

void set_gemm_tuning(bool enabled) {
  std::lock_guard<std::mutex> g(g_mu);
  g_tuning = enabled;
}
bool gemm_tuning() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_tuning;
}
TuningStats tuning_stats() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_stats;
}

}  // namespace accel::cuda::lt
