// The CUDA backend (ops/backend.h) and the CUDA-only knobs around it. Each method lives in the file
// named after its op, beside the CPU one (cuda/rope.cu, cpu/rope.cpp; ops/README.md has the
// table). Every kernel runs on cuda::current_stream() of the tensors' device.
#pragma once

#include "ops/backend.h"

namespace accel {

class CudaBackend final : public Backend {
 public:
  const char* name() const override { return "cuda"; }
  void set_allow_tf32(bool allow) override;

  void unary(UnaryOp op, const Tensor& out, const Tensor& x) override;
  void add_scalar(const Tensor& out, const Tensor& x, double s) override;
  void mul_scalar(const Tensor& out, const Tensor& x, double s) override;
  void pow_scalar(const Tensor& out, const Tensor& x, double e) override;
  void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) override;
  void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) override;
  void reduce(ReduceKind op, const Tensor& out, const Tensor& x,
              const std::vector<int64_t>& dims) override;
  void max_backward(const Tensor& grad_in, const Tensor& x, const Tensor& out_keepdim,
                    const Tensor& grad_keepdim, int64_t dim) override;
  void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
              double alpha, double beta, const Tensor& addend) override;
  void softmax(const Tensor& out, const Tensor& x, bool log) override;
  void cross_entropy(const Tensor& loss_per_row, const Tensor& lse, const Tensor& logits,
                     const Tensor& targets, int64_t ignore_index) override;
  void cross_entropy_backward(const Tensor& grad_logits, const Tensor& logits, const Tensor& lse,
                              const Tensor& targets, int64_t ignore_index,
                              const Tensor& scale) override;
  void cross_entropy_with_grad(const Tensor& loss_per_row, const Tensor& lse,
                               const Tensor& grad_logits, const Tensor& logits,
                               const Tensor& targets, int64_t ignore_index,
                               const Tensor& scale) override;
  void embedding(const Tensor& out, const Tensor& weight, const Tensor& ids) override;
  void embedding_backward(const Tensor& grad_weight, const Tensor& grad_out,
                          const Tensor& ids) override;
  void rms_norm(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                double eps) override;
  void add_rms_norm(const Tensor& sum, const Tensor& out, const Tensor& rstd, const Tensor& x,
                    const Tensor& r, const Tensor& weight, double eps) override;
  void rms_norm_backward(const Tensor& grad_x, const Tensor& grad_weight, const Tensor& grad_out,
                         const Tensor& x, const Tensor& weight, const Tensor& rstd,
                         const Tensor& grad_x_add) override;
  void rope(const Tensor& out, const Tensor& x, const RopeFrequencies& freqs,
            int64_t position_offset, const Tensor& position_ids, bool inverse) override;
  void swiglu(const Tensor& out, const Tensor& gate, const Tensor& up) override;
  void swiglu_backward(const Tensor& grad_gate, const Tensor& grad_up, const Tensor& grad_out,
                       const Tensor& gate, const Tensor& up) override;
  void attention(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                 const Tensor& v, const AttentionMask& mask, double scale) override;
  void attention_backward(const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v,
                          const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse, const AttentionMask& mask,
                          double scale) override;
  void rand_uniform(const Tensor& out, uint64_t seed, uint64_t offset, double low,
                    double high) override;
  void rand_normal(const Tensor& out, uint64_t seed, uint64_t offset, double mean,
                   double stddev) override;
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWParams& p, double grad_scale,
                  const StochasticRounding* rounding) override;
  void adamw_step_multi(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        const std::vector<Tensor>& ms, const std::vector<Tensor>& vs,
                        const std::vector<Tensor>& compute_copies, const AdamWParams& p,
                        double grad_scale,
                        const std::vector<StochasticRounding>& rounding) override;
  void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, double lr,
                double momentum, double weight_decay, double grad_scale,
                const StochasticRounding* rounding) override;
  double sum_of_squares(const std::vector<Tensor>& xs) override;
  bool has_non_finite(const Tensor& x) override;

  // fp8_cast.cu
  void fp8_cast(const Tensor& x, const Tensor& scale, const Tensor& data, const Tensor& data_t,
                const Tensor& amax, const Tensor& scale_inv) override;
  void fp8_amax(const Tensor& x, const Tensor& out) override;
  void fp8_cast_grouped(const std::vector<Fp8CastGroup>& groups,
                        const Fp8GroupScaling& scaling) override;
  void fp8_amax_grouped(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs) override;
  void fp8_scale_from_amax(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                           float fp8_max, int margin) override;
  void fp8_transpose(const Tensor& data_t, const Tensor& data) override;
  void fp8_delayed_update(const Tensor& history, const Tensor& scale, const Tensor& scale_inv,
                          const Tensor& fp8_max, bool use_max, int margin, bool recompute) override;
  void fp8_mx_fake_quant(const Tensor& out, const Tensor& x, DType fmt, int block_dim) override;
  void fp8_cast_scaled(const Tensor& x, bool transpose, Fp8ScaleMode mode, bool pow2,
                       bool one_scale, const Tensor& data, const Tensor& scale_inv) override;
  void fp8_gemm_scaled(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv,
                       Fp8ScaleMode a_mode, const Tensor& b, const Tensor& b_scale_inv,
                       Fp8ScaleMode b_mode, bool fast_accum) override;
  bool fp8_fused_cast_layout(const std::vector<const Tensor*>& inputs, int64_t cols) override;
  void fp8_swiglu_cast(const Tensor& gate, const Tensor& up, const Fp8CastTarget& out) override;
  void fp8_swiglu_backward_cast(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                const Fp8CastTarget& to_gate, const Fp8CastTarget& to_up) override;
  // moe.cu
  void topk(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t k) override;
  void topk_backward(const Tensor& grad_x, const Tensor& grad_values,
                     const Tensor& indices) override;
  void moe_permute(const Tensor& out, const Tensor& x, const Tensor& order, int64_t top_k) override;
  void moe_permute_backward(const Tensor& grad_x, const Tensor& grad_out, const Tensor& inverse,
                            int64_t top_k) override;
  void moe_unpermute(const Tensor& out, const Tensor& y, const Tensor& weights,
                     const Tensor& inverse) override;
  void moe_unpermute_backward(const Tensor& grad_y, const Tensor& grad_weights,
                              const Tensor& grad_out, const Tensor& y, const Tensor& weights,
                              const Tensor& order) override;
  // grouped_gemm.cpp (cublasGemmGroupedBatchedEx: one call for all groups)
  void grouped_matmul(const std::vector<Tensor>& outs, const std::vector<Tensor>& as,
                      const std::vector<Tensor>& bs, bool trans_a, bool trans_b) override;
  // fp8_gemm.cpp
  void fp8_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                const Tensor& b_scale_inv, bool fast_accum, const Tensor& addend) override;
};

namespace cuda {
// fp32 GEMMs use TF32 tensor cores when allowed (off by default; `mixed_precision: no` with tf32
// configured turns it on). The environment variable ACCEL_ALLOW_TF32=1 sets the initial value.
void set_allow_tf32(bool allow);
bool allow_tf32();

// Which attention kernels run: "auto" picks cuDNN's fused flash attention where it supports the
// problem (bf16/f16, head dim <= 128 and a multiple of 8, as many keys as queries), else our
// tensor-core flash kernels (bf16/f16, head dim 64 or 128), else the generic tiled kernels;
// "cudnn" demands cuDNN (an error where it declines), "flash" skips cuDNN, "generic" forces the
// generic kernels. The environment variable ACCEL_ATTENTION=<impl> sets it at start.
void set_attention_impl(const char* impl);

// AdamW over many tensors in one launch per (param, grad, copy) dtype combination (a chunked
// work list over all of them): the same math as adamw_step for each i. `compute_copies` empty, or
// one bf16/f16 tensor per (fp32) param that receives the updated param rounded to nearest even.
// `rounding`: empty, or one per param (bf16 params need theirs).
void adamw_step_multi(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& ms, const std::vector<Tensor>& vs,
                      const AdamWParams& p, double grad_scale,
                      const std::vector<Tensor>& compute_copies = {},
                      const std::vector<StochasticRounding>& rounding = {});
}  // namespace cuda

}  // namespace accel
