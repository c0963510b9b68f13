#include "models/fp8_linear.h"

#include <array>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "models/decoder.h"
#include "parallel/process_group.h"
#include "runtime/safetensors.h"

namespace accel {

Fp8Recipe fp8_recipe_from_config(const Fp8Config& cfg) {
  // validate_config refuses MSAMP, E5M2 alone and MXFP8 with AO, naming the key.
  if (cfg.backend == Fp8Backend::MSAMP || cfg.fp8_format == Fp8Format::E5M2 ||
      (cfg.backend == Fp8Backend::AO && cfg.use_mxfp8_block_scaling))
    throw std::logic_error("fp8_recipe_from_config: an fp8_config that validate_config refuses");
  Fp8Recipe r;
  if (cfg.backend != Fp8Backend::AO && cfg.recipe_name != Fp8RecipeName::Tensorwise)
    throw std::logic_error("fp8_recipe_from_config: recipe_name without backend AO");
  if (cfg.backend == Fp8Backend::AO) {
    // torchao's Float8LinearConfig.from_recipe_name, and DeepSeek-V3's blockwise recipe.
    r.forward_dtype = DType::E4M3;
    switch (cfg.recipe_name) {
      case Fp8RecipeName::Tensorwise:  // e4m3 inputs and weights, e5m2 output gradients
        r.scaling = Fp8Scaling::Dynamic;
        r.backward_dtype = DType::E5M2;
        break;
      case Fp8RecipeName::Rowwise:  // axiswise e4m3 everywhere, round_scales_to_power_of_2
        r.scaling = Fp8Scaling::Rowwise;
        r.backward_dtype = DType::E4M3;
        r.pow2_scales = true;
        break;
      case Fp8RecipeName::RowwiseWithGwHp:
        // output: x, w axiswise; grad_input: dy axiswise e4m3 x w tensorwise; grad_weight in
        // high precision; torchao leaves round_scales_to_power_of_2 off here.
        r.scaling = Fp8Scaling::Rowwise;
        r.backward_dtype = DType::E4M3;
        r.dgrad_weight_tensorwise = true;
        r.hp_wgrad = true;
        break;
      case Fp8RecipeName::Blockwise:  // 1x128 activations/gradients, 128x128 weights, e4m3
        r.scaling = Fp8Scaling::Blockwise;
        r.backward_dtype = DType::E4M3;
        break;
    }
    return r;
  }
  r.scaling = cfg.use_mxfp8_block_scaling ? Fp8Scaling::MxBlock : Fp8Scaling::Delayed;
  r.forward_dtype = DType::E4M3;
  r.backward_dtype = cfg.fp8_format == Fp8Format::Hybrid ? DType::E5M2 : DType::E4M3;
  r.amax_history_len = cfg.amax_history_len;
  r.amax_algo =
      cfg.amax_compute_algo == AmaxComputeAlgo::Max ? AmaxAlgo::Max : AmaxAlgo::MostRecent;
  r.margin = static_cast<int>(cfg.margin);
  r.interval = cfg.interval;
  r.hp_fprop = cfg.override_linear_precision_fprop;
  r.hp_dgrad = cfg.override_linear_precision_dgrad;
  r.hp_wgrad = cfg.override_linear_precision_wgrad;
  return r;
}

std::string Fp8LayerChoice::display_name() const {
  return tied_to.empty() ? name : name + " (tied to " + tied_to + ")";
}

std::vector<Fp8LayerChoice> choose_fp8_layers(Module& model, const Fp8Config& cfg) {
  std::vector<Fp8LayerChoice> out;
  // The experts of a sparse block are listed by the block, all of them (also those another
  // expert-parallel rank holds), where its ModuleList "<block>.experts" comes in module order.
  std::map<std::string, const SparseMoeBlock*> expert_lists;
  for (auto& [name, m] : model.named_modules())
    if (auto* b = dynamic_cast<SparseMoeBlock*>(m)) expert_lists[name + ".experts"] = b;
  auto inside_experts = [&](const std::string& name) {
    for (const auto& [list, b] : expert_lists)
      if (name.compare(0, list.size() + 1, list + ".") == 0) return true;
    return false;
  };
  // Per expert choice: "<block>.experts.*.<projection>", the group that runs as one op.
  std::map<size_t, std::string> expert_group;
  for (auto& [name, m] : model.named_modules()) {
    if (auto it = expert_lists.find(name); it != expert_lists.end()) {
      const SparseMoeBlock& b = *it->second;
      const int64_t H = b.config.hidden_size, I = b.config.expert_intermediate_size();
      const auto projections = b.projection_names();
      for (int64_t e = 0; e < b.config.num_experts; ++e)
        for (int p = 0; p < 3; ++p) {
          Fp8LayerChoice c;
          c.name = name + "." + std::to_string(e) + "." + projections[p];
          c.out_features = p == 2 ? H : I;
          c.in_features = p == 2 ? I : H;
          c.fp8 = true;
          c.expert = e;
          expert_group[out.size()] = name + ".*." + projections[p];
          out.push_back(c);
        }
      continue;
    }
    auto* lin = dynamic_cast<Linear*>(m);
    if (!lin || inside_experts(name)) continue;
    Fp8LayerChoice c;
    c.name = name;
    if (auto* lm = dynamic_cast<CausalLM*>(&model)) c.lm_head = lin == lm->lm_head;
    c.out_features = lin->weight.value.size(0);
    c.in_features = lin->weight.value.size(1);
    c.fp8 = true;
    out.push_back(c);
  }
  // A tied LM head is no Linear module here, but it is one in Hugging Face's model (lm_head, its
  // weight tied to the embedding's), listed last: it is chosen under the same rules.
  if (auto* lm = dynamic_cast<CausalLM*>(&model); lm && !lm->lm_head) {
    Fp8LayerChoice c;
    c.name = "lm_head";
    c.tied_to = lm->model.embed_tokens.full_name();
    c.lm_head = true;
    c.out_features = lm->model.embed_tokens.weight.value.size(0);
    c.in_features = lm->model.embed_tokens.weight.value.size(1);
    c.fp8 = true;
    out.push_back(c);
  }
  const bool ao = cfg.backend == Fp8Backend::AO;
  for (Fp8LayerChoice& c : out) {
    if (!c.fp8) continue;
    bool aligned = c.in_features % 16 == 0 && c.out_features % 16 == 0;
    if (!aligned && !(ao && cfg.pad_inner_dim)) {
      c.fp8 = false;
      c.reason = std::string("a dimension is not divisible by 16") +
                 (ao ? " (set fp8_config.pad_inner_dim to pad it)" : "");
    }
  }
  if (ao && !out.empty()) {
    // The last is the LM head, tied or not (Hugging Face's lm_head is its last Linear either way).
    out.front().fp8 = false;
    out.front().reason = "first linear layer (AO keeps the first and last in high precision)";
    out.back().fp8 = false;
    out.back().reason = "last linear layer (AO keeps the first and last in high precision)";
    for (Fp8LayerChoice& c : out)
      for (const std::string& pat : cfg.exclude_modules)
        if (!pat.empty() && c.name.find(pat) != std::string::npos && c.fp8) {
          c.fp8 = false;
          c.reason = "matches fp8_config.exclude_modules pattern '" + pat + "'";
        }
  }
  // One projection of a block's experts is one grouped op: in fp8 for all experts or for none.
  std::map<std::string, std::pair<int64_t, int64_t>> fp8_of_group;  // (in fp8, experts)
  for (const auto& [i, group] : expert_group) {
    fp8_of_group[group].first += out[i].fp8 ? 1 : 0;
    ++fp8_of_group[group].second;
  }
  for (const auto& [i, group] : expert_group)  // the first such group in module order
    if (const auto count = fp8_of_group[group]; count.first != 0 && count.first != count.second)
      throw std::invalid_argument(
          "fp8_config.exclude_modules keeps " + std::to_string(count.second - count.first) +
          " of the " + std::to_string(count.second) + " experts' " + group +
          " in high precision: a block's experts run each projection as one grouped GEMM, so "
          "exclude all of them (e.g. 'experts') or none");
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
  auto* lm = dynamic_cast<CausalLM*>(&model);
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
    contexts_[c.name] = ctx;
    if (c.expert >= 0) continue;  // run by its block (below)
    auto fn = [ctx](const Tensor& x, const Tensor& w) { return fp8_linear(x, w, Tensor(), *ctx); };
    if (c.lm_head) {
      // forward_loss runs the head's GEMMs inside the chunked loss (or, for a recipe that cannot
      // be chunked, its fp8_linear and then the loss: fp8_linear_cross_entropy decides).
      if (!lm || lm->head_loss_fn)
        throw std::logic_error("[fp8] " + c.display_name() + " without a CausalLM to fuse it in");
      lm->head_loss_fn = [ctx](const Tensor& x, const Tensor& w, const Tensor& targets,
                               double grad_scale) {
        return fp8_linear_cross_entropy(x, w, targets, *ctx, -100, 0, grad_scale);
      };
    }
    if (!c.tied_to.empty()) {
      // The tied head: the same op on the embedding weight, whose gradient autograd adds to the
      // embedding's own.
      if (!lm || lm->lm_head)
        throw std::logic_error("[fp8] " + c.display_name() + " without a tied CausalLM head");
      if (lm->tied_head_fn)
        throw std::logic_error("[fp8] " + c.display_name() + " already has a head function");
      lm->tied_head_fn = fn;
    } else {
      Linear* lin = linears.at(c.name);
      if (lin->linear_fn)
        throw std::logic_error("[fp8] linear layer " + c.name + " already has a linear function");
      lin->linear_fn = fn;
    }
  }
  // A sparse block's held experts run each projection as one fp8_grouped_linear, one context per
  // expert (choose_fp8_layers makes a projection fp8 for all experts or for none).
  std::set<const GatedMLP*> experts;
  for (auto& [name, m] : model.named_modules()) {
    auto* block = dynamic_cast<SparseMoeBlock*>(m);
    if (!block) continue;
    experts.insert(block->experts.begin(), block->experts.end());
    std::array<std::vector<std::shared_ptr<const Fp8LinearContext>>, 3> ctxs;
    const auto projections = block->projection_names();
    for (int p = 0; p < 3; ++p)
      for (size_t j = 0; j < block->experts.size(); ++j) {
        const std::string layer = name + ".experts." +
                                  std::to_string(block->expert_begin() + static_cast<int64_t>(j)) +
                                  "." + projections[p];
        if (auto it = contexts_.find(layer); it != contexts_.end()) ctxs[p].push_back(it->second);
      }
    if (ctxs[0].empty() && ctxs[1].empty() && ctxs[2].empty()) continue;
    if (block->experts_linear_fn)
      throw std::logic_error("[fp8] sparse block " + name + " already has an experts function");
    block->experts_linear_fn = [ctxs](const Tensor& x, const std::vector<Tensor>& weights,
                                      const std::vector<int64_t>& rows, int projection) {
      const auto& c = ctxs.at(static_cast<size_t>(projection));
      if (c.empty()) return grouped_linear(x, weights, rows);
      std::vector<const Fp8LinearContext*> raw;
      for (const auto& ctx : c) raw.push_back(ctx.get());
      return fp8_grouped_linear(x, weights, rows, raw);
    };
  }
  // The projections that read one tensor (q/k/v, gate/up) cast it once (Fp8SharedInputCast).
  auto one_cast = [](const Tensor& x, const std::function<void()>& run) {
    Fp8SharedInputCast shared(x);
    run();
  };
  for (auto& [name, m] : model.named_modules()) {
    if (auto* attn = dynamic_cast<SelfAttention*>(m)) attn->shared_input = one_cast;
    if (auto* mlp = dynamic_cast<GatedMLP*>(m); mlp && !experts.count(mlp))
      mlp->shared_input = one_cast;
  }
  // Llama MLPs whose three projections all run in fp8 take the fused form (fp8_swiglu_mlp), which
  // declines by itself where it does not apply. (Experts are run by their blocks.)
  for (auto& [name, m] : model.named_modules()) {
    auto* mlp = dynamic_cast<GatedMLP*>(m);
    if (!mlp || experts.count(mlp)) continue;
    std::shared_ptr<Fp8LinearContext> ctx[3];
    const char* parts[3] = {".gate_proj", ".up_proj", ".down_proj"};
    for (int i = 0; i < 3; ++i)
      if (auto it = contexts_.find(name + parts[i]); it != contexts_.end()) ctx[i] = it->second;
    if (!ctx[0] || !ctx[1] || !ctx[2]) continue;
    mlp->fused_fn = [mlp, g = ctx[0], u = ctx[1], d = ctx[2]](const Tensor& x,
                                                              const Tensor& residual) {
      if (mlp->gate_proj.has_forward_hooks() || mlp->up_proj.has_forward_hooks() ||
          mlp->down_proj.has_forward_hooks())
        return Tensor();
      return fp8_swiglu_mlp(x, mlp->gate_proj.weight.value, mlp->up_proj.weight.value,
                            mlp->down_proj.weight.value, *g, *u, *d, residual);
    };
  }
}

int64_t Fp8Training::num_fp8_layers() const { return static_cast<int64_t>(contexts_.size()); }

std::string Fp8Training::describe() const {
  std::ostringstream o;
  o << "fp8: backend " << name_of(cfg_.backend) << ": " << recipe_.str() << "; evaluation in "
    << (eval_in_fp8_ ? "fp8 (use_autocast_during_eval)" : "bf16");
  if (!device_.is_cuda()) o << "; CPU: exact fp8 emulation (slow, meant for tests)";
  o << "\n";
  o << "fp8: " << num_fp8_layers() << " of " << layers_.size()
    << " linear layers in fp8; everything else in bf16";
  int shown = 0, hidden = 0;
  for (const Fp8LayerChoice& c : layers_) {
    if (c.fp8) continue;
    if (shown == 8 && c.tied_to.empty()) {
      ++hidden;
      continue;
    }
    o << "\n  kept in bf16: " << c.display_name() << " [out " << c.out_features << ", in "
      << c.in_features << "]: " << c.reason;
    ++shown;
  }
  for (const Fp8LayerChoice& c : layers_) {
    if (!c.fp8 || !c.lm_head) continue;
    o << "\n  in fp8: " << c.display_name() << " [out " << c.out_features << ", in "
      << c.in_features << "]: ";
    if (!c.tied_to.empty())
      o << "the embedding weight cast for the head's GEMMs, its gradient added to the "
           "embedding's; ";
    const std::string unfused = fp8_linear_cross_entropy_unfused_reason(recipe_);
    if (unfused.empty())
      o << "fused with the loss: its GEMMs run inside the chunked cross-entropy, so the [tokens, "
           "vocab] logits and their gradient never exist in full";
    else
      o << "its [tokens, vocab] logits and their gradient in full, then the cross-entropy "
           "(not fused with the loss: "
        << unfused << ")";
  }
  int64_t expert_layers = 0;
  for (const Fp8LayerChoice& c : layers_) expert_layers += c.fp8 && c.expert >= 0 ? 1 : 0;
  if (expert_layers)
    o << "\n  in fp8: " << expert_layers << " mixture-of-experts expert projections (among the "
      << num_fp8_layers() << "), each with its own scales: one fp8 GEMM per expert that has "
      << "tokens (cuBLASLt has no grouped fp8 GEMM)";
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
  auto it = contexts_.find(name);
  return it == contexts_.end() ? nullptr : it->second.get();
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

// ---- checkpoints of the delayed-scaling state -------------------------------------------------

namespace {

const char* const kFp8StateFormat = "accel-fp8-delayed-scaling";
const char* const kRoles[3] = {"input", "weight", "grad_output"};

// fp8_config.fp8_format of a delayed recipe (E5M2 is refused at start, so two choices remain).
std::string fp8_format_name(const Fp8Recipe& r) {
  return r.backward_dtype == DType::E5M2 ? "HYBRID" : "E4M3";
}
std::string algo_name(AmaxAlgo a) { return a == AmaxAlgo::Max ? "max" : "most_recent"; }

// (slot, "<layer>.<role>") of every slot, in layer order.
std::vector<std::pair<int, std::string>> fp8_state_slots(Fp8Training& fp8) {
  std::vector<std::pair<int, std::string>> out;
  for (const Fp8LayerChoice& c : fp8.layers()) {
    if (!c.fp8) continue;
    const Fp8LinearContext* ctx = fp8.layer_context(c.name);
    const int slots[3] = {ctx->slot_input, ctx->slot_weight, ctx->slot_grad_output};
    for (int r = 0; r < 3; ++r) out.push_back({slots[r], c.name + "." + kRoles[r]});
  }
  return out;
}

std::vector<float> host_floats(const Tensor& t) {
  std::vector<double> v = t.to_vector();
  return std::vector<float>(v.begin(), v.end());
}

// The tied LM head among the fp8 layers, or null.
const Fp8LayerChoice* tied_fp8_head(const Fp8Training& fp8) {
  for (const Fp8LayerChoice& c : fp8.layers())
    if (c.fp8 && !c.tied_to.empty()) return &c;
  return nullptr;
}

bool has_fp8_experts(const Fp8Training& fp8) {
  for (const Fp8LayerChoice& c : fp8.layers())
    if (c.fp8 && c.expert >= 0) return true;
  return false;
}

std::string some_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 4; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 4) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

}  // namespace

bool fp8_has_checkpoint_state(const Fp8Training* fp8) { return fp8 && fp8->delayed() != nullptr; }

Fp8CheckpointState fp8_checkpoint_state(Fp8Training& fp8) {
  Fp8CheckpointState st;
  if (!fp8_has_checkpoint_state(&fp8)) return st;
  Fp8DelayedScaling& d = *fp8.delayed();
  const Fp8Recipe& r = d.recipe();
  const int64_t L = r.amax_history_len, n = d.num_slots();
  const std::vector<float> hist = host_floats(d.amax_history()), sc = host_floats(d.scales()),
                           si = host_floats(d.scale_invs());
  for (const auto& [slot, name] : fp8_state_slots(fp8)) {
    std::vector<float> col(static_cast<size_t>(L));
    for (int64_t i = 0; i < L; ++i) col[i] = hist[i * n + slot];
    st.tensors.push_back({name + ".amax_history", Tensor::from_vector(col, {L})});
    st.tensors.push_back({name + ".scale", Tensor::from_vector(std::vector<float>{sc[slot]}, {1})});
    st.tensors.push_back(
        {name + ".scale_inv", Tensor::from_vector(std::vector<float>{si[slot]}, {1})});
  }
  st.metadata = {{"format", kFp8StateFormat},
                 {"fp8_format", fp8_format_name(r)},
                 {"amax_history_len", std::to_string(L)},
                 {"amax_compute_algo", algo_name(r.amax_algo)},
                 {"margin", std::to_string(r.margin)},
                 {"interval", std::to_string(r.interval)},
                 {"updates", std::to_string(d.updates())},
                 {"tied_lm_head", tied_fp8_head(fp8) ? "fp8" : "none"},
                 {"moe_experts", has_fp8_experts(fp8) ? "fp8" : "none"}};
  return st;
}

std::string fp8_load_checkpoint_state(Fp8Training& fp8, const Fp8CheckpointState& state,
                                      const std::string& source) {
  if (!fp8_has_checkpoint_state(&fp8))
    throw std::logic_error("[fp8] loading delayed-scaling state into a run without it");
  const std::string redo =
      "; resume with the fp8_config and model the checkpoint was saved with, or start a new run "
      "with model.init_from pointing at the checkpoint folder (weights only; the fp8 scaling "
      "then starts afresh)";
  auto fail = [&](const std::string& what) {
    throw std::runtime_error(source + ": fp8 delayed-scaling state: " + what);
  };
  auto meta = [&](const char* key) -> std::string {
    auto it = state.metadata.find(key);
    if (it == state.metadata.end()) fail(std::string("metadata lacks '") + key + "'");
    return it->second;
  };
  auto meta_int = [&](const char* key) -> int64_t {
    std::string v = meta(key);
    try {
      size_t used = 0;
      int64_t x = std::stoll(v, &used);
      if (used == v.size() && x >= 0) return x;
    } catch (const std::exception&) {
    }
    fail(std::string("metadata '") + key + "' is '" + v + "', not a non-negative integer");
    return 0;
  };
  if (meta("format") != kFp8StateFormat)
    fail("format '" + meta("format") + "' is not " + kFp8StateFormat);

  Fp8DelayedScaling& d = *fp8.delayed();
  const Fp8Recipe& r = d.recipe();
  const std::string format = meta("fp8_format");
  if (format != fp8_format_name(r))
    fail("saved with fp8_config.fp8_format " + format + ", this run uses " + fp8_format_name(r) +
         " (the saved grad_output scales belong to the other format)" + redo);
  const int64_t L = r.amax_history_len, saved_len = meta_int("amax_history_len");
  if (saved_len != L)
    fail("fp8_config.amax_history_len changed: the checkpoint holds " + std::to_string(saved_len) +
         " steps of amax history per tensor, this run's amax_history_len is " + std::to_string(L) +
         "; resume with amax_history_len: " + std::to_string(saved_len) +
         ", or start a new run with model.init_from pointing at the checkpoint folder to change "
         "it");
  const int64_t updates = meta_int("updates");

  // Layers: every fp8 layer of this run must be in the file and nothing else.
  const auto slots = fp8_state_slots(fp8);
  std::map<std::string, Tensor> saved(state.tensors.begin(), state.tensors.end());
  std::vector<std::string> missing, extra;
  std::set<std::string> extra_layers;
  std::map<std::string, bool> expected_layers;
  for (const Fp8LayerChoice& c : fp8.layers())
    if (c.fp8) expected_layers[c.name] = true;
  for (const auto& [name, t] : saved) {
    (void)t;
    std::string layer;
    for (const char* role : kRoles) {
      for (const char* field : {".amax_history", ".scale", ".scale_inv"}) {
        const std::string suffix = std::string(".") + role + field;
        if (name.size() > suffix.size() &&
            name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
          layer = name.substr(0, name.size() - suffix.size());
      }
    }
    if (layer.empty()) fail("unexpected tensor '" + name + "'");
    if (!expected_layers.count(layer)) extra_layers.insert(layer);
  }
  extra.assign(extra_layers.begin(), extra_layers.end());
  for (const auto& [layer, unused] : expected_layers) {
    (void)unused;
    bool any = false;
    for (const char* role : kRoles) any = any || saved.count(layer + "." + role + ".scale");
    if (!any) missing.push_back(layer);
  }
  // A state written before tied LM heads (no tied_lm_head key) or mixture-of-experts experts (no
  // moe_experts key) ran in fp8 has every layer but those: each saved layer keeps its own slots,
  // those start afresh. Anything else missing refuses the whole state.
  const Fp8LayerChoice* tied = tied_fp8_head(fp8);
  std::set<std::string> experts, fresh;
  for (const Fp8LayerChoice& c : fp8.layers())
    if (c.fp8 && c.expert >= 0) experts.insert(c.name);
  std::string fresh_head;
  int64_t fresh_experts = 0;
  if (extra.empty() && !missing.empty()) {
    const bool head_was_bf16 = tied && !state.metadata.count("tied_lm_head");
    const bool experts_were_bf16 = !state.metadata.count("moe_experts");
    for (const std::string& layer : missing)
      if ((head_was_bf16 && layer == tied->name) || (experts_were_bf16 && experts.count(layer)))
        fresh.insert(layer);
    if (fresh.size() == missing.size()) {
      missing.clear();
      fresh_head = tied && fresh.count(tied->name) ? tied->display_name() : "";
      fresh_experts = static_cast<int64_t>(fresh.size()) - (fresh_head.empty() ? 0 : 1);
    } else {
      fresh.clear();
    }
  }
  if (!missing.empty() || !extra.empty()) {
    std::string what = "it does not match this run's fp8 layers:";
    if (!missing.empty())
      what += " " + std::to_string(missing.size()) +
              " fp8 layer(s) of this run have no saved state (" + some_names(missing) + ")";
    if (!extra.empty())
      what += std::string(missing.empty() ? "" : ";") + " " + std::to_string(extra.size()) +
              " saved layer(s) are not fp8 layers of this run (" + some_names(extra) + ")";
    const std::string why =
        ". The model, or which of its layers run in fp8, differs from the run that saved it";
    fail(what + why + redo);
  }

  const int64_t n = d.num_slots();
  std::vector<float> hist(static_cast<size_t>(L * n), 0.0f), sc(n, 1.0f), si(n, 1.0f);
  auto take = [&](const std::string& name, int64_t numel) -> std::vector<float> {
    auto it = saved.find(name);
    if (it == saved.end()) fail("tensor '" + name + "' is missing");
    const Tensor& t = it->second;
    if (t.dtype() != DType::F32 || t.shape() != Shape{numel})
      fail("tensor '" + name + "' is " + t.str() + ", expected f32 [" + std::to_string(numel) +
           "]");
    return host_floats(t);
  };
  for (const auto& [slot, name] : slots) {
    if (fresh.count(name.substr(0, name.rfind('.')))) continue;  // scale 1, an empty history
    std::vector<float> col = take(name + ".amax_history", L);
    for (int64_t i = 0; i < L; ++i) hist[i * n + slot] = col[i];
    sc[slot] = take(name + ".scale", 1)[0];
    si[slot] = take(name + ".scale_inv", 1)[0];
  }
  d.load_state({{"fp8.amax_history", Tensor::from_vector(hist, {L, n})},
                {"fp8.scale", Tensor::from_vector(sc, {n})},
                {"fp8.scale_inv", Tensor::from_vector(si, {n})},
                {"fp8.updates", Tensor::from_vector(std::vector<int64_t>{updates}, {1})}});

  std::string note;
  auto changed = [&](const char* key, const std::string& now) {
    const std::string was = meta(key);
    if (was != now)
      note += std::string(note.empty() ? "" : "; ") + "fp8_config." + key + " changed from " + was +
              " to " + now;
  };
  changed("amax_compute_algo", algo_name(r.amax_algo));
  changed("margin", std::to_string(r.margin));
  changed("interval", std::to_string(r.interval));
  if (!note.empty())
    note = source + ": fp8 state restored; " + note +
           " (the saved scales stay until the next recompute, which uses the new settings)";
  if (!fresh_head.empty())
    note += std::string(note.empty() ? source + ": fp8 state restored" : "") + "; " + fresh_head +
            " has no saved state: the checkpoint was written when a tied LM head ran in bf16 "
            "(before tied heads ran in fp8 under TE), so from here on the head runs in fp8 and "
            "its scaling starts afresh (scale 1, empty amax history, as at a run's first step); "
            "every other layer continues with its saved state";
  if (fresh_experts)
    note += std::string(note.empty() ? source + ": fp8 state restored" : "") + "; " +
            std::to_string(fresh_experts) +
            " mixture-of-experts expert projections have no saved state: the checkpoint was "
            "written when the experts ran in bf16 (before they ran in fp8), so from here on they "
            "run in fp8 and their scaling starts afresh (scale 1, empty amax history, as at a "
            "run's first step); every other layer continues with its saved state";
  return note;
}

void save_fp8_state(Fp8Training& fp8, const std::string& path) {
  Fp8CheckpointState st = fp8_checkpoint_state(fp8);
  if (st.tensors.empty() && st.metadata.empty())
    throw std::logic_error("[fp8] save_fp8_state without delayed-scaling state");
  save_safetensors(path, st.tensors, st.metadata);
}

std::string load_fp8_state(Fp8Training& fp8, const std::string& path) {
  SafetensorsReader file(path);
  Fp8CheckpointState st;
  st.metadata = file.metadata();
  for (const std::string& n : file.names()) {
    const SafetensorsTensorInfo& info = file.info(n);
    if (!info.supported)
      throw std::runtime_error(path + ": fp8 delayed-scaling state: tensor '" + n + "' has dtype " +
                               info.dtype_name + ", expected F32");
    st.tensors.push_back({n, file.load(n, MemCategory::Other)});
  }
  return fp8_load_checkpoint_state(fp8, st, path);
}

void check_fp8_state_replicated(Fp8Training& fp8, ProcessGroup* group) {
  if (!fp8_has_checkpoint_state(&fp8) || !group || group->size() <= 1) return;
  Fp8DelayedScaling& d = *fp8.delayed();
  const int64_t L = d.recipe().amax_history_len, n = d.num_slots();
  // [history (L x n), scale (n), scale_inv (n), updates] and its negation: after a MAX
  // all-reduce the second half holds minus the minimum, so every rank sees the same verdict.
  std::vector<float> v = host_floats(d.amax_history());
  for (const Tensor& t : {d.scales(), d.scale_invs()}) {
    std::vector<float> x = host_floats(t);
    v.insert(v.end(), x.begin(), x.end());
  }
  v.push_back(static_cast<float>(d.updates()));
  const size_t m = v.size();
  for (size_t i = 0; i < m; ++i) v.push_back(-v[i]);
  Tensor t = Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
  if (group->backend() == "cpu" || !d.device().is_cuda()) {
    group->all_reduce(t, ReduceOp::Max)->wait();
  } else {
    Tensor dev = t.to(d.device());
    group->all_reduce(dev, ReduceOp::Max)->wait_stream();
    t = dev.to(Device::cpu());
  }
  std::vector<float> r = host_floats(t);
  for (size_t i = 0; i < m; ++i) {
    const float hi = r[i], lo = -r[m + i];
    if (hi == lo || (std::isnan(hi) && std::isnan(lo))) continue;
    const int64_t idx = static_cast<int64_t>(i);
    std::string what = "updates";
    int64_t slot = -1;
    if (idx < L * n) {
      slot = idx % n;
      what = "amax_history[" + std::to_string(idx / n) + "]";
    } else if (idx < L * n + n) {
      slot = idx - L * n;
      what = "scale";
    } else if (idx < L * n + 2 * n) {
      slot = idx - L * n - n;
      what = "scale_inv";
    }
    std::string name = "slot " + std::to_string(slot);
    for (const auto& [s, nm] : fp8_state_slots(fp8))
      if (s == slot) name = nm;
    throw std::logic_error("[fp8] the delayed-scaling state differs across data-parallel ranks (" +
                           (slot >= 0 ? name + "." : std::string()) + what + ": max " +
                           std::to_string(hi) + ", min " + std::to_string(lo) +
                           "); every rank must call Fp8Training::step_end after each step");
  }
}

}  // namespace accel
