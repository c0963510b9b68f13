// The cuBLASLt state the CUDA backend's GEMMs share (ops/cuda/matmul.cpp, ops/cuda/fp8_gemm.cpp):
// one handle and one 32 MiB workspace per device, a per-process cache of GEMM plans (descriptors
// plus the chosen algorithm), and the algorithm choice itself.
//
// Choosing: on the first call of a plan, cuBLASLt's heuristic is asked for up to 8 candidates;
// each is run on the caller's real operands on the current stream (1 warm-up, 3 timed runs,
// CUDA events) and the fastest is kept in the plan. When beta != 0 (C is read) or D overlaps an
// input, the timing runs write a scratch D from the caching allocator instead, so the caller's
// result always comes from exactly one run of the chosen algorithm. Candidates that fail to run
// are skipped. Later calls run the cached algorithm without asking the heuristic again.
// ACCEL_GEMM_TUNING=0 in the environment (or set_gemm_tuning(false)) takes the heuristic's first
// candidate instead (debugging; also the way to get the same algorithms in every process).
//
// Internal to ops/cuda (and the CUDA tests); only builds with CUDA include it.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/tensor.h"

namespace accel::cuda::lt {

// Throws std::runtime_error("<call> failed at <file>:<line>: <cuBLAS status>") unless s is success.
void check(cublasStatus_t s, const char* call, const char* file, int line);
#define ACCEL_LT_CHECK(expr) ::accel::cuda::lt::check((expr), #expr, __FILE__, __LINE__)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // Hopper wants >= 32 MiB
constexpr int kMaxCandidates = 8;

// One GEMM problem: descriptors in cuBLASLt's (column-major) terms and, after the first run, the
// chosen algorithm. Owned by the cache; destroys its descriptors.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;  // c, d separate
  uint32_t min_alignment = 1;  // bytes, every operand pointer (the heuristic's preference)
  std::string what;            // the problem in words, for error messages
  std::string no_algo_hint;    // appended when the heuristic finds no algorithm
  bool has_algo = false;
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan();
};

// Everything cublasLtMatmul takes besides the plan (library's A, B, C, D), with the byte extents
// the tuner needs to detect aliasing and size a scratch D.
struct Operands {
  const void* alpha = nullptr;  // host scalars of the plan's scale type
  const void* beta = nullptr;
  bool beta_nonzero = false;
  const void* a = nullptr;
  size_t a_bytes = 0;
  const void* b = nullptr;
  size_t b_bytes = 0;
  const void* c = nullptr;
  void* d = nullptr;
  size_t d_bytes = 0;
};

// Serializes every GEMM call's use of the shared state (one thread per process today).
std::unique_lock<std::mutex> lock();

// The plan cached for `key` on `device` (nullptr if none). Keys are the callers' full problem
// descriptions (unused trailing fields zero); callers start them with a tag of their own so keys
// of different ops never collide. A fixed array: no allocation on the hot path.
using Key = std::array<int64_t, 16>;
Plan* find_plan(int device, const Key& key);
Plan& add_plan(int device, const Key& key, std::unique_ptr<Plan> plan);
// The cached plan for `key`, made by make() (-> std::unique_ptr<Plan>) on the first call.
template <class Make>
Plan& plan_for(int device, const Key& key, Make&& make) {
  Plan* plan = find_plan(device, key);
  return plan ? *plan : add_plan(device, key, make());
}

// The matrices of our row-major out = a . b (either operand possibly transposed): cuBLASLt is
// column-major, so its A is our b, its B our a, and C and D are `out`. Scalars are the caller's.
Operands row_major_operands(const Tensor& a, const Tensor& b, const Tensor& out);

// Runs the GEMM once on the current stream (of the current device, which must be `device`),
// choosing and caching plan.algo first when it has none. Hold lock() around this and any change
// to plan.desc.
void matmul(int device, Plan& plan, const Operands& ops);

// The largest power of two (<= 256) dividing every pointer.
uint32_t alignment_of(std::initializer_list<const void*> ptrs);

// Tuning on/off (initially from ACCEL_GEMM_TUNING; "0"/"false"/"off" disables). Affects plans
// chosen afterwards only.
void set_gemm_tuning(bool enabled);
bool gemm_tuning();

struct TuningStats {
  int64_t tuned = 0;               // plans whose algorithm was chosen by timing candidates
  int64_t heuristic_only = 0;      // plans that took the heuristic's first candidate
  int64_t cached_runs = 0;         // GEMMs that ran an already chosen algorithm
  int64_t skipped_candidates = 0;  // candidates that failed to run while timing
};
TuningStats tuning_stats();

}  // namespace accel::cuda::lt
