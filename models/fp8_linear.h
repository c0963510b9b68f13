// FP8 training of a model's Linear layers (mixed_precision: fp8): which layers run in fp8, the
// scaling state they share, the per-step amax all-reduce and scale update, and evaluation in bf16
// or fp8. Everything that is not a converted Linear (embedding, norms, attention) keeps running in
// the compute dtype (bf16). A tied LM head (CausalLM without an lm_head module, its logits from
// model.embed_tokens.weight) is one more layer here, named "lm_head" and converted under the same
// rules as an untied head: in fp8 under TE (and MXFP8), in high precision under AO (the last
// Linear of Hugging Face's model).
//
//   auto fp8 = apply_fp8(model, cfg.fp8, device);   // after building the model
//   ... forward, backward, optimizer step ...
//   fp8->step_end(process_group);                   // once per optimizer step
//   { Fp8EvalScope eval(fp8.get()); evaluate(); }   // bf16 unless use_autocast_during_eval
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "runtime/config.h"
#include "runtime/module.h"

namespace accel {

class ProcessGroup;

// The recipe an fp8_config (validated by the config loader) asks for.
Fp8Recipe fp8_recipe_from_config(const Fp8Config& cfg);

struct Fp8LayerChoice {
  std::string name;  // module name, "model.layers.0.self_attn.q_proj"; a tied head: "lm_head"
  int64_t in_features = 0, out_features = 0;
  bool fp8 = false;
  std::string reason;  // why it stays in high precision
  // A tied LM head: the module whose weight it multiplies by ("model.embed_tokens"); empty for a
  // Linear module.
  std::string tied_to;
  // The CausalLM's LM head, tied or not: forward_loss runs it fused with the cross-entropy
  // (CausalLM::head_loss_fn) where its recipe allows.
  bool lm_head = false;
  // A mixture-of-experts expert's projection ("model.layers.0.mlp.experts.3.gate_proj"): its
  // global expert index, else -1. Its block runs it (fp8_grouped_linear over every held expert),
  // never its Linear module; under expert parallelism another rank may hold it.
  int64_t expert = -1;
  // "lm_head (tied to model.embed_tokens)" for a tied head, else the name.
  std::string display_name() const;
};

// Which Linear layers of `model` (in module order) an fp8_config converts, a tied LM head of a
// CausalLM included (last, where Hugging Face's module list has lm_head):
// TE (and MXFP8): every Linear whose dimensions are both divisible by 16 (as Accelerate's
// TransformerEngine conversion), a tied LM head by the same rule (in Hugging Face's model it is
// the Linear lm_head, sharing the embedding's weight); AO: the same, except that pad_inner_dim
// admits any dimensions, and the first and the last Linear (Accelerate's default filter; Hugging
// Face's model lists lm_head last, tied or not, so the LM head stays in high precision) and layers
// whose name contains one of exclude_modules stay in high precision.
// A mixture-of-experts block lists every expert's projections (gate, up, down per expert, in
// expert order, where its experts' modules are), those of experts another expert-parallel rank
// holds included: every rank then has the same layers, delayed-scaling slots and saved state.
// A block's experts run one projection as one grouped op, so exclude_modules must keep all of
// them or none of them in high precision (std::invalid_argument naming the key otherwise).
std::vector<Fp8LayerChoice> choose_fp8_layers(Module& model, const Fp8Config& cfg);

class Fp8Training {
 public:
  // Installs fp8 linear functions in the chosen Linear layers of `model` (which must outlive the
  // layers' use; the layers keep the shared state alive), a tied LM head's in
  // CausalLM::tied_head_fn: the same fp8_linear with its own context (delayed scaling: its own
  // input, weight and grad_output slots), reading model.embed_tokens.weight; the LM head's (tied
  // or not) fused loss in CausalLM::head_loss_fn: fp8_linear_cross_entropy with the head's
  // context (over row chunks under TE and MXFP8, with the same numbers and scaling state as the
  // head's fp8_linear and then the loss); and the experts' in
  // SparseMoeBlock::experts_linear_fn: fp8_grouped_linear with one context per expert
  // projection (experts held by other expert-parallel ranks get slots but are never run here;
  // their amaxes come from their owners through step_end's all-reduce).
  Fp8Training(Module& model, const Fp8Config& cfg, Device device);

  const Fp8Recipe& recipe() const { return recipe_; }
  const std::vector<Fp8LayerChoice>& layers() const { return layers_; }
  int64_t num_fp8_layers() const;
  // A few lines for the start of a run: backend, effective recipe, evaluation mode, how many
  // layers run in fp8 and which stay in high precision (and why).
  std::string describe() const;

  // Once per optimizer step, after it. Delayed scaling: one MAX all-reduce of every current amax
  // over `group` (skipped when null or of size 1), then the scale update and history roll.
  // Nothing to do for dynamic and MX scaling.
  void step_end(ProcessGroup* group);
  // The same with a caller-supplied reduction: all_reduce_max(amaxes) must leave in `amaxes` (f32
  // [n], on the model's device) the elementwise max over the data-parallel ranks.
  void step_end(const std::function<void(const Tensor& amaxes)>& all_reduce_max);

  // Null unless the recipe is delayed scaling.
  const std::shared_ptr<Fp8DelayedScaling>& delayed() const { return delayed_; }
  Fp8Autocast& autocast() { return *autocast_; }
  bool eval_in_fp8() const { return eval_in_fp8_; }
  // The run-time context of one converted layer by module name (null if it is not fp8); e.g. to
  // install a weight_provider for FSDP's fp8 all-gather.
  Fp8LinearContext* layer_context(const std::string& name);

 private:
  Fp8Recipe recipe_;
  Fp8Config cfg_;
  Device device_;
  std::vector<Fp8LayerChoice> layers_;
  std::map<std::string, std::shared_ptr<Fp8LinearContext>> contexts_;  // by layer name
  std::shared_ptr<Fp8DelayedScaling> delayed_;
  std::shared_ptr<Fp8Autocast> autocast_;
  bool eval_in_fp8_ = false;
};

// Converts `model` per `cfg` (see Fp8Training).
std::unique_ptr<Fp8Training> apply_fp8(Module& model, const Fp8Config& cfg, Device device);

// For the duration of an evaluation: fp8 layers run in high precision, or in fp8 with
// use_autocast_during_eval, but never record amaxes. A null Fp8Training makes it a no-op.
class Fp8EvalScope {
 public:
  explicit Fp8EvalScope(Fp8Training* fp8);
  ~Fp8EvalScope();
  Fp8EvalScope(const Fp8EvalScope&) = delete;
  Fp8EvalScope& operator=(const Fp8EvalScope&) = delete;

 private:
  Fp8Training* fp8_;
  Fp8Autocast saved_;
};

// ---- checkpoints of the delayed-scaling state -------------------------------------------------
// The TE recipe's state is part of a training checkpoint (without it a resumed run restarts from
// scale 1 and an empty history, and its numbers change): per fp8 layer and tensor role (input,
// weight, grad_output) the amax history, scale and scale_inv, plus the update count that drives
// `interval`. Dynamic (AO) and MX scaling have no state: nothing is written or required.
//
// One safetensors file, kFp8StateFile in the checkpoint folder, written once (rank 0): the
// per-step amax all-reduce gives every data-parallel rank the same state. Tensors (f32, CPU):
//   <layer>.<role>.amax_history  [amax_history_len]  the slot's column of the [L, n] history
//   <layer>.<role>.scale         [1]
//   <layer>.<role>.scale_inv     [1]
// e.g. "model.layers.0.self_attn.q_proj.grad_output.scale"; a tied LM head's slots are
// "lm_head.<role>.*" as an untied head's. Metadata: format (accel-fp8-delayed-scaling),
// fp8_format, amax_history_len, amax_compute_algo, margin, interval, updates, tied_lm_head
// ("fp8" or "none": whether the state holds a tied head; written since tied heads run in fp8) and
// moe_experts ("fp8" or "none": whether it holds mixture-of-experts experts; written since they
// run in fp8).
//
// A state written before tied heads ran in fp8 (no tied_lm_head key) lacks the tied head's slots,
// one written before experts ran in fp8 (no moe_experts key) the experts'; it is restored for
// every saved layer, those layers' scaling starting afresh (scale 1, empty history, as at a run's
// first step), and the returned note says so.

inline constexpr char kFp8StateFile[] = "fp8_state.safetensors";

// True when `fp8` is non-null and uses delayed scaling (has state to checkpoint).
bool fp8_has_checkpoint_state(const Fp8Training* fp8);

struct Fp8CheckpointState {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;
};

// The state as above (CPU copies); empty without delayed scaling.
Fp8CheckpointState fp8_checkpoint_state(Fp8Training& fp8);
// Restores a saved state into `fp8`'s delayed scaling. `source` (the file) prefixes messages.
// Throws std::runtime_error saying what differs and what to do when the state does not fit this
// run: fp8 layers missing or extra, another amax_history_len or fp8_format, bad tensors. A changed
// amax_compute_algo, margin or interval is accepted (the next recompute uses the new setting) and
// reported in the returned note (empty when there is nothing to report).
std::string fp8_load_checkpoint_state(Fp8Training& fp8, const Fp8CheckpointState& state,
                                      const std::string& source);

// The same through a file at `path`.
void save_fp8_state(Fp8Training& fp8, const std::string& path);
std::string load_fp8_state(Fp8Training& fp8, const std::string& path);

// Every rank of `group` calls this: one MAX all-reduce of the state and its negation checks that
// all ranks hold the same state (the premise of saving it once). std::logic_error naming the
// first differing tensor otherwise. No-op without state, group, or with one rank.
void check_fp8_state_replicated(Fp8Training& fp8, ProcessGroup* group);

}  // namespace accel
