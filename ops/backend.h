// The interface between ops (ops/*.cpp: checks, broadcasting, autograd) and the per-device kernels
// (ops/cpu, ops/cuda). A backend sees only prepared arguments: outputs are freshly allocated and
// contiguous, shapes already checked; inputs may be strided (broadcast inputs arrive as expanded
// views with stride 0) unless a function says "contiguous".
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "ops/fp8.h"
#include "ops/ops.h"

namespace accel {

// What both backends' rope takes: x and out contiguous [B, S, H, D] of one shape and dtype, D even,
// D/2 frequencies.
inline bool rope_layout_ok(const Tensor& out, const Tensor& x, const RopeFrequencies& freqs) {
  return x.dim() == 4 && x.is_contiguous() && out.is_contiguous() && out.shape() == x.shape() &&
         out.dtype() == x.dtype() && x.shape()[3] % 2 == 0 &&
         static_cast<int64_t>(freqs.inv_freq.size()) * 2 == x.shape()[3];
}
inline std::string rope_layout_error(const Tensor& x) {
  return "needs contiguous [B, S, H, D] x and out with D even and D/2 frequencies, got " + x.str();
}

// What the backends' matmul and fp8_gemm take as an addend: none, or a contiguous tensor of out's
// shape, dtype and device.
inline bool addend_fits(const Tensor& out, const Tensor& addend) {
  return !addend.defined() || (addend.shape() == out.shape() && addend.dtype() == out.dtype() &&
                               addend.is_contiguous() && addend.device() == out.device());
}
inline void check_matmul_addend(const Tensor& out, const Tensor& addend) {
  if (!addend_fits(out, addend))
    throw std::logic_error("[matmul] the addend " + addend.str() +
                           " must be contiguous and match " + out.str());
}

// A backend's argument check: throws std::logic_error "[op] <backend><message>" when !ok. `msg` is
// the message or a callable that builds it: a message built from tensor descriptions costs
// microseconds of host time, which a check that passes should not spend on every launch.
template <class Msg>
void backend_require(bool ok, const char* op, const char* backend, Msg&& msg) {
  if (ok) return;
  std::string text;
  if constexpr (std::is_invocable_v<Msg>)
    text = msg();
  else
    text = msg;
  throw std::logic_error(std::string("[") + op + "] " + backend + text);
}

enum class UnaryOp { Neg, Exp, Log, Sqrt, Rsqrt, Abs, Sigmoid, Silu, Gelu, Tanh, Square };
enum class BinaryOp { Add, Sub, Mul, Div, Maximum, Greater, Equal };
// What a backend's reduce() computes over tensor dims (the collectives' accel::ReduceOp, in
// parallel/process_group.h, is a different set: Sum, Avg, Max across ranks).
enum class ReduceKind { Sum, Max, AbsMax };

// Where a fused fp8 cast writes (allocated by ops/fp8.cpp): scale f32 [1] is read; data [Rp, Cp]
// and data_t [Cp, Rp] (each optional, zero padding beyond the input) get the fp8 values; amax f32
// [1] (optional) becomes max(amax, max |value|); scale_inv (optional) gets 1 / scale.
struct Fp8CastTarget {
  Tensor scale, data, data_t, amax, scale_inv;
};

// One group of a grouped fp8 cast (fp8_cast_grouped, ops/fp8.h): rows x [R, C] (contiguous, R > 0)
// and where they go, as fp8_cast's arguments.
struct Fp8CastGroup {
  Tensor x;
  Fp8CastTarget out;
};

// How a grouped cast finds each group's scale. Delayed (from_amax false): out.scale is read and
// out.amax (optional) max-accumulates max |x|, as fp8_cast. Dynamic (from_amax true): out.amax
// holds the group's max |x| (fp8_amax_grouped; read, not changed), and out.scale and out.scale_inv
// get fp8_scale_for_amax(amax, fp8_max, margin, 1) and its inverse before the cast uses it, as
// fp8_scale_from_amax then fp8_cast do.
struct Fp8GroupScaling {
  bool from_amax = false;
  float fp8_max = 0.0f;
  int margin = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // out = op(x), or out = op(x, scalar) for the scalar forms: AddScalar/MulScalar/PowScalar.
  virtual void unary(UnaryOp op, const Tensor& out, const Tensor& x) = 0;
  virtual void add_scalar(const Tensor& out, const Tensor& x, double s) = 0;
  virtual void mul_scalar(const Tensor& out, const Tensor& x, double s) = 0;
  virtual void pow_scalar(const Tensor& out, const Tensor& x, double e) = 0;
  // a and b are already expanded to out's shape. Comparison ops write a Bool out.
  virtual void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) = 0;
  // out = cond ? a : b, all expanded to out's shape.
  virtual void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) = 0;
  // Reduce x over `dims` (sorted, unique); out has x's shape with those dims set to 1.
  virtual void reduce(ReduceKind op, const Tensor& out, const Tensor& x,
                      const std::vector<int64_t>& dims) = 0;
  // Gradient of max over one dim: grad_in[i] = (x[i] == out along dim, first one only) ? g : 0.
  virtual void max_backward(const Tensor& grad_in, const Tensor& x, const Tensor& out_keepdim,
                            const Tensor& grad_keepdim, int64_t dim) = 0;

  // out[b] = alpha * op(a[b]) @ op(b[b]) + beta * c[b] over batch index b, rounded once, where c
  // is `addend` when defined (out's shape and dtype, contiguous, only read: a linear's input
  // gradient summed with the one that input already has) and out itself otherwise; a, b, out
  // are 3-d [batch, rows, cols] and contiguous; batch of a or b may be 1 (broadcast).
  virtual void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a,
                      bool trans_b, double alpha, double beta, const Tensor& addend) = 0;

  // Softmax along the last dim of contiguous x; log=true gives log_softmax.
  virtual void softmax(const Tensor& out, const Tensor& x, bool log) = 0;
  // logits [N, V] contiguous, targets [N]; loss_per_row [N] f32/f64 (0 where ignored); lse (if
  // defined, [N] of loss_per_row's dtype) gets each row's log-sum-exp for the backward.
  virtual void cross_entropy(const Tensor& loss_per_row, const Tensor& lse, const Tensor& logits,
                             const Tensor& targets, int64_t ignore_index) = 0;
  // grad_logits = (softmax(logits) - onehot(targets)) * scale, 0 on ignored rows, with the
  // softmax from the forward's lse (one read of the logits). scale: a one-element tensor of lse's
  // dtype on the logits' device, read there (no host synchronization).
  virtual void cross_entropy_backward(const Tensor& grad_logits, const Tensor& logits,
                                      const Tensor& lse, const Tensor& targets,
                                      int64_t ignore_index, const Tensor& scale) = 0;
  // cross_entropy (loss_per_row, lse) and cross_entropy_backward (grad_logits) in one call, with
  // the same numbers; grad_logits may be logits itself (overwritten by its gradient). The
  // default calls the two; the CUDA backend reads each row once from memory for both.
  virtual void cross_entropy_with_grad(const Tensor& loss_per_row, const Tensor& lse,
                                       const Tensor& grad_logits, const Tensor& logits,
                                       const Tensor& targets, int64_t ignore_index,
                                       const Tensor& scale);
  virtual void embedding(const Tensor& out, const Tensor& weight, const Tensor& ids) = 0;
  // grad_weight (zeroed by the caller) += scatter of grad_out rows by ids.
  virtual void embedding_backward(const Tensor& grad_weight, const Tensor& grad_out,
                                  const Tensor& ids) = 0;
  // x [rows, D] contiguous; rstd [rows] f32 saved for backward.
  virtual void rms_norm(const Tensor& out, const Tensor& rstd, const Tensor& x,
                        const Tensor& weight, double eps) = 0;
  // The residual add fused into the norm: sum = x + r rounded to the dtype exactly as binary Add,
  // then out/rstd = rms_norm(sum) exactly as rms_norm (x and r read once). x, r, sum, out
  // contiguous of one shape and dtype.
  virtual void add_rms_norm(const Tensor& sum, const Tensor& out, const Tensor& rstd,
                            const Tensor& x, const Tensor& r, const Tensor& weight, double eps) = 0;
  // grad_x, grad_weight: either may be undefined (not computed). grad_x_add (undefined = none;
  // x's shape and dtype, any layout; never overlapping grad_x; needs grad_x) is added to grad_x in
  // the accumulation type before its single rounding to x's dtype.
  virtual void rms_norm_backward(const Tensor& grad_x, const Tensor& grad_weight,
                                 const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                 const Tensor& rstd, const Tensor& grad_x_add) = 0;
  // x [B, S, H, D] contiguous, freqs.inv_freq of D/2 values; position_ids undefined (positions
  // position_offset + s) or [B, S] I64/I32 contiguous on x's device. inverse=true applies the
  // transposed rotation (the backward; with attention_scaling 1 also the inverse).
  virtual void rope(const Tensor& out, const Tensor& x, const RopeFrequencies& freqs,
                    int64_t position_offset, const Tensor& position_ids, bool inverse) = 0;
  virtual void swiglu(const Tensor& out, const Tensor& gate, const Tensor& up) = 0;
  virtual void swiglu_backward(const Tensor& grad_gate, const Tensor& grad_up,
                               const Tensor& grad_out, const Tensor& gate, const Tensor& up) = 0;
  // q [Sq rows], k/v [Sk rows]: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] contiguous; lse [B, Hq, Sq]
  // saved for backward. Causal masks (and windows) are bottom-right aligned when Sk != Sq: query
  // i stands at position i + Sk - Sq. The mask is checked (ops/attention.cpp): window and
  // segment_ids only with causal; segment_ids contiguous int32 [B, Sq], and only with Sk == Sq.
  virtual void attention(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                         const Tensor& v, const AttentionMask& mask, double scale) = 0;
  virtual void attention_backward(const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v,
                                  const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  const AttentionMask& mask, double scale) = 0;

  virtual void rand_uniform(const Tensor& out, uint64_t seed, uint64_t offset, double low,
                            double high) = 0;
  virtual void rand_normal(const Tensor& out, uint64_t seed, uint64_t offset, double mean,
                           double stddev) = 0;

  // `rounding`: the bf16 param's stochastic rounding (ops.h), null for other params.
  virtual void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                          const AdamWParams& p, double grad_scale,
                          const StochasticRounding* rounding = nullptr) = 0;
  // adamw_step over lists, checked by the op layer (same lengths, shapes, device; copies empty or
  // one 16-bit tensor per param; rounding empty or one per param); each copy gets its param after
  // the update, rounded once.
  virtual void adamw_step_multi(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                const std::vector<Tensor>& ms, const std::vector<Tensor>& vs,
                                const std::vector<Tensor>& compute_copies, const AdamWParams& p,
                                double grad_scale,
                                const std::vector<StochasticRounding>& rounding = {}) = 0;
  virtual void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
                        double momentum, double weight_decay, double grad_scale,
                        const StochasticRounding* rounding = nullptr) = 0;
  virtual double sum_of_squares(const std::vector<Tensor>& xs) = 0;

  // fp8 (ops/fp8.h; arguments checked and allocated by ops/fp8.cpp, tensors contiguous). x [R, C]
  // f32/bf16/f16; scale f32 [1]. data [Rp, Cp] and data_t [Cp, Rp] (each optional, zero padding
  // beyond R, C) get sat(rne(x * scale)) in their fp8 dtype; amax (optional) becomes
  // max(amax, max|x|); scale_inv (optional) gets 1 / scale.
  virtual void fp8_cast(const Tensor& x, const Tensor& scale, const Tensor& data,
                        const Tensor& data_t, const Tensor& amax, const Tensor& scale_inv) = 0;
  // out f32 [1] = max |x| over all elements (NaN ignored).
  virtual void fp8_amax(const Tensor& x, const Tensor& out) = 0;
  // Grouped forms (fp8_grouped_linear's operands: the experts' rows, weights and output
  // gradients): every group exactly as the single-tensor calls make it (fp8_casts_one_by_one is
  // the reference), all groups of one input dtype, column count, fp8 format and padded width, in
  // one launch where the backend can. fp8_amax_grouped: outs[g] (f32 [1], zeroed by the caller)
  // = max |xs[g]|.
  virtual void fp8_cast_grouped(const std::vector<Fp8CastGroup>& groups,
                                const Fp8GroupScaling& scaling) = 0;
  virtual void fp8_amax_grouped(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs) = 0;
  // scale = fp8_scale_for_amax(amax, fp8_max, margin, 1), scale_inv = 1 / scale (all f32 [1]).
  virtual void fp8_scale_from_amax(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                                   float fp8_max, int margin) = 0;
  // out [M, N] = (a [M, K] . b [N, K]^T) * a_scale_inv * b_scale_inv (+ addend), the sum in
  // fp32 and rounded once; addend (checked by ops/fp8.cpp): out's shape and dtype, contiguous,
  // only read, or out itself (accumulate into out).
  virtual void fp8_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                        const Tensor& b, const Tensor& b_scale_inv, bool fast_accum,
                        const Tensor& addend) = 0;
  // data_t [C, R] = data [R, C]^T, one-byte elements.
  virtual void fp8_transpose(const Tensor& data_t, const Tensor& data) = 0;
  // history [L, n], scale / scale_inv / fp8_max [n] f32: see Fp8DelayedScaling::update.
  virtual void fp8_delayed_update(const Tensor& history, const Tensor& scale,
                                  const Tensor& scale_inv, const Tensor& fp8_max, bool use_max,
                                  int margin, bool recompute) = 0;
  // out = MX fake quantization of x [R, C] (blocks of 32 along block_dim), same dtype as x.
  virtual void fp8_mx_fake_quant(const Tensor& out, const Tensor& x, DType fmt, int block_dim) = 0;
  // Per-row / per-block scaled fp8 (fp8_cast_scaled, fp8_gemm_scaled: the AO rowwise,
  // rowwise_with_gw_hp and blockwise recipes). The operand is x [R, C] (f32/bf16/f16), or x^T when
  // transpose; data [rows_p, K_p] (fp8, zero padding) gets sat(rne(v * scale)) with the scale of
  // v's group in `mode` (fp8_group_scale of the group's amax); scale_inv (f32, fp8_scale_slots
  // elements) gets 1 / every slot's scale (1 for slots without data). one_scale: one group, the
  // whole tensor.
  virtual void fp8_cast_scaled(const Tensor& x, bool transpose, Fp8ScaleMode mode, bool pow2,
                               bool one_scale, const Tensor& data, const Tensor& scale_inv) = 0;
  // out [Ma, Mb] = sum_k a[i, k] sa(i, k) b[j, k] sb(j, k) for a [Ma, K], b [Mb, K] (padded
  // data), the scales in their modes' layouts (a mode pair ops/fp8.cpp accepted).
  virtual void fp8_gemm_scaled(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                               Fp8ScaleMode a_mode, const Tensor& b, const Tensor& b_scale_inv,
                               Fp8ScaleMode b_mode, bool fast_accum) = 0;
  // Fused elementwise op + cast (+ transpose, amax) in one pass, where a backend has the kernels
  // (CUDA): whether `inputs` with `cols` columns suit them (false: use the unfused ops).
  virtual bool fp8_fused_cast_layout(const std::vector<const Tensor*>& inputs, int64_t cols) {
    (void)inputs;
    (void)cols;
    return false;
  }
  // Casts swiglu(gate, up), computed and rounded as the swiglu op does (bit-identical to swiglu
  // followed by fp8_cast). Only where fp8_fused_cast_layout accepted the inputs.
  virtual void fp8_swiglu_cast(const Tensor& gate, const Tensor& up, const Fp8CastTarget& out);
  // Casts the gradients of swiglu for `grad` (as swiglu_backward computes and rounds them): d gate
  // into to_gate, d up into to_up. Only where fp8_fused_cast_layout accepted the inputs.
  virtual void fp8_swiglu_backward_cast(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                        const Fp8CastTarget& to_gate, const Fp8CastTarget& to_up);

  // Mixture of experts (ops/moe.cpp). The defaults throw: a backend without the kernels says so.
  // topk: values [R, k] and indices [R, k] (I64) of x [R, C] (contiguous); topk_backward:
  // grad_x [R, C] (zeroed by the front end) gets grad_values at the indices.
  virtual void topk(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t k);
  virtual void topk_backward(const Tensor& grad_x, const Tensor& grad_values,
                             const Tensor& indices);
  // out [N * k, H] row i = x [N, H] row order[i] / k; backward: grad_x row t = sum over j < k of
  // grad_out row inverse[t * k + j] (fp32 accumulation, one rounding).
  virtual void moe_permute(const Tensor& out, const Tensor& x, const Tensor& order, int64_t top_k);
  virtual void moe_permute_backward(const Tensor& grad_x, const Tensor& grad_out,
                                    const Tensor& inverse, int64_t top_k);
  // out [N, H] row t = sum_j weights[t, j] * y row inverse[t * k + j] (fp32 accumulation);
  // backward: grad_y row i = weights[slot] * grad_out row slot / k, where slot = order[i]
  // and weights[slot] is weights[slot / k, slot % k]; and
  // grad_weights[t, j] = <grad_out row t, y row inverse[t * k + j]> (fp32 dot products).
  virtual void moe_unpermute(const Tensor& out, const Tensor& y, const Tensor& weights,
                             const Tensor& inverse);
  virtual void moe_unpermute_backward(const Tensor& grad_y, const Tensor& grad_weights,
                                      const Tensor& grad_out, const Tensor& y,
                                      const Tensor& weights, const Tensor& order);
  // For every g: outs[g] = op(as[g]) @ op(bs[g]) (op transposes when trans_a / trans_b), 2-D
  // row-major tensors of one dtype; a group with inner dimension 0 gets zeros. One grouped call
  // where the backend has one.
  virtual void grouped_matmul(const std::vector<Tensor>& outs, const std::vector<Tensor>& as,
                              const std::vector<Tensor>& bs, bool trans_a, bool trans_b);

  // Lets fp32 GEMMs run on TF32 tensor cores (training.allow_tf32); backends without such a mode
  // ignore it.
  virtual void set_allow_tf32(bool allow) { (void)allow; }
  virtual bool has_non_finite(const Tensor& x) = 0;
};

// The grouped fp8 casts one group at a time through `b`'s single-tensor calls (fp8_cast, and
// fp8_scale_from_amax first under dynamic scaling; fp8_amax): the definition of the grouped ones
// (the CPU backend's implementation, and the CUDA backend's for layouts its kernels do not take).
void fp8_casts_one_by_one(Backend& b, const std::vector<Fp8CastGroup>& groups,
                          const Fp8GroupScaling& scaling);
void fp8_amaxes_one_by_one(Backend& b, const std::vector<Tensor>& xs,
                           const std::vector<Tensor>& outs);

// The backend for a device: the CPU one always; the CUDA one when built with CUDA (else throws).
Backend& backend_for(Device d);
Backend& cpu_backend();
Backend& cuda_backend();  // ops/cuda/ or ops/no_cuda/

}  // namespace accel
