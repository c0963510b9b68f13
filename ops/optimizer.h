// Optimizers over master tensors (fp32, or bf16 with stochastic rounding), learning-rate
// schedules and gradient clipping.
//
// An Optimizer updates a list of tensors (whole parameters on one process, or the shards a rank
// owns under ZeRO/FSDP) from gradients of the same shapes; it never sees the model.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ops/ops.h"
#include "runtime/config.h"  // OptimizerName, LrScheduleKind

namespace accel {

struct OptimizerOptions {
  OptimizerName name = OptimizerName::AdamW;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, momentum = 0.9;
  // The dtype of the moments / momentum buffers: F32 keeps them in each param's own dtype;
  // BF16 stores them in bf16 beside fp32 params (optimizer.state_dtype bf16; the update math
  // stays fp32, the stored moments are rounded to nearest even).
  DType state_dtype = DType::F32;
  // The master weights' dtype (optimizer.master_weights): F32, or BF16, where the params the
  // optimizer updates are the bf16 weights themselves: the update is computed in fp32 and
  // stochastically rounded (ops.h StochasticRounding) with seeds drawn from rounding_seed, the
  // step count and each parameter's name, so a resumed run rounds as the uninterrupted one.
  DType master_dtype = DType::F32;
  uint64_t rounding_seed = 0;  // training.seed
};

// Where elements of an optimizer tensor sit in the model: elements [begin, begin + size) of the
// tensor are elements [first, first + size) of the (flattened) parameter `param`. A sharded
// strategy describes its flat chunks with these, so that every element's stochastic rounding
// depends only on (parameter, element), not on the layout.
struct ParamSpan {
  int64_t begin = 0, size = 0;
  std::string param;
  int64_t first = 0;
};

class Optimizer {
 public:
  // `params` are updated in place; state tensors live on `state_device` (the params' device, or
  // the CPU for optimizer offload, in which case params must be on the CPU too).
  //
  // `compute_copies`: empty, or one bf16/f16 tensor per (f32) param, same shape and device, that
  // every step refreshes with its updated param rounded once (as copy_ would): AdamW writes them
  // in the same pass as the update. Copies of params whose grad is undefined are left as they
  // are (their params did not change). The owner refreshes them itself after load_state.
  //
  // `spans` (bf16 masters only): empty, when each tensor is the whole parameter of its name, or
  // one list per tensor; elements outside every span (shard padding) are left as they are.
  Optimizer(const OptimizerOptions& opts, std::vector<Tensor> params,
            std::vector<std::string> names, std::vector<Tensor> compute_copies = {},
            std::vector<std::vector<ParamSpan>> spans = {});

  // One update with learning rate lr; each grad is multiplied by grad_scale first. Params whose
  // grad is undefined are skipped.
  void step(const std::vector<Tensor>& grads, double lr, double grad_scale = 1.0);

  int64_t step_count() const { return step_; }
  // State for checkpoints: "<name>.exp_avg", "<name>.exp_avg_sq" (adamw) or
  // "<name>.momentum_buffer" (sgd), plus the step count; in the state dtype. load_state takes
  // tensors of any float dtype and converts them into it (copy_: widening is exact, fp32 -> bf16
  // rounds to nearest even).
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step);
  const std::vector<Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }

 private:
  OptimizerOptions opts_;
  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::vector<Tensor> copies_;                 // compute copies (empty: none)
  std::vector<Tensor> m_, v_;                  // adamw moments, or m_ = momentum buffers for sgd
  std::vector<std::vector<ParamSpan>> spans_;  // bf16 masters: one list per param
  int64_t step_ = 0;
  void step_bf16_masters(const std::vector<Tensor>& grads, double lr, double grad_scale);
};

struct LRSchedule {
  LrScheduleKind kind = LrScheduleKind::Cosine;
  double peak_lr = 3e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.1;  // linear and cosine decay to peak_lr * min_lr_ratio
  // LR for 0-based step index `step`: linear warmup from peak/warmup to peak, then decay.
  double at(int64_t step) const;
};

// torch.nn.utils.clip_grad_norm_: scale = min(1, max_norm / (norm + 1e-6)); max_norm <= 0 means
// no clipping (scale 1).
double clip_coefficient(double global_norm, double max_norm);

}  // namespace accel
