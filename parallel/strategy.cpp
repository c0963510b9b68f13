#include "parallel/strategy.h"

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "parallel/ddp.h"
#include "parallel/fsdp.h"
#include "parallel/process_group.h"
#include "parallel/zero.h"
#include "runtime/config.h"

namespace accel {

nlohmann::json Strategy::checkpoint_manifest() const { return nullptr; }
nlohmann::json Strategy::run_report() const { return nullptr; }

void SingleProcessStrategy::setup(Module& model, const OptimizerOptions& opts) {
  params_ = model.parameters();
  std::vector<std::string> names;
  std::vector<Tensor> copies;  // the optimizer refreshes them in its update pass
  NoGradGuard no_grad;
  for (Parameter* p : params_) {
    if (p->value.dtype() != DType::F32)
      throw std::logic_error("strategy setup expects fp32 parameters, " + p->name + " is " +
                             dtype_name(p->value.dtype()));
    master_.push_back(p->value);
    names.push_back(p->name);
    if (compute_dtype_ != DType::F32) {
      Tensor copy =
          Tensor::empty(p->value.shape(), compute_dtype_, p->value.device(), MemCategory::Params);
      copy.copy_(p->value);
      copy.set_requires_grad(true);
      copy.set_name(p->name);
      master_.back().set_requires_grad(false);
      p->value = copy;
      copies.push_back(copy);
    }
  }
  optimizer_ = std::make_unique<Optimizer>(opts, master_, names, std::move(copies));
}

StepResult SingleProcessStrategy::step(double lr, double max_grad_norm, double grad_scale) {
  std::vector<Tensor> grads;
  for (Parameter* p : params_) grads.push_back(p->value.grad());
  std::vector<Tensor> present;
  for (const Tensor& g : grads)
    if (g.defined()) present.push_back(g);
  StepResult r;
  double sq = sum_of_squares(present) * grad_scale * grad_scale;
  r.grad_norm = std::sqrt(sq);
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;
    for (size_t i = 0; i < params_.size() && r.first_non_finite.empty(); ++i)
      if (grads[i].defined() && has_non_finite(grads[i])) r.first_non_finite = params_[i]->name;
  } else {
    // Also refreshes the 16-bit compute copies (the optimizer holds them).
    optimizer_->step(grads, lr, grad_scale * clip_coefficient(r.grad_norm, max_grad_norm));
  }
  for (Parameter* p : params_) p->value.zero_grad();
  return r;
}

std::vector<std::pair<std::string, Tensor>> SingleProcessStrategy::full_state_dict() {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) out.push_back({params_[i]->name, master_[i]});
  return out;
}

std::vector<std::pair<std::string, Tensor>> SingleProcessStrategy::optimizer_state() {
  return optimizer_->state_tensors();
}

int64_t SingleProcessStrategy::optimizer_steps() const { return optimizer_->step_count(); }

void SingleProcessStrategy::load_state(
    const std::vector<std::pair<std::string, Tensor>>& full_weights,
    const std::vector<std::pair<std::string, Tensor>>& optimizer_state, int64_t optimizer_steps) {
  std::map<std::string, Tensor> by_name(full_weights.begin(), full_weights.end());
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto it = by_name.find(params_[i]->name);
    if (it == by_name.end())
      throw std::runtime_error("checkpoint has no weight '" + params_[i]->name + "'");
    if (it->second.shape() != master_[i].shape())
      throw std::runtime_error("checkpoint weight '" + params_[i]->name + "' has shape " +
                               shape_str(it->second.shape()) + ", the model expects " +
                               shape_str(master_[i].shape()));
    master_[i].copy_(it->second);
    if (compute_dtype_ != DType::F32) params_[i]->value.copy_(master_[i]);
  }
  optimizer_->load_state(optimizer_state, optimizer_steps);
}

std::unique_ptr<Strategy> make_strategy(const Config& cfg, std::shared_ptr<ProcessGroup> pg,
                                        DType compute_dtype) {
  const DistributedType type = cfg.distributed_type;
  const int world = pg ? pg->size() : 1;
  if (type == DistributedType::No) {
    if (world > 1)
      throw std::invalid_argument(
          "distributed_type NO runs one process, but " + std::to_string(world) +
          " were launched; set distributed_type MULTI_GPU/MULTI_CPU (DDP) or DEEPSPEED (ZeRO)");
    return std::make_unique<SingleProcessStrategy>(compute_dtype);
  }
  if (type == DistributedType::MultiGpu || type == DistributedType::MultiCpu)
    return std::make_unique<DdpStrategy>(pg, compute_dtype, cfg.distributed.ddp_bucket_cap_mb,
                                         cfg.distributed.find_unused_parameters);
  if (type == DistributedType::DeepSpeed) {
    DataParallelOptions o;
    o.zero_stage = cfg.deepspeed.zero_stage;  // 1..3: validate_config refuses others
    o.compute_dtype = compute_dtype;
    o.bucket_cap_mb = cfg.distributed.ddp_bucket_cap_mb;
    o.find_unused_parameters = cfg.distributed.find_unused_parameters;
    o.offload_optimizer = cfg.deepspeed.offload_optimizer_device == OffloadDevice::Cpu;
    o.offload_params = cfg.deepspeed.offload_param_device == OffloadDevice::Cpu;
    o.save_16bit_model = cfg.deepspeed.zero3_save_16bit_model;
    return std::make_unique<ZeroStrategy>(pg, o);
  }
  return std::make_unique<FsdpStrategy>(pg, FsdpOptions::from_config(cfg, compute_dtype));
}

}  // namespace accel
