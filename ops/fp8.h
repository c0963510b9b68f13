// FP8 training primitives: per-tensor scaled casts to e4m3/e5m2 (with the transposed copies that
// Hopper's TN-only fp8 GEMMs need), fp8 GEMMs, TE-style delayed scaling state, and the fp8 linear
// autograd op. docs/algorithms.md sections 6-11 have the math; docs/fp8.md the usage.
//
// Scale convention (TE, torchao, cuBLASLt): q = sat(rne(x * scale)), x ~= q * scale_inv with
// scale_inv = 1 / scale; scale = fp8_max / amax / 2^margin. Scales live in fp32 tensors on the
// data's device so GPU kernels read them without a host round trip.
//
// Every function runs on the CPU (an exact emulation: the same rounding bit for bit, GEMMs in fp32
// on the decoded values) and on CUDA (fused cast+amax+transpose kernels, cuBLASLt fp8 GEMMs).
#pragma once

#include <cfloat>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ops/ops.h"

namespace accel {

// ---- scalar scale math (host and device share it, so both round the same way) -----------------

ACCEL_HD float fp8_max_value(DType fmt) { return fmt == DType::E5M2 ? kE5M2Max : kE4M3Max; }

// An amax a scale can be computed from: positive and finite (0, inf and NaN carry no range).
ACCEL_HD bool fp8_amax_usable(float amax) { return amax > 0.0f && amax <= FLT_MAX; }

// scale = fp8_max / amax / 2^margin, clamped to [FLT_MIN, FLT_MAX] so that scale_inv stays finite
// (a tiny amax gives FLT_MAX, as TE does). `fallback` when the amax is unusable: TE's delayed
// scaling keeps the previous scale, current scaling uses 1.
ACCEL_HD float fp8_scale_for_amax(float amax, float fp8_max, int margin, float fallback) {
  if (!fp8_amax_usable(amax)) return fallback;
  float s = fp8_max / amax;
  s = ldexpf(s, -margin);  // exact: a power of two
  if (s > FLT_MAX) s = FLT_MAX;
  if (s < FLT_MIN) s = FLT_MIN;
  return s;
}

// MX block scaling: the exponent e of the power-of-two block scale 2^e (stored as e8m0) such that
// amax / 2^e <= fp8_max with e as small as possible (TE rounds the exponent up, so the block
// maximum never saturates). 0 (scale 1) for an amax of 0, inf or NaN. Clamped to [-127, 127].
ACCEL_HD int fp8_mx_block_exponent(float amax, float fp8_max) {
  if (!fp8_amax_usable(amax)) return 0;
  int ea, ef;
  frexpf(amax, &ea);
  frexpf(fp8_max, &ef);
  int e = ea - ef;  // amax / fp8_max lies in (2^(e-1), 2^(e+1))
  if (e < -127) return -127;
  if (amax > ldexpf(fp8_max, e)) ++e;  // exact: fp8_max * 2^e is a normal float here (or inf)
  return e > 127 ? 127 : e;
}

// ---- recipes ----------------------------------------------------------------------------------

enum class Fp8Scaling {
  Delayed,  // TE DelayedScaling: scale from an amax history of past steps
  Dynamic,  // torchao tensorwise / TE current scaling: scale from this tensor's own amax
  MxBlock,  // MXFP8 (1x32 blocks, e8m0 scales). Hopper has no MX GEMMs: emulated (see docs/fp8.md)
  // torchao's rowwise recipes (Float8LinearRecipeName ROWWISE / ROWWISE_WITH_GW_HP): dynamic
  // "axiswise" scaling, one scale per row of each GEMM operand along that GEMM's contraction
  // dimension (so each of x, w, dy is cast twice, once per GEMM it enters).
  Rowwise,
  // DeepSeek-V3's fine-grained recipe: activations and output gradients scaled per 1x128 tile along
  // each GEMM's contraction dimension, weights per 128x128 block; e4m3 everywhere, fp32 scales.
  Blockwise,
};
enum class AmaxAlgo { Max, MostRecent };

struct Fp8Recipe {
  Fp8Scaling scaling = Fp8Scaling::Delayed;
  DType forward_dtype = DType::E4M3;   // inputs and weights
  DType backward_dtype = DType::E5M2;  // output gradients (HYBRID); E4M3 for the E4M3 format
  // Delayed scaling.
  int64_t amax_history_len = 1024;
  AmaxAlgo amax_algo = AmaxAlgo::MostRecent;
  int margin = 0;        // also applied by dynamic scaling
  int64_t interval = 1;  // scales are recomputed after steps 1, 1 + interval, 1 + 2 interval, ...
  // override_linear_precision: true runs that GEMM in the inputs' precision instead of fp8.
  bool hp_fprop = false, hp_dgrad = false, hp_wgrad = false;
  // Rowwise / Blockwise: scales rounded down to a power of two (torchao's
  // round_scales_to_power_of_2, on in its ROWWISE recipe).
  bool pow2_scales = false;
  // Rowwise: the weight enters the dgrad GEMM with one tensorwise scale (torchao's
  // ROWWISE_WITH_GW_HP: cast_config_weight_for_grad_input is TENSORWISE).
  bool dgrad_weight_tensorwise = false;

  // "delayed scaling (history 1024, most_recent, margin 0, interval 1), e4m3 forward / e5m2
  // backward, GEMMs fprop fp8 dgrad fp8 wgrad fp8"
  std::string str() const;
};

// ---- fp8 tensors and casts --------------------------------------------------------------------

// A 2-d tensor [rows, cols] quantized with one per-tensor scale. `data` is the row-major copy
// [rows_p, cols_p] and `data_t` the transposed copy [cols_p, rows_p]; either may be absent. Both
// are zero-padded to a multiple of `pad` in each dimension (cuBLASLt's fp8 GEMMs need the
// contraction dimension % 16; zeros add nothing to a dot product).
struct Fp8Tensor {
  Tensor data, data_t;  // E4M3 or E5M2
  Tensor scale;         // f32 [1]
  Tensor scale_inv;     // f32 [1], 1 / scale (what GEMMs and dequantization use)
  int64_t rows = 0, cols = 0;
  DType dtype() const { return data.defined() ? data.dtype() : data_t.dtype(); }
  Device device() const { return scale_inv.device(); }
};

struct Fp8CastOptions {
  bool rowwise = true;      // fill `data`
  bool columnwise = false;  // fill `data_t`
  int64_t pad = 1;          // pad both dims of the copies to a multiple of this (16 for GEMMs)
};

// Casts x (2-d, f32/bf16/f16, any device) with the given scale (f32 [1] on x's device).
// When `amax_accum` (f32 [1]) is defined, max(amax_accum, max|x|) is stored into it in the same
// pass (NaN elements are ignored; the history of delayed scaling is fed this way). The result's
// scale_inv is a new tensor holding 1 / scale.
Fp8Tensor fp8_cast(const Tensor& x, DType fmt, const Tensor& scale,
                   const Tensor& amax_accum = Tensor(), const Fp8CastOptions& opts = {});
// Current (dynamic) scaling: scale = fp8_scale_for_amax(max|x|, fp8_max, margin, 1).
Fp8Tensor fp8_cast_dynamic(const Tensor& x, DType fmt, const Fp8CastOptions& opts = {},
                           int margin = 0);
// Adds the transposed copy to a tensor that has only the row-major one (a byte transpose).
Fp8Tensor fp8_with_transpose(const Fp8Tensor& q);
// [rows, cols] values q * scale_inv in `dtype` (from data, or data_t when data is absent).
Tensor fp8_dequantize(const Fp8Tensor& q, DType dtype = DType::F32);
// max |x| as an f32 [1] tensor on x's device (NaN ignored).
Tensor fp8_amax(const Tensor& x);

// ---- grouped casts (the experts of a mixture-of-experts layer) -------------------------------

// Groups of rows [rows[g], cols] cast each with its own scale into one buffer per layout, each
// group padded as fp8_cast pads it: `data` [sum rows_p, cols_p] holds group g's row-major copy
// in rows [offsets[g], offsets[g] + rows_p[g]); `data_t` (1-d) holds group g's transposed copy
// [cols_p, rows_p[g]] from element cols_p * offsets[g] on. scale_inv (f32 [4 G]) holds group g's
// at element 4 g, so that each starts on a 16-byte boundary as the GEMMs need. A group without
// rows has rows_p 0 and nothing cast (its scale_inv slot is not written).
struct Fp8GroupedTensor {
  Tensor data, data_t;  // E4M3 or E5M2; either may be absent
  Tensor scale_inv;
  std::vector<Tensor> scales;  // f32 [1] each: the scale each group was cast with
  std::vector<int64_t> rows, rows_p, offsets;
  int64_t cols = 0, cols_p = 0;
  int64_t groups() const { return static_cast<int64_t>(rows.size()); }
  // Group g as fp8_cast returns it (views of the buffers above).
  Fp8Tensor group(int64_t g) const;
};

// How each group of fp8_cast_grouped is scaled: delayed scaling (`scales` has one f32 [1] per
// group, and `amaxes` is empty or has one per group, undefined where the amax is not recorded),
// as fp8_cast(x, fmt, scales[g], amaxes[g]); or dynamic scaling (`scales` empty), each group's
// scale from its own amax as fp8_cast_dynamic(x, fmt, opts, margin).
struct Fp8GroupScales {
  std::vector<Tensor> scales, amaxes;
  int margin = 0;
};

// Casts every xs[g] (2-d [rows_g, C], one dtype, C and device for all) exactly as the
// single-tensor cast of `scaling` casts it alone (the same bytes, amaxes and scales; tested bit
// for bit), into one grouped tensor: on CUDA one cast launch for up to 128 groups (dynamic
// scaling: one amax launch first), not one or more per group; a layout the tile kernel does not
// take (columns not a multiple of 8, misaligned rows) goes group by group. Groups without rows
// cast nothing and record nothing. The xs may be row blocks of one tensor (the experts' rows) or
// separate tensors (their weights).
Fp8GroupedTensor fp8_cast_grouped(const std::vector<Tensor>& xs, DType fmt,
                                  const Fp8GroupScales& scaling, const Fp8CastOptions& opts = {});

// The fp8 GEMM in the one layout Hopper runs ("TN"): both operands contraction-contiguous.
// out [M, N] = (a [M, K] . b [N, K]^T) * a_scale_inv * b_scale_inv, accumulated in fp32; a and b
// fp8 (not both e5m2), out f32/bf16/f16. On CUDA K % 16 == 0 and N % 8 == 0 (pad the operands).
// fast_accum: cuBLASLt's fast accumulation (fprop only, as TE and torchao do). addend: out = the
// product + addend, summed in fp32 and rounded once (addend out's shape and dtype, contiguous, only
// read): an input gradient folded into the one its input already has; out itself accumulates into
// out, e.g. an f32 weight gradient summed over row chunks.
void fp8_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
              const Tensor& b_scale_inv, bool fast_accum, const Tensor& addend = Tensor());
Tensor fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                const Tensor& b_scale_inv, DType out_dtype, bool fast_accum);

// MXFP8 emulation: x (2-d) quantized in blocks of 32 consecutive elements along `block_dim`
// (1: along rows' elements, 0: down columns) with e8m0 scales, then dequantized back to x's
// dtype. Exact in bf16/f32, so a high-precision GEMM on the results computes what an MX GEMM would
// (up to accumulation order).
Tensor fp8_mx_fake_quant(const Tensor& x, DType fmt, int block_dim);

// ---- per-row and per-block scaled fp8 (rowwise and blockwise recipes) ------------------------

// How the scales of one GEMM operand [rows, K] (K = the GEMM's contraction dimension, contiguous)
// are laid out; the layouts are the ones cuBLASLt 13 takes (CUBLASLT_MATMUL_MATRIX_SCALE_*):
//   Row          OUTER_VEC_32F      one scale per row                   f32 [rows_p]
//   Block1x128   VEC128_32F         one per 1x128 tile along K          f32 [ceil(K_p/128), rows_p]
//                                   (rows contiguous: "outer-dim-major")
//   Block128x128 BLK128x128_32F     one per 128x128 block               f32 [ceil(rows_p/128), ld]
//                                   with ld = ceil(K_p/128) rounded up to 4 (16-byte rows)
// rows_p, K_p are the padded data dims. Slots outside the data (padding) hold scale 1.
enum class Fp8ScaleMode { Row, Block1x128, Block128x128 };
const char* fp8_scale_mode_name(Fp8ScaleMode m);

constexpr int64_t kFp8Block = 128;

ACCEL_HD int64_t fp8_block_ld(int64_t k_p) {
  return ((k_p + kFp8Block - 1) / kFp8Block + 3) / 4 * 4;
}
// The scale slot of operand element (r, k).
ACCEL_HD int64_t fp8_scale_index(Fp8ScaleMode m, int64_t r, int64_t k, int64_t rows_p,
                                 int64_t k_p) {
  switch (m) {
    case Fp8ScaleMode::Row:
      return r;
    case Fp8ScaleMode::Block1x128:
      return (k / kFp8Block) * rows_p + r;
    default:
      return (r / kFp8Block) * fp8_block_ld(k_p) + k / kFp8Block;
  }
}
// The number of scale slots (the scale tensor's shape multiplied out).
ACCEL_HD int64_t fp8_scale_slots(Fp8ScaleMode m, int64_t rows_p, int64_t k_p) {
  switch (m) {
    case Fp8ScaleMode::Row:
      return rows_p;
    case Fp8ScaleMode::Block1x128:
      return (k_p + kFp8Block - 1) / kFp8Block * rows_p;
    default:
      return (rows_p + kFp8Block - 1) / kFp8Block * fp8_block_ld(k_p);
  }
}

// The scale of a group (row, tile, block) with this amax: fp8_scale_for_amax(amax, fp8_max, 0, 1),
// rounded down to a power of two when pow2 (torchao: exp2(floor(log2(scale)))).
ACCEL_HD float fp8_group_scale(float amax, float fp8_max, bool pow2) {
  float s = fp8_scale_for_amax(amax, fp8_max, 0, 1.0f);
  if (pow2) {
    int e;
    frexpf(s, &e);  // s = m 2^e, m in [0.5, 1): the largest power of two <= s is 2^(e-1)
    s = ldexpf(1.0f, e - 1);
  }
  return s;
}

// One GEMM operand [rows, K] in fp8 with per-row or per-block scales. data is row-major
// [rows_p, K_p] (zero-padded to multiples of `pad`, K contiguous); scale_inv as Fp8ScaleMode says.
struct Fp8ScaledTensor {
  Tensor data;       // E4M3 or E5M2
  Tensor scale_inv;  // f32, 1 / the group scales
  Fp8ScaleMode mode = Fp8ScaleMode::Row;
  int64_t rows = 0, k = 0;  // the operand's logical shape
  DType dtype() const { return data.dtype(); }
};

// Quantizes the operand x (transpose false: x [R, C] is the operand, rows R, contraction C) or x^T
// (transpose true: rows C, contraction R), with dynamic scales per group of `mode` (the group's
// own amax; pow2 as fp8_group_scale). one_scale: a single tensorwise scale (the amax of all of x),
// stored in every slot of `mode`'s layout (a tensorwise operand for GEMMs whose other operand is
// scaled per row). Both dims padded to multiples of `pad` (16; 128-blocks need no more padding).
Fp8ScaledTensor fp8_cast_scaled(const Tensor& x, DType fmt, Fp8ScaleMode mode, bool transpose,
                                bool pow2, bool one_scale = false, int64_t pad = 16);
// The operand's [rows, K] values q * scale_inv (the logical part, without padding).
Tensor fp8_scaled_dequantize(const Fp8ScaledTensor& q, DType dtype = DType::F32);

// out [rows_p(a), rows_p(b)] = a . b^T with each product term scaled by its operands' scales,
// accumulated in fp32. The scale-mode pairs cuBLASLt 13 runs on Hopper (sm_90): (Row, Row),
// (Block1x128, Block128x128), (Block128x128, Block1x128), (Block1x128, Block1x128); any other pair
// is refused by name, on every device (as are fast accumulation with block scales, which cuBLASLt
// does not take, and e5m2 x e5m2). CPU: the exact emulation (dequantize, fp32 GEMM).
Tensor fp8_gemm_scaled(const Fp8ScaledTensor& a, const Fp8ScaledTensor& b, DType out_dtype,
                       bool fast_accum);

// ---- delayed scaling state (TE DelayedScaling) -----------------------------------------------

// Amax histories and scales of a set of fp8 tensor slots, one buffer per quantity so that one
// all-reduce covers every current amax and one kernel updates every scale.
// amax_history is [L, n] as TE lays it out: row 0 accumulates the current step's amaxes.
class Fp8DelayedScaling {
 public:
  Fp8DelayedScaling(const Fp8Recipe& recipe, Device device);
  // Registers a slot for tensors cast to `fmt`; all slots are added before the first use.
  int add_slot(DType fmt);
  int64_t num_slots() const { return static_cast<int64_t>(formats_.size()); }
  const Fp8Recipe& recipe() const { return recipe_; }
  Device device() const { return device_; }

  // f32 [1] views of one slot (allocating the buffers on first use).
  Tensor scale(int slot);
  Tensor scale_inv(int slot);
  Tensor amax(int slot);  // the current step's accumulator, amax_history[0][slot]
  Tensor amax_history();  // [L, n]
  Tensor scales();        // [n]
  Tensor scale_invs();    // [n]
  // Row 0 of the history, contiguous [n]: all-reduce MAX it across data-parallel ranks before
  // update() so that every rank computes the same scales.
  Tensor current_amaxes();

  // End of a training step: on recompute steps (1, 1 + interval, ...) every slot's scale becomes
  // fp8_max / a / 2^margin with a = max over the history ('max') or its row 0 ('most_recent'),
  // non-finite entries ignored; a slot without a positive finite amax keeps its scale. Then the
  // histories roll (row 0 moves to row L-1, rows shift up, row 0 restarts at 0).
  void update();
  int64_t updates() const { return updates_; }

  // For checkpoints: history, scales, and the update count.
  std::vector<std::pair<std::string, Tensor>> state_tensors();
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors);

 private:
  void allocate();
  Fp8Recipe recipe_;
  Device device_;
  std::vector<DType> formats_;
  Tensor history_, scale_, scale_inv_, max_values_;
  int64_t updates_ = 0;
};

// ---- the fp8 linear op ------------------------------------------------------------------------

// Mode switches shared by all fp8 layers of a model.
struct Fp8Autocast {
  bool enabled = true;      // false: layers run the plain high-precision linear
  bool record_amax = true;  // false (evaluation): delayed-scaling histories are left alone
};

// What one fp8 linear layer needs at run time.
struct Fp8LinearContext {
  Fp8Recipe recipe;
  std::shared_ptr<Fp8DelayedScaling> delayed;  // Delayed scaling only
  int slot_input = -1, slot_weight = -1, slot_grad_output = -1;
  std::shared_ptr<const Fp8Autocast> autocast;  // null: enabled and recording
  // Supplies the weight already in fp8 (e.g. gathered by FSDP as e4m3 with a global scale)
  // instead of casting `weight` here; it must describe the same [out, in] values.
  std::function<Fp8Tensor(const Tensor& weight)> weight_provider;
};

// While one of these is alive (on this thread), fp8_linear casts `input` once for all the layers
// that read it: Llama's q/k/v projections read one tensor, so do gate/up. The first layer's cast
// (fp8 data, transposed copy, scale) serves the next ones, as one input scale serves TE's fused
// QKV GEMM; with delayed scaling the next layers take the first one's amax into their own slots,
// so every layer's history stays what it would have been. Casts of other tensors are unaffected.
class Fp8SharedInputCast {
 public:
  explicit Fp8SharedInputCast(const Tensor& input);
  ~Fp8SharedInputCast();
  Fp8SharedInputCast(const Fp8SharedInputCast&) = delete;
  Fp8SharedInputCast& operator=(const Fp8SharedInputCast&) = delete;

  // fp8_linear's side: the cast of `x` made earlier in this scope with these settings, if any.
  const Fp8Tensor* find(const Tensor& x, DType fmt, bool row, bool col, int slot_scaling) const;
  void remember(const Tensor& x, DType fmt, int slot_scaling, const Fp8Tensor& cast, int slot);
  int cast_slot() const { return slot_; }
  static Fp8SharedInputCast* current();

 private:
  Tensor input_;
  Fp8SharedInputCast* previous_ = nullptr;
  bool have_ = false;
  DType fmt_ = DType::E4M3;
  int scaling_ = -1;  // the Fp8Scaling of the cast
  int slot_ = -1;     // the delayed-scaling slot whose scale the cast used
  Fp8Tensor cast_;
};

// y [..., out] = x [..., in] . weight[out, in]^T (+ bias), with the GEMMs the recipe puts in fp8:
// fprop e4m3 x e4m3 (fast accumulation), dgrad grad(e5m2 for HYBRID) x weight, wgrad grad x input
// (precise accumulation). Output and input gradient in x's dtype (the GEMMs write it directly);
// the wgrad GEMM writes fp32, which becomes the weight gradient as is for an fp32 weight and
// rounded once to the weight's dtype for a 16-bit one (autograd keeps a gradient in its
// parameter's dtype).
// The fp8 transposed copies of x and weight are made in the forward cast and saved for backward.
// As linear does, the dgrad GEMM adds the gradient x already has in this backward (layers sharing
// an input, q/k/v or gate/up, sum their input gradients inside their GEMMs, rounded once each).
Tensor fp8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const Fp8LinearContext& ctx);

// grouped_linear (ops/ops.h) in fp8: x [N, in] in groups of group_sizes[g] rows (the tokens of a
// mixture-of-experts layer sorted by expert), group g's rows times weights[g]^T as fp8_linear
// computes them under contexts[g] (one context per expert weight: its own input, weight and
// grad_output scaling, i.e. per expert weight and per activation group; all switched by one
// autocast). One fp8 GEMM per non-empty group in forward, dgrad and wgrad; an empty group casts
// nothing and its weight gets a zero gradient. With the autocast disabled, grouped_linear.
// Under TE (delayed) and AO tensorwise (dynamic) scaling each operand (the rows, the weights, the
// output gradient) is cast once for all groups (fp8_cast_grouped), the fprop and dgrad GEMMs write
// the output and input gradient rows in place, and the forward keeps only the fp8 transposes;
// the other recipes run each group through fp8_linear's path.
Tensor fp8_grouped_linear(const Tensor& x, const std::vector<Tensor>& weights,
                          const std::vector<int64_t>& group_sizes,
                          const std::vector<const Fp8LinearContext*>& contexts);

// linear_cross_entropy (ops/ops.h; the arguments are its) with the GEMMs of fp8_linear(x, weight,
// {}, ctx): the LM head in fp8 fused with the loss over row chunks, so that neither the [N, V]
// logits nor their gradient exist. The same casts, GEMMs, formats and scaling as the fp8 linear
// followed by cross_entropy: the weight is cast once per call (its amax recorded once); each
// chunk's rows of x and of the output gradient are cast with the slot's scale, known before the
// step under delayed scaling, their amaxes max-accumulated over the chunks (the amax of all rows);
// the weight gradient is summed in fp32 over the chunks and rounded once, as the one wgrad GEMM
// rounds it (so only its summation order differs). MXFP8 (emulated) runs chunks of multiples of
// 32 rows, so that its 32-row blocks along the tokens (the wgrad GEMM's operands) are those of one
// pass; the delayed recipe's chunks are multiples of 16 rows.
// Recipes whose scales span all rows (fp8_linear_cross_entropy_unfused_reason) run the fp8 linear
// and then cross_entropy instead, with the [N, V] logits. With fp8 switched off (evaluation in
// bf16) it is linear_cross_entropy.
Tensor fp8_linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets,
                                const Fp8LinearContext& ctx, int64_t ignore_index = -100,
                                int64_t chunk_rows = 0, double grad_scale = 1.0);
// Empty when fp8_linear_cross_entropy runs `recipe` over row chunks; else why it does not.
std::string fp8_linear_cross_entropy_unfused_reason(const Fp8Recipe& recipe);

// y = down(swiglu(gate(x), up(x))) (a Llama MLP) with all three projections in fp8 under one
// delayed-scaling state, as fp8_linear would run them one by one (the same GEMMs, scales, amaxes
// and rounding: tested bit for bit), but with swiglu fused into the casts around it: the forward
// casts swiglu(gate, up) straight to fp8 for the down projection, and the backward casts swiglu's
// two gradients straight to e5m2 (with their transposes) for the gate and up GEMMs, so neither
// swiglu's output nor its gradients pass through memory in 16 bits (fused on CUDA; the CPU
// emulation runs the same steps unfused). x is cast once for gate and up.
// Returns an undefined tensor where it does not apply, for the caller to run the layers one by
// one: fp8 off (evaluation), not delayed scaling, a GEMM overridden to high precision, a weight
// provider (FSDP's fp8 all-gather), contexts of different states, or an f32 input.
// residual (optional, of the output's shape, dtype and device): residual + the MLP, the sum made
// by the down GEMM (its addend, rounded once) where nothing is padded, else added after; its
// gradient is the output's.
Tensor fp8_swiglu_mlp(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                      const Tensor& w_down, const Fp8LinearContext& gate,
                      const Fp8LinearContext& up, const Fp8LinearContext& down,
                      const Tensor& residual = Tensor());

}  // namespace accel
