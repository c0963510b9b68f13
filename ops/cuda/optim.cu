// Optimizer kernels: AdamW (torch.optim.AdamW semantics, decoupled weight decay, bias correction)
// and SGD with momentum. Per-element math in fp32; the step's scalars are computed on the host in
// double.
#include <cmath>
#include <cstdint>
#include <limits>

#include "ops/cuda/common.cuh"
#include "ops/optim_math.h"

namespace accel {
namespace {
using namespace cuda;
using optim_math::AdamScalars;

// One element of AdamW, in the order every AdamW kernel here has used (CPU/GPU agreement as
// before).
__device__ __forceinline__ void adamw_update(float gr, float& pi, float& mi, float& vi,
                                             const AdamScalars& s) {
  pi *= s.decay;
  mi += (1.0f - s.beta1) * (gr - mi);
  vi = s.beta2 * vi + (1.0f - s.beta2) * gr * gr;
  const float denom = sqrtf(vi) * s.inv_bias2_sqrt + s.eps;
  pi -= s.step_size * mi / denom;
}

// Multi-tensor AdamW: every tensor of a launch is cut into chunks of kChunk elements and each
// block updates one chunk (the work list is the prefix sum of chunk counts; chunk_owner finds a
// block's tensor). Aligned tensors go kVec elements per load; the rest, and each
// chunk's tail, one element at a time. The tensor table travels as a __grid_constant__ kernel
// parameter (up to 32 KB since CUDA 12.1 on sm_70+), so a launch needs no device-side upload.
constexpr int kMultiThreads = 256;
constexpr int kVec = 4;
constexpr int64_t kChunk = 16384;  // 16 vectors per thread
constexpr int kMultiMax = 320;     // tensors per launch (llama-1b has 147)

struct NoCopy {};  // the copy type when no compute copies are written

template <class T>
struct alignas(sizeof(T) * kVec) Pack {
  T x[kVec];
};

// TS: the moments' storage type, TP's own, bf16 beside an fp32 param (optimizer.state_dtype) or
// fp32 beside a bf16 param. A bf16 param is a master weight (optimizer.master_weights bf16): its
// update is ops/optim_math.h's, stochastically rounded with sr.
template <class TP, class TG, class TC, class TS>
struct AdamMulti {
  TP* p[kMultiMax];
  const TG* g[kMultiMax];
  TS* m[kMultiMax];
  TS* v[kMultiMax];
  TC* c[kMultiMax];
  StochasticRounding sr[kMultiMax];
  int64_t n[kMultiMax];
  int32_t first_chunk[kMultiMax + 1];  // tensor t owns chunks [first_chunk[t], first_chunk[t+1])
  bool vec[kMultiMax];                 // all of tensor t's pointers are aligned for Pack access
  int count;
};

// The compute copy's rounding, exactly as Tensor::copy_ (store_f) writes it: round to nearest
// even (f32_to_bf16 keeps NaN payload bits the way the cast kernel does).
template <class TC>
__device__ __forceinline__ TC round_copy(float v) {
  if constexpr (std::is_same_v<TC, __nv_bfloat16>)
    return __ushort_as_bfloat16(f32_to_bf16(v));
  else
    return __float2half_rn(v);
}

// A moment's store: bf16 rounds to nearest even exactly as the CPU kernel's f32_to_bf16.
template <class TS>
__device__ __forceinline__ TS store_state(float v) {
  if constexpr (std::is_same_v<TS, __nv_bfloat16>)
    return __ushort_as_bfloat16(f32_to_bf16(v));
  else
    return from_f<TS>(v);
}

template <class TP>
constexpr bool kBf16Master = std::is_same_v<TP, __nv_bfloat16>;

// One AdamW element: the fp32-master math above, or for a bf16 master weight the CPU's own
// (ops/optim_math.h), stochastically rounded with `bits` (element i's Philox bits).
template <class TP>
__device__ __forceinline__ TP adamw_store(float gr, float pi, float& mi, float& vi,
                                          const AdamScalars& s, uint32_t bits) {
  if constexpr (kBf16Master<TP>) {
    return __ushort_as_bfloat16(
        optim_math::f32_to_bf16_stochastic(optim_math::adamw_element(gr, pi, mi, vi, s), bits));
  } else {
    adamw_update(gr * s.grad_scale, pi, mi, vi, s);
    return from_f<TP>(pi);
  }
}

template <class TP, class TG, class TC, class TS>
__global__ void __launch_bounds__(kMultiThreads)
    adamw_multi_kernel(const __grid_constant__ AdamMulti<TP, TG, TC, TS> a, const AdamScalars s) {
  constexpr bool kCopy = !std::is_same_v<TC, NoCopy>;
  const int chunk = static_cast<int>(blockIdx.x);
  const int t = chunk_owner(a.first_chunk, a.count, chunk);
  TP* __restrict__ p = a.p[t];
  const TG* __restrict__ g = a.g[t];
  TS* __restrict__ m = a.m[t];
  TS* __restrict__ v = a.v[t];
  [[maybe_unused]] TC* __restrict__ c = a.c[t];
  const int64_t begin = static_cast<int64_t>(chunk - a.first_chunk[t]) * kChunk;
  const int64_t end = min(a.n[t], begin + kChunk);
  int64_t rest = begin;
  if (a.vec[t]) {
    rest = begin + (end - begin) / kVec * kVec;
    for (int64_t i = begin + int64_t(threadIdx.x) * kVec; i < rest;
         i += int64_t(kMultiThreads) * kVec) {
      Pack<TP> pp = *reinterpret_cast<const Pack<TP>*>(p + i);
      Pack<TS> mp = *reinterpret_cast<const Pack<TS>*>(m + i);
      Pack<TS> vp = *reinterpret_cast<const Pack<TS>*>(v + i);
      const Pack<TG> gp = *reinterpret_cast<const Pack<TG>*>(g + i);
      [[maybe_unused]] Pack<std::conditional_t<kCopy, TC, TP>> cp;
      // bf16 masters: the four elements' random bits, from one Philox block where they share it.
      uint32_t bits[kVec] = {};
      if constexpr (kBf16Master<TP>) {
        if (((a.sr[t].first + i) & 3) == 0) {
          const philox::U4 b = optim_math::stochastic_bits4(a.sr[t], i);
          bits[0] = b.x, bits[1] = b.y, bits[2] = b.z, bits[3] = b.w;
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k)
            bits[k] = philox::bits(a.sr[t].seed, a.sr[t].first, static_cast<uint64_t>(i + k));
        }
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float mi = to_f(mp.x[k]), vi = to_f(vp.x[k]);
        pp.x[k] = adamw_store<TP>(to_f(gp.x[k]), to_f(pp.x[k]), mi, vi, s, bits[k]);
        mp.x[k] = store_state<TS>(mi);
        vp.x[k] = store_state<TS>(vi);
        if constexpr (kCopy) cp.x[k] = round_copy<TC>(to_f(pp.x[k]));
      }
      *reinterpret_cast<Pack<TP>*>(p + i) = pp;
      *reinterpret_cast<Pack<TS>*>(m + i) = mp;
      *reinterpret_cast<Pack<TS>*>(v + i) = vp;
      if constexpr (kCopy) *reinterpret_cast<Pack<TC>*>(c + i) = cp;
    }
  }
  for (int64_t i = rest + threadIdx.x; i < end; i += kMultiThreads) {
    float mi = to_f(m[i]), vi = to_f(v[i]);
    const uint32_t bits =
        kBf16Master<TP> ? philox::bits(a.sr[t].seed, a.sr[t].first, static_cast<uint64_t>(i)) : 0;
    p[i] = adamw_store<TP>(to_f(g[i]), to_f(p[i]), mi, vi, s, bits);
    m[i] = store_state<TS>(mi);
    v[i] = store_state<TS>(vi);
    if constexpr (kCopy) c[i] = round_copy<TC>(to_f(p[i]));
  }
}

template <class TP, class TG, class TS>
__global__ void sgd_kernel(TP* __restrict__ p, const TG* __restrict__ g, TS* __restrict__ buf,
                           int64_t n, float lr, float momentum, float wd, float grad_scale,
                           const StochasticRounding sr) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    if constexpr (kBf16Master<TP>) {
      float b = momentum != 0.f ? to_f(buf[i]) : 0.f;
      const float pn =
          optim_math::sgd_element(to_f(g[i]), to_f(p[i]), b, lr, momentum, wd, grad_scale);
      p[i] = __ushort_as_bfloat16(optim_math::stochastic_bf16(pn, sr, i));
      if (momentum != 0.f) buf[i] = store_state<TS>(b);
      continue;
    }
    const float pi = to_f(p[i]);
    float d = to_f(g[i]) * grad_scale;
    if (wd != 0.f) d += wd * pi;
    if (momentum != 0.f) {
      const float b = momentum * to_f(buf[i]) + d;
      buf[i] = store_state<TS>(b);
      d = b;
    }
    p[i] = from_f<TP>(pi - lr * d);
  }
}

// Calls f(TP{}, TG{}) for a param dtype and a gradient dtype that is the same, 16-bit under an
// fp32 param, or fp32 under a bf16 param (FSDP's fp32 gradient shards).
template <class F>
void dispatch_param_grad(DType tp, DType tg, const char* op, F&& f) {
  dispatch_float(tp, op, [&](auto p) {
    using TP = decltype(p);
    if (tg == tp) {
      f(p, p);
    } else if constexpr (std::is_same_v<TP, float>) {
      if (tg == DType::BF16)
        f(p, __nv_bfloat16{});
      else if (tg == DType::F16)
        f(p, __half{});
      else
        unsupported_dtype(op, tg);
    } else if constexpr (kBf16Master<TP>) {
      if (tg == DType::F32)
        f(p, float{});
      else
        unsupported_dtype(op, tg);
    } else {
      unsupported_dtype(op, tg);
    }
  });
}

// Calls f(TS{}) for the moments' storage `ts` beside param type TP: TP's own, bf16 beside fp32,
// fp32 beside bf16.
template <class TP, class F>
void dispatch_state(DType ts, F&& f) {
  if constexpr (std::is_same_v<TP, float>) {
    if (ts == DType::BF16) return f(__nv_bfloat16{});
  }
  if constexpr (kBf16Master<TP>) {
    if (ts == DType::F32) return f(float{});
  }
  f(TP{});
}

void check_state(const char* op, const Tensor& param, const Tensor& grad,
                 std::initializer_list<const Tensor*> state) {
  require_cuda(param, op, "param");
  require_cuda(grad, op, "grad");
  require(param.is_contiguous() && grad.is_contiguous() && grad.numel() == param.numel(), op, [&] {
    return "param " + param.str() + " and grad " + grad.str() + " must be contiguous and match";
  });
  for (const Tensor* t : state)
    require(
        t->is_contiguous() && t->numel() == param.numel() && t->device() == param.device() &&
            (t->dtype() == param.dtype() ||
             (t->dtype() == DType::BF16 && param.dtype() == DType::F32) ||
             (t->dtype() == DType::F32 && param.dtype() == DType::BF16)) &&
            t->dtype() == (*state.begin())->dtype(),
        op, [&] {
          return "optimizer state " + t->str() + " must match param " + param.str() +
                 " (its dtype, bf16 beside an f32 param or f32 beside a bf16 param; one dtype for "
                 "all moments)";
        });
}

// A bf16 param is a master weight: its update is stochastically rounded, and only theirs.
void check_rounding(const char* op, const Tensor& param, bool has_rounding) {
  require(has_rounding == (param.dtype() == DType::BF16), op, [&] {
    return "stochastic rounding goes with bf16 params (master weights) and only them; param " +
           param.str() + (has_rounding ? " has one" : " has none");
  });
}

template <class T>
bool aligned_for_pack(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % alignof(Pack<T>) == 0;
}

// Launches over `group` (indices of non-empty tensors of one dtype combination), kMultiMax
// tensors per launch.
template <class TP, class TG, class TC, class TS>
void launch_adamw_multi(const std::vector<size_t>& group, const std::vector<Tensor>& params,
                        const std::vector<Tensor>& grads, const std::vector<Tensor>& ms,
                        const std::vector<Tensor>& vs, const std::vector<Tensor>& copies,
                        const std::vector<StochasticRounding>& rounding, const AdamScalars& s,
                        cudaStream_t stream) {
  constexpr bool kCopy = !std::is_same_v<TC, NoCopy>;
  static_assert(sizeof(AdamMulti<TP, TG, TC, TS>) + sizeof(AdamScalars) <= 32764,
                "kernel parameters over CUDA's 32 KB limit");
  size_t k = 0;
  while (k < group.size()) {
    AdamMulti<TP, TG, TC, TS> a{};
    int count = 0;
    int64_t chunks = 0;
    for (; k < group.size() && count < kMultiMax; ++k, ++count) {
      const size_t i = group[k];
      const int64_t n = params[i].numel();
      const int64_t own = (n + kChunk - 1) / kChunk;
      if (count > 0 && chunks + own > std::numeric_limits<int32_t>::max()) break;
      a.p[count] = static_cast<TP*>(params[i].data_ptr());
      a.g[count] = static_cast<const TG*>(grads[i].data_ptr());
      a.m[count] = static_cast<TS*>(ms[i].data_ptr());
      a.v[count] = static_cast<TS*>(vs[i].data_ptr());
      if constexpr (kBf16Master<TP>) a.sr[count] = rounding[i];
      bool vec = aligned_for_pack<TP>(a.p[count]) && aligned_for_pack<TG>(a.g[count]) &&
                 aligned_for_pack<TS>(a.m[count]) && aligned_for_pack<TS>(a.v[count]);
      if constexpr (kCopy) {
        a.c[count] = static_cast<TC*>(copies[i].data_ptr());
        vec = vec && aligned_for_pack<TC>(a.c[count]);
      }
      a.vec[count] = vec;
      a.n[count] = n;
      a.first_chunk[count] = static_cast<int32_t>(chunks);
      chunks += own;
    }
    require(chunks <= std::numeric_limits<int32_t>::max(), "adamw_step",
            "tensor too large for one launch");
    a.first_chunk[count] = static_cast<int32_t>(chunks);
    a.count = count;
    adamw_multi_kernel<TP, TG, TC, TS>
        <<<static_cast<unsigned>(chunks), kMultiThreads, 0, stream>>>(a, s);
    ACCEL_CUDA_CHECK_LAUNCH("adamw_step_multi");
  }
}

}  // namespace

void CudaBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                             const Tensor& v, const AdamWParams& p, double grad_scale,
                             const StochasticRounding* rounding) {
  // One kernel for both forms: a single tensor is a work list of one.
  cuda::adamw_step_multi(
      {param}, {grad}, {m}, {v}, p, grad_scale, {},
      rounding ? std::vector<StochasticRounding>{*rounding} : std::vector<StochasticRounding>{});
}

void CudaBackend::adamw_step_multi(const std::vector<Tensor>& params,
                                   const std::vector<Tensor>& grads, const std::vector<Tensor>& ms,
                                   const std::vector<Tensor>& vs,
                                   const std::vector<Tensor>& compute_copies, const AdamWParams& p,
                                   double grad_scale,
                                   const std::vector<StochasticRounding>& rounding) {
  cuda::adamw_step_multi(params, grads, ms, vs, p, grad_scale, compute_copies, rounding);
}

void CudaBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
                           double momentum, double weight_decay, double grad_scale,
                           const StochasticRounding* rounding) {
  check_state("sgd_step", param, grad, {});
  check_rounding("sgd_step", param, rounding != nullptr);
  if (momentum != 0.0) {
    require(buf.defined(), "sgd_step", "momentum needs a momentum buffer");
    check_state("sgd_step", param, grad, {&buf});
  }
  const int64_t n = param.numel();
  if (n == 0) return;
  OpScope sc(param);
  // Without momentum there is no buffer: the param's own type stands in for its storage.
  const DType buf_dtype = momentum != 0.0 ? buf.dtype() : param.dtype();
  dispatch_param_grad(param.dtype(), grad.dtype(), "sgd_step", [&](auto tp, auto tg) {
    using TP = decltype(tp);
    using TG = decltype(tg);
    dispatch_state<TP>(buf_dtype, [&](auto ts) {
      using TS = decltype(ts);
      sgd_kernel<TP, TG, TS><<<grid_for(n, 256, 4), 256, 0, sc.stream>>>(
          static_cast<TP*>(param.data_ptr()), static_cast<const TG*>(grad.data_ptr()),
          momentum != 0.0 ? static_cast<TS*>(buf.data_ptr()) : nullptr, n, static_cast<float>(lr),
          static_cast<float>(momentum), static_cast<float>(weight_decay),
          static_cast<float>(grad_scale), rounding ? *rounding : StochasticRounding{});
    });
  });
  ACCEL_CUDA_CHECK_LAUNCH("sgd_step");
}

namespace cuda {
void adamw_step_multi(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& ms, const std::vector<Tensor>& vs,
                      const AdamWParams& p, double grad_scale,
                      const std::vector<Tensor>& compute_copies,
                      const std::vector<StochasticRounding>& rounding) {
  const bool with_copies = !compute_copies.empty();
  if (grads.size() != params.size() || ms.size() != params.size() || vs.size() != params.size() ||
      (with_copies && compute_copies.size() != params.size()) ||
      (!rounding.empty() && rounding.size() != params.size()))
    throw std::invalid_argument(
        "[adamw_step_multi] params, grads, m, v (and compute copies, roundings) lists differ in "
        "length");
  if (params.empty()) return;
  if (p.step < 1) throw std::invalid_argument("[adamw_step] step must be >= 1 (it is 1-based)");
  for (size_t i = 0; i < params.size(); ++i) {
    check_state("adamw_step", params[i], grads[i], {&ms[i], &vs[i]});
    // A list with roundings has them for every entry; only the bf16 params' are used.
    check_rounding("adamw_step", params[i], !rounding.empty() && params[i].dtype() == DType::BF16);
    require(params[i].device() == params[0].device(), "adamw_step", "tensors on different devices");
    if (!with_copies) continue;
    const Tensor& c = compute_copies[i];
    require(c.defined() && c.device() == params[i].device() && c.is_contiguous() &&
                c.numel() == params[i].numel() &&
                (c.dtype() == DType::BF16 || c.dtype() == DType::F16) &&
                params[i].dtype() == DType::F32,
            "adamw_step", [&] {
              return "compute copy " + (c.defined() ? c.str() : std::string("(undefined)")) +
                     " must be a contiguous bf16/f16 tensor beside f32 param " + params[i].str();
            });
  }
  OpScope sc(params[0]);
  const AdamScalars s = optim_math::adam_scalars(p, grad_scale);
  auto copy_dtype = [&](size_t i) { return with_copies ? compute_copies[i].dtype() : DType::F32; };
  // Group tensors by (param, grad, copy, state) dtype; one launch per group (kMultiMax tensors
  // each).
  std::vector<bool> done(params.size(), false);
  for (size_t first = 0; first < params.size(); ++first) {
    if (done[first]) continue;
    const DType tp = params[first].dtype(), tg = grads[first].dtype(), tc = copy_dtype(first),
                ts = ms[first].dtype();
    std::vector<size_t> group;
    for (size_t i = first; i < params.size(); ++i)
      if (!done[i] && params[i].dtype() == tp && grads[i].dtype() == tg && copy_dtype(i) == tc &&
          ms[i].dtype() == ts) {
        done[i] = true;
        if (params[i].numel() > 0) group.push_back(i);
      }
    if (group.empty()) continue;
    dispatch_param_grad(tp, tg, "adamw_step", [&](auto tpv, auto tgv) {
      using TP = decltype(tpv);
      using TG = decltype(tgv);
      dispatch_state<TP>(ts, [&](auto tsv) {
        using TS = decltype(tsv);
        if (!with_copies) {
          launch_adamw_multi<TP, TG, NoCopy, TS>(group, params, grads, ms, vs, compute_copies,
                                                 rounding, s, sc.stream);
        } else if constexpr (std::is_same_v<TP, float>) {
          if (tc == DType::BF16)
            launch_adamw_multi<TP, TG, __nv_bfloat16, TS>(group, params, grads, ms, vs,
                                                          compute_copies, rounding, s, sc.stream);
          else
            launch_adamw_multi<TP, TG, __half, TS>(group, params, grads, ms, vs, compute_copies,
                                                   rounding, s, sc.stream);
        }
      });
    });
  }
}
}  // namespace cuda

}  // namespace accel
