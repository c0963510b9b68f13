#include "models/fp8_linear.h"

#include <map>
#include <sstream>
#include <stdexcept>

#include "models/llama.h"
#include "parallel/process_group.h"

namespace accel {

Fp8Recipe fp8_recipe_from_config(const Fp8Config& cfg) {
  Fp8Recipe r;
  if (cfg.backend != "TE" && cfg.backend != "AO")
    throw std::invalid_argument("fp8_config.backend " + cfg.backend +
                                " cannot train: use TE (delayed scaling) or AO (dynamic scaling)");
  if (cfg.fp8_format == "E5M2")
    throw std::invalid_argument(
        "fp8_config.fp8_format E5M2 cannot train (too little precision for weights and "
        "activations): use HYBRID or E4M3");
  if (cfg.fp8_format != "HYBRID" && cfg.fp8_format != "E4M3")
    throw std::invalid_argument("fp8_config.fp8_format " + cfg.fp8_format +
                                " is unknown: use HYBRID or E4M3");
  if (cfg.backend == "AO") {
    if (cfg.use_mxfp8_block_scaling)
      throw std::invalid_argument(
          "fp8_config.use_mxfp8_block_scaling is a TE option (MXFP8BlockScaling): with backend AO "
          "set it to false, or use backend TE");
    // torchao's tensorwise recipe: e4m3 inputs and weights, e5m2 output gradients.
    r.scaling = Fp8Scaling::Dynamic;
    r.forward_dtype = DType::E4M3;
    r.backward_dtype = DType::E5M2;
    return r;
  }
  r.scaling = cfg.use_mxfp8_block_scaling ? Fp8Scaling::MxBlock : Fp8Scaling::Delayed;
  r.forward_dtype = DType::E4M3;
  r.backward_dtype = cfg.fp8_format == "HYBRID" ? DType::E5M2 : DType::E4M3;
  r.amax_history_len = cfg.amax_history_len;
  if (cfg.amax_compute_algo == "max")
    r.amax_algo = AmaxAlgo::Max;
  else if (cfg.amax_compute_algo == "most_recent")
    r.amax_algo = AmaxAlgo::MostRecent;
  else
    throw std::invalid_argument("fp8_config.amax_compute_algo " + cfg.amax_compute_algo +
                                " is unknown: use max or most_recent");
  r.margin = static_cast<int>(cfg.margin);
  r.interval = cfg.interval;
  r.hp_fprop = cfg.override_linear_precision_fprop;
  r.hp_dgrad = cfg.override_linear_precision_dgrad;
  r.hp_wgrad = cfg.override_linear_precision_wgrad;
  return r;
}

std::vector<Fp8LayerChoice> choose_fp8_layers(Module& model, const Fp8Config& cfg) {
  std::vector<Fp8LayerChoice> out;
  for (auto& [name, m] : model.named_modules()) {
    auto* lin = dynamic_cast<Linear*>(m);
    if (!lin) continue;
    Fp8LayerChoice c;
    c.name = name;
    c.out_features = lin->weight.value.size(0);
    c.in_features = lin->weight.value.size(1);
    c.fp8 = true;
    out.push_back(c);
  }
  const bool ao = cfg.backend == "AO";
  for (Fp8LayerChoice& c : out) {
    bool aligned = c.in_features % 16 == 0 && c.out_features % 16 == 0;
    if (!aligned && !(ao && cfg.pad_inner_dim)) {
      c.fp8 = false;
      c.reason = std::string("a dimension is not divisible by 16") +
                 (ao ? " (set fp8_config.pad_inner_dim to pad it)" : "");
    }
  }
  if (ao && !out.empty()) {
    // A tied LM head is no Linear here but is one in Hugging Face's model, where it is the last.
    auto* lm = dynamic_cast<LlamaForCausalLM*>(&model);
    const bool tied_head = lm && !lm->lm_head;
    out.front().fp8 = false;
    out.front().reason = "first linear layer (AO keeps the first and last in high precision)";
    if (!tied_head) {
      out.back().fp8 = false;
      out.back().reason = "last linear layer (AO keeps the first and last in high precision)";
    }
    for (Fp8LayerChoice& c : out)
      for (const std::string& pat : cfg.exclude_modules)
        if (!pat.empty() && c.name.find(pat) != std::string::npos && c.fp8) {
          c.fp8 = false;
          c.reason = "matches fp8_config.exclude_modules pattern '" + pat + "'";
        }
  }
  return out;
}

Fp8Training::Fp8Training(Module& model, const Fp8Config& cfg, Device device)
    : recipe_(fp8_recipe_from_config(cfg)),
      cfg_(cfg),
      device_(device),
      layers_(choose_fp8_layers(model, cfg)),
      autocast_(std::make_shared<Fp8Autocast>()),
      eval_in_fp8_(cfg.use_autocast_during_eval) {
  if (recipe_.scaling == Fp8Scaling::Delayed)
    delayed_ = std::make_shared<Fp8DelayedScaling>(recipe_, device);
  std::map<std::string, Linear*> linears;
  for (auto& [name, m] : model.named_modules())
    if (auto* lin = dynamic_cast<Linear*>(m)) linears[name] = lin;
  for (const Fp8LayerChoice& c : layers_) {
    if (!c.fp8) continue;
    auto ctx = std::make_shared<Fp8LinearContext>();
    ctx->recipe = recipe_;
    ctx->autocast = autocast_;
    if (delayed_) {
      ctx->delayed = delayed_;
      ctx->slot_input = delayed_->add_slot(recipe_.forward_dtype);
      ctx->slot_weight = delayed_->add_slot(recipe_.forward_dtype);
      ctx->slot_grad_output = delayed_->add_slot(recipe_.backward_dtype);
    }
    Linear* lin = linears.at(c.name);
    if (lin->linear_fn)
      throw std::logic_error("[fp8] linear layer " + c.name + " already has a linear function");
    lin->linear_fn = [ctx](const Tensor& x, const Tensor& w) {
      return fp8_linear(x, w, Tensor(), *ctx);
    };
    contexts_.push_back({c.name, ctx});
  }
}

int64_t Fp8Training::num_fp8_layers() const { return static_cast<int64_t>(contexts_.size()); }

std::string Fp8Training::describe() const {
  std::ostringstream o;
  o << "fp8: backend " << cfg_.backend << ": " << recipe_.str() << "; evaluation in "
    << (eval_in_fp8_ ? "fp8 (use_autocast_during_eval)" : "bf16");
  if (!device_.is_cuda()) o << "; CPU: exact fp8 emulation (slow, meant for tests)";
  o << "\n";
  o << "fp8: " << num_fp8_layers() << " of " << layers_.size()
    << " linear layers in fp8; everything else in bf16";
  int shown = 0, hidden = 0;
  for (const Fp8LayerChoice& c : layers_) {
    if (c.fp8) continue;
    if (shown == 8) {
      ++hidden;
      continue;
    }
    o << "\n  kept in bf16: " << c.name << " [out " << c.out_features << ", in " << c.in_features
      << "]: " << c.reason;
    ++shown;
  }
  if (hidden) o << "\n  ... and " << hidden << " more layers kept in bf16";
  if (recipe_.scaling == Fp8Scaling::MxBlock)
    o << "\nfp8: note: MXFP8 needs Blackwell (sm_100) GEMMs; on this hardware it is emulated "
         "(quantize-dequantize, then bf16 GEMMs): MX numerics, slower than bf16";
  return o.str();
}

void Fp8Training::step_end(ProcessGroup* group) {
  step_end([group](const Tensor& amaxes) {
    if (!group || group->size() <= 1) return;
    if (group->backend() == "cpu" && amaxes.device().is_cuda()) {
      Tensor host = amaxes.to(Device::cpu());
      group->all_reduce(host, ReduceOp::Max)->wait();
      amaxes.copy_(host);
    } else {
      group->all_reduce(amaxes, ReduceOp::Max)->wait_stream();
    }
  });
}

void Fp8Training::step_end(const std::function<void(const Tensor& amaxes)>& all_reduce_max) {
  if (!delayed_) return;
  if (delayed_->num_slots() > 0 && all_reduce_max) all_reduce_max(delayed_->current_amaxes());
  delayed_->update();
}

Fp8LinearContext* Fp8Training::layer_context(const std::string& name) {
  for (auto& [n, ctx] : contexts_)
    if (n == name) return ctx.get();
  return nullptr;
}

std::unique_ptr<Fp8Training> apply_fp8(Module& model, const Fp8Config& cfg, Device device) {
  return std::make_unique<Fp8Training>(model, cfg, device);
}

Fp8EvalScope::Fp8EvalScope(Fp8Training* fp8) : fp8_(fp8) {
  if (!fp8_) return;
  saved_ = fp8_->autocast();
  fp8_->autocast().enabled = fp8_->eval_in_fp8();
  fp8_->autocast().record_amax = false;
}

Fp8EvalScope::~Fp8EvalScope() {
  if (fp8_) fp8_->autocast() = saved_;
}

}  // namespace accel
