#include "ops/optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

namespace accel {

namespace {

// splitmix64's finalizer: a bijection whose outputs for nearby inputs are unrelated.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// FNV-1a over the parameter's name: its rounding stream does not depend on where it sits.
uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// A contiguous 1-D view of elements [begin, begin + size) of contiguous `t`.
Tensor span_view(const Tensor& t, int64_t begin, int64_t size) {
  return Tensor::from_storage(t.storage(), t.dtype(), {size}, {1}, t.offset() + begin);
}

}  // namespace

Optimizer::Optimizer(const OptimizerOptions& opts, std::vector<Tensor> params,
                     std::vector<std::string> names, std::vector<Tensor> compute_copies,
                     std::vector<std::vector<ParamSpan>> spans)
    : opts_(opts),
      params_(std::move(params)),
      names_(std::move(names)),
      copies_(std::move(compute_copies)),
      spans_(std::move(spans)) {
  if (names_.size() != params_.size())
    throw std::logic_error("Optimizer: one name per parameter is needed");
  const bool bf16_masters = opts_.master_dtype == DType::BF16;
  if (opts_.master_dtype != DType::F32 && !bf16_masters)
    throw std::logic_error(std::string("Optimizer: master dtype ") +
                           dtype_name(opts_.master_dtype) + " is not f32 or bf16");
  for (size_t i = 0; i < params_.size(); ++i)
    if ((params_[i].dtype() == DType::BF16) != bf16_masters)
      throw std::logic_error("Optimizer: '" + names_[i] + "' is " + dtype_name(params_[i].dtype()) +
                             " with master dtype " + dtype_name(opts_.master_dtype) +
                             " (bf16 params are bf16 master weights, and only they)");
  if (bf16_masters && !copies_.empty())
    throw std::logic_error("Optimizer: bf16 master weights are the compute weights (no copies)");
  if (!bf16_masters && !spans_.empty())
    throw std::logic_error("Optimizer: parameter spans are for bf16 master weights");
  if (bf16_masters && spans_.empty())
    for (size_t i = 0; i < params_.size(); ++i)
      spans_.push_back({ParamSpan{0, params_[i].numel(), names_[i], 0}});
  if (spans_.size() != (bf16_masters ? params_.size() : 0))
    throw std::logic_error("Optimizer: one list of parameter spans per tensor is needed");
  for (size_t i = 0; i < spans_.size(); ++i)
    for (const ParamSpan& sp : spans_[i])
      if (sp.begin < 0 || sp.size < 0 || sp.first < 0 || sp.begin + sp.size > params_[i].numel() ||
          !params_[i].is_contiguous())
        throw std::logic_error("Optimizer: span [" + std::to_string(sp.begin) + ", +" +
                               std::to_string(sp.size) + ") of '" + sp.param + "' is outside " +
                               names_[i] + " " + params_[i].str() + " (or it is not contiguous)");
  if (!copies_.empty() && copies_.size() != params_.size())
    throw std::logic_error("Optimizer: compute copies must be empty or one per parameter");
  for (size_t i = 0; i < copies_.size(); ++i) {
    const Tensor& c = copies_[i];
    if (!c.defined() || c.shape() != params_[i].shape() || c.device() != params_[i].device() ||
        (c.dtype() != DType::BF16 && c.dtype() != DType::F16) || params_[i].dtype() != DType::F32)
      throw std::logic_error("Optimizer: compute copy of '" + names_[i] +
                             "' must be a bf16/f16 tensor of its f32 param's shape and device");
  }
  if (opts_.state_dtype != DType::F32 && opts_.state_dtype != DType::BF16)
    throw std::logic_error(std::string("Optimizer: state dtype ") + dtype_name(opts_.state_dtype) +
                           " is not f32 or bf16");
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    // bf16 masters keep their moments in the state dtype itself (fp32 or bf16).
    DType sdt = bf16_masters ? opts_.state_dtype : p.dtype();
    if (!bf16_masters && opts_.state_dtype == DType::BF16) {
      if (p.dtype() != DType::F32)
        throw std::logic_error("Optimizer: bf16 state needs f32 params, '" + names_[i] + "' is " +
                               dtype_name(p.dtype()));
      sdt = DType::BF16;
    }
    m_.push_back(Tensor::zeros(p.shape(), sdt, p.device(), MemCategory::OptimizerState));
    if (opts_.name == OptimizerName::AdamW)
      v_.push_back(Tensor::zeros(p.shape(), sdt, p.device(), MemCategory::OptimizerState));
  }
}

void Optimizer::step(const std::vector<Tensor>& grads, double lr, double grad_scale) {
  if (grads.size() != params_.size())
    throw std::logic_error("Optimizer::step: " + std::to_string(grads.size()) + " grads for " +
                           std::to_string(params_.size()) + " params");
  ++step_;
  if (opts_.master_dtype == DType::BF16) return step_bf16_masters(grads, lr, grad_scale);
  if (opts_.name == OptimizerName::AdamW) {
    // One multi-tensor update over the params that have a gradient.
    std::vector<Tensor> p, g, m, v, c;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!grads[i].defined()) continue;
      p.push_back(params_[i]);
      g.push_back(grads[i]);
      m.push_back(m_[i]);
      v.push_back(v_[i]);
      if (!copies_.empty()) c.push_back(copies_[i]);
    }
    adamw_step_multi(
        p, g, m, v, AdamWParams{lr, opts_.beta1, opts_.beta2, opts_.eps, opts_.weight_decay, step_},
        grad_scale, c);
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grads[i].defined()) continue;
    sgd_step(params_[i], grads[i], m_[i], lr, opts_.momentum, opts_.weight_decay, grad_scale);
    if (!copies_.empty()) copies_[i].copy_(params_[i]);
  }
}

// Each span becomes an entry of its own (views of the param, grad and state), whose rounding
// stream is keyed by (rounding_seed, step, parameter name) and indexed by the element's place in
// its parameter.
void Optimizer::step_bf16_masters(const std::vector<Tensor>& grads, double lr, double grad_scale) {
  const uint64_t step_seed = mix64(opts_.rounding_seed ^ mix64(static_cast<uint64_t>(step_)));
  const bool adamw = opts_.name == OptimizerName::AdamW;
  std::vector<Tensor> p, g, m, v;
  std::vector<StochasticRounding> r;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grads[i].defined()) continue;
    for (const ParamSpan& sp : spans_[i]) {
      if (sp.size == 0) continue;
      p.push_back(span_view(params_[i], sp.begin, sp.size));
      g.push_back(span_view(grads[i], sp.begin, sp.size));
      m.push_back(span_view(m_[i], sp.begin, sp.size));  // SGD: the momentum buffer
      if (adamw) v.push_back(span_view(v_[i], sp.begin, sp.size));
      r.push_back({mix64(step_seed ^ name_hash(sp.param)), static_cast<uint64_t>(sp.first)});
    }
  }
  if (adamw) {
    adamw_step_multi(
        p, g, m, v, AdamWParams{lr, opts_.beta1, opts_.beta2, opts_.eps, opts_.weight_decay, step_},
        grad_scale, {}, r);
    return;
  }
  for (size_t k = 0; k < p.size(); ++k)
    sgd_step(p[k], g[k], m[k], lr, opts_.momentum, opts_.weight_decay, grad_scale, &r[k]);
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (opts_.name == OptimizerName::AdamW) {
      out.push_back({names_[i] + ".exp_avg", m_[i]});
      out.push_back({names_[i] + ".exp_avg_sq", v_[i]});
    } else {
      out.push_back({names_[i] + ".momentum_buffer", m_[i]});
    }
  }
  return out;
}

void Optimizer::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                           int64_t step) {
  std::map<std::string, Tensor> by_name(tensors.begin(), tensors.end());
  auto load = [&](const std::string& key, const Tensor& dst) {
    auto it = by_name.find(key);
    if (it == by_name.end())
      throw std::runtime_error("optimizer state has no tensor '" + key + "'");
    if (it->second.shape() != dst.shape())
      throw std::runtime_error("optimizer state tensor '" + key + "' has shape " +
                               shape_str(it->second.shape()) + ", expected " +
                               shape_str(dst.shape()));
    dst.copy_(it->second);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    if (opts_.name == OptimizerName::AdamW) {
      load(names_[i] + ".exp_avg", m_[i]);
      load(names_[i] + ".exp_avg_sq", v_[i]);
    } else {
      load(names_[i] + ".momentum_buffer", m_[i]);
    }
  }
  step_ = step;
}

double LRSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (kind == LrScheduleKind::Constant) return peak_lr;
  const double min_lr = peak_lr * min_lr_ratio;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  const double t =
      std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
  if (kind == LrScheduleKind::Linear) return peak_lr + (min_lr - peak_lr) * t;
  return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + std::cos(M_PI * t));  // cosine
}

double clip_coefficient(double global_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (global_norm + 1e-6));
}

}  // namespace accel
