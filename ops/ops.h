// Every math op, as free functions on Tensors. Each op checks its arguments (errors name the op
// first, then the offending shapes or dtypes), runs on the inputs' device through that device's
// backend (ops/backend.h), and records its backward with autograd when an input needs a gradient.
// Backward functions are written with these same ops, so they read like the math.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "runtime/autograd.h"
#include "runtime/tensor.h"

namespace accel {

// ---- views and layout (differentiable; share storage where the layout allows) ----------------
Tensor reshape(const Tensor& x, Shape shape);  // one dim may be -1; copies when not viewable
Tensor view(const Tensor& x, Shape shape);     // like reshape but never copies (throws instead)
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end);  // [start, end)
Tensor expand(const Tensor& x, const Shape& shape);  // broadcast size-1 dims (and new leading dims)
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor contiguous(const Tensor& x);
Tensor cast(const Tensor& x, DType dtype);  // round to nearest even; fp8 saturates
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim);

// ---- elementwise (numpy broadcasting; both inputs must have the same dtype and device) -------
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor silu(const Tensor& x);
Tensor gelu(const Tensor& x);  // tanh approximation, as GPT-2 / HF "gelu_pytorch_tanh"
Tensor tanh(const Tensor& x);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);  // cond: bool, broadcast
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// Comparisons (not differentiable) give bool tensors.
Tensor greater(const Tensor& a, const Tensor& b);
Tensor equal(const Tensor& a, const Tensor& b);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }

// ---- reductions (dims may be negative; empty dims = all) ---------------------------------------
Tensor sum(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
Tensor max(const Tensor& x, int64_t dim, bool keepdim = false);  // values; gradient to the argmax
Tensor amax(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);  // max |x|
// Sums a broadcast gradient back to `shape` (the inverse of expand).
Tensor sum_to_shape(const Tensor& x, const Shape& shape);

// ---- linear algebra ---------------------------------------------------------------------------
// a [..., M, K] @ b [..., K, N]; batch dims broadcast.
Tensor matmul(const Tensor& a, const Tensor& b);
// x [..., in] @ weight[out, in]^T (+ bias[out]) (+ residual [..., out], of the output's dtype and
// device). The residual is the GEMM's addend (summed with the product in fp32 and rounded once,
// where a separate add would round twice), added after where there is a bias or x is strided;
// its gradient is the output's.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              const Tensor& residual = Tensor());

// ---- neural-network ops -------------------------------------------------------------------------
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
// logits [N, V] (any float dtype), targets [N] i64; mean over targets != ignore_index, computed in
// fp32 (f64 for f64 logits). Returns a scalar of the logits' dtype (f32 for 16-bit logits).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);
// cross_entropy(linear(x, weight), targets) for x [..., D], weight [V, D], targets with one id per
// row of x, computed chunk_rows rows at a time (0: about 2^27 logits per chunk) so that the
// [N, V] logits never exist; the gradients are made in the forward pass. Same value as the two
// ops; in 16-bit dtypes the weight's gradient is rounded once per chunk.
// grad_scale: the gradient backward is expected to bring (the caller backpropagates loss *
// grad_scale). The gradients are made in forward for it, rounded as the two ops round them for
// that upstream gradient; backward multiplies them by its gradient / grad_scale (exactly 1 when
// as expected; another value costs one more rounding). 0 or not finite: taken as 1.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets,
                            int64_t ignore_index = -100, int64_t chunk_rows = 0,
                            double grad_scale = 1.0);
// weight [V, D], ids [...] (i32/i64) -> [..., D]. An id outside [0, V) is an error.
Tensor embedding(const Tensor& weight, const Tensor& ids);
// x [..., D] * rsqrt(mean(x^2) + eps) * weight[D]; statistics in fp32.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
// The residual add fused into the norm: returns {x + r, rms_norm(x + r, weight, eps)}, bit for bit
// add's and rms_norm's values (x and r of one shape), recorded as those two ops (same gradients).
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& r, const Tensor& weight,
                                       double eps);
// The frequencies of a rotary embedding: the pair (x[i], x[i + D/2]) of a head at position p is
// rotated by the angle p * inv_freq[i], and cos and sin are multiplied by attention_scaling (YaRN's
// attention factor; 1 for the other scalings). inv_freq holds D/2 float32 values, computed once
// from the model config as Hugging Face computes them (models/rope_scaling.h).
struct RopeFrequencies {
  std::vector<float> inv_freq;
  double attention_scaling = 1.0;
};
// Hugging Face's default RoPE: inv_freq[i] = 1 / theta^(float(2i) / dim), all in float32.
RopeFrequencies default_rope_frequencies(double theta, int64_t dim);
// Rotary embedding, Hugging Face Llama's rotate-half convention, on x [B, S, H, D] (D even, D/2
// frequencies). Token (b, s) sits at position position_ids[b, s] when position_ids ([B, S], I64 or
// I32, on x's device) is given, else at position_offset + s.
Tensor rope(const Tensor& x, const RopeFrequencies& freqs, int64_t position_offset = 0,
            const Tensor& position_ids = Tensor());
// silu(gate) * up
Tensor swiglu(const Tensor& gate, const Tensor& up);
// Which keys each query sees. The default: causal (query i sees keys j <= i).
struct AttentionMask {
  bool causal = true;
  // 0: no window. W > 0: query i sees keys j with i - W < j <= i (Hugging Face's sliding_window
  // of Mistral and Qwen2: W keys, the query's own included). Needs causal.
  int64_t window = 0;
  // Undefined, or [B, S] int32 on q's device: documents packed into one row, each a run of equal
  // ids (0 0 0 1 1 2 ...); query i sees key j only within its own run. Equal ids in separate runs
  // are separate documents (Hugging Face's packed-sequence ids increase, so there it is the same
  // as comparing ids). Needs causal.
  Tensor segment_ids;
};
// Attention, q [B, S, Hq, D], k and v [B, S, Hkv, D] with Hq a multiple of Hkv (grouped KV
// heads). Output [B, S, Hq, D]. scale defaults to 1/sqrt(D). Never materializes S x S in the
// fused backends; the CPU version works one query row at a time. A row's visible keys always
// include its own (causal), so no row is empty.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v,
                 const AttentionMask& mask = AttentionMask{},
                 std::optional<double> scale = std::nullopt);

// ---- mixture of experts ------------------------------------------------------------------------
// The k largest entries of each row of x [..., C] along the last dim, largest first (ties: the
// lower index first, as torch.topk on the CPU): {values [..., k] of x's dtype, indices [..., k]
// I64}. Differentiable in x through the values (the gradient goes to the chosen entries).
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k);
// Where the tokens of a mixture-of-experts layer go, built on the host from the router's choices
// expert_ids [N, k] (I32/I64, any device; the slot of token t's j-th choice is t * k + j). The
// permuted rows are the N * k slots sorted by expert, stably (a token's slots keep token order
// within an expert), so that expert e's rows are one contiguous group of expert_counts[e] rows.
struct MoeRouting {
  int64_t num_tokens = 0, top_k = 0, num_experts = 0;
  std::vector<int64_t> expert_counts;  // [num_experts], on the host
  Tensor order;    // I64 [N * k] on expert_ids' device: permuted row i holds slot order[i]
  Tensor inverse;  // I64 [N * k]: slot s sits in permuted row inverse[s]
};
MoeRouting moe_routing(const Tensor& expert_ids, int64_t num_experts);
// x [N, H] -> [N * k, H]: permuted row i is x[order[i] / k] (each token copied to its k slots).
// The backward sums each token's k rows (deterministic: no atomics).
Tensor moe_permute(const Tensor& x, const MoeRouting& routing);
// y [N * k, H] (the experts' outputs in permuted order), weights [N, k] -> [N, H]: token t's
// output is sum_j weights[t, j] * y[inverse[t * k + j]], accumulated in fp32 and rounded once.
// Differentiable in y and weights.
Tensor moe_unpermute(const Tensor& y, const Tensor& weights, const MoeRouting& routing);
// x [N, in] whose rows come in groups (group g: the next group_sizes[g] rows; the sizes sum to
// N), weights[g] [out, in] -> [N, out]: group g's rows times weights[g]^T, as grouped GEMMs
// (one call for all groups on the GPU, never a loop of small GEMMs). A group may be empty.
// Differentiable in x and every weight.
Tensor grouped_linear(const Tensor& x, const std::vector<Tensor>& weights,
                      const std::vector<int64_t>& group_sizes);

// ---- random (counter-based Philox: the same stream on every device) ----------------------------
Tensor rand_uniform(const Shape& shape, uint64_t seed, uint64_t offset, DType dtype = DType::F32,
                    Device device = Device::cpu(), double low = 0.0, double high = 1.0);
Tensor rand_normal(const Shape& shape, uint64_t seed, uint64_t offset, DType dtype = DType::F32,
                   Device device = Device::cpu(), double mean = 0.0, double stddev = 1.0);

// ---- optimizer kernels (in place, not recorded) -----------------------------------------------
struct AdamWParams {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based, for bias correction
};
// Stochastic rounding of a bf16 param's update (optimizer.master_weights bf16): element i of the
// tensor rounds its new fp32 value to bf16 with the random bits of the counter-based Philox
// stream at (seed, first + i) (ops/optim_math.h), so a parameter's elements round alike whatever
// tensor or shard holds them.
struct StochasticRounding {
  uint64_t seed = 0;
  uint64_t first = 0;
};
// Updates master `param` and moments m, v from `grad`, as torch.optim.AdamW does. `grad_scale`
// multiplies the gradient first (clipping and loss-scale unscaling).
// - fp32 (or f64) param: grad in its dtype or 16-bit for an fp32 param; m and v in the param's
//   dtype, or bf16 beside an fp32 param (optimizer.state_dtype bf16: each moment is widened to
//   fp32, updated, used for this step's update unrounded, and stored rounded to nearest even).
// - bf16 param (bf16 master weights): grad bf16 or fp32, m and v fp32 or bf16, `rounding`
//   required; the update is computed in fp32 (ops/optim_math.h, the same operations on every
//   backend) and the new value stochastically rounded to bf16.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const AdamWParams& p, double grad_scale = 1.0,
                const StochasticRounding* rounding = nullptr);
// adamw_step over lists (one entry per tensor; every list as long as `params`, all on one
// device), in one pass where the backend can: each entry gets exactly adamw_step's numbers. With
// `compute_copies` non-empty (one defined bf16/f16 tensor per fp32 param, same shape,
// contiguous), each copy also receives its updated param rounded once to nearest even, as copy_
// would write it. `rounding`: empty, or one entry per param (used by the bf16 params).
void adamw_step_multi(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& ms, const std::vector<Tensor>& vs,
                      const AdamWParams& p, double grad_scale = 1.0,
                      const std::vector<Tensor>& compute_copies = {},
                      const std::vector<StochasticRounding>& rounding = {});
// param -= lr * (momentum buffer), torch.optim.SGD semantics with dampening 0, no nesterov. The
// buffer is in the param's dtype, or bf16 beside an fp32 param (as adamw_step's moments); a bf16
// param takes an fp32 or bf16 buffer and needs `rounding`, as in adamw_step.
void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, double lr,
              double momentum, double weight_decay, double grad_scale = 1.0,
              const StochasticRounding* rounding = nullptr);
// Sum of squares of all elements of all tensors, accumulated in fp64, returned to the host (for
// global-norm clipping; one synchronization for the whole list on a GPU).
double sum_of_squares(const std::vector<Tensor>& xs);
// Lets fp32 GEMMs on `device` run on TF32 tensor cores (CUDA only; other devices ignore it).
void set_allow_tf32(Device device, bool allow);
// True if any element is NaN or Inf.
bool has_non_finite(const Tensor& x);

}  // namespace accel
