// The CPU backend: one class, its methods implemented in files named after the ops (the comment
// above each group names the file; ops/README.md has the table).
#pragma once

#include "ops/backend.h"

namespace accel {

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  // elementwise.cpp
  void unary(UnaryOp op, const Tensor& out, const Tensor& x) override;
  void add_scalar(const Tensor& out, const Tensor& x, double s) override;
  void mul_scalar(const Tensor& out, const Tensor& x, double s) override;
  void pow_scalar(const Tensor& out, const Tensor& x, double e) override;
  void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) override;
  void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) override;

  // reduce.cpp
  void reduce(ReduceKind op, const Tensor& out, const Tensor& x,
              const std::vector<int64_t>& dims) override;
  void max_backward(const Tensor& grad_in, const Tensor& x, const Tensor& out_keepdim,
                    const Tensor& grad_keepdim, int64_t dim) override;

  // matmul.cpp
  void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
              double alpha, double beta, const Tensor& addend) override;

  // softmax.cpp
  void softmax(const Tensor& out, const Tensor& x, bool log) override;
  // cross_entropy.cpp
  void cross_entropy(const Tensor& loss_per_row, const Tensor& lse, const Tensor& logits,
                     const Tensor& targets, int64_t ignore_index) override;
  void cross_entropy_backward(const Tensor& grad_logits, const Tensor& logits, const Tensor& lse,
                              const Tensor& targets, int64_t ignore_index,
                              const Tensor& scale) override;
  // embedding.cpp
  void embedding(const Tensor& out, const Tensor& weight, const Tensor& ids) override;
  void embedding_backward(const Tensor& grad_weight, const Tensor& grad_out,
                          const Tensor& ids) override;
  // rms_norm.cpp
  void rms_norm(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight,
                double eps) override;
  void add_rms_norm(const Tensor& sum, const Tensor& out, const Tensor& rstd, const Tensor& x,
                    const Tensor& r, const Tensor& weight, double eps) override;
  void rms_norm_backward(const Tensor& grad_x, const Tensor& grad_weight, const Tensor& grad_out,
                         const Tensor& x, const Tensor& weight, const Tensor& rstd,
                         const Tensor& grad_x_add) override;
  // rope.cpp
  void rope(const Tensor& out, const Tensor& x, const RopeFrequencies& freqs,
            int64_t position_offset, const Tensor& position_ids, bool inverse) override;
  // swiglu.cpp
  void swiglu(const Tensor& out, const Tensor& gate, const Tensor& up) override;
  void swiglu_backward(const Tensor& grad_gate, const Tensor& grad_up, const Tensor& grad_out,
                       const Tensor& gate, const Tensor& up) override;

  // attention.cpp
  void attention(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                 const Tensor& v, const AttentionMask& mask, double scale) override;
  void attention_backward(const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v,
                          const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse, const AttentionMask& mask,
                          double scale) override;

  // moe.cpp
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
  void grouped_matmul(const std::vector<Tensor>& outs, const std::vector<Tensor>& as,
                      const std::vector<Tensor>& bs, bool trans_a, bool trans_b) override;

  // random.cpp
  void rand_uniform(const Tensor& out, uint64_t seed, uint64_t offset, double low,
                    double high) override;
  void rand_normal(const Tensor& out, uint64_t seed, uint64_t offset, double mean,
                   double stddev) override;

  // optim.cpp
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

  // reduce.cpp
  double sum_of_squares(const std::vector<Tensor>& xs) override;
  bool has_non_finite(const Tensor& x) override;

  // fp8_cast.cpp (the exact emulation; no fused kernels)
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

  // fp8_gemm.cpp
  void fp8_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                const Tensor& b_scale_inv, bool fast_accum, const Tensor& addend) override;
};

}  // namespace accel
