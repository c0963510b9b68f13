#include "tools/trainer/precision.h"

#include <cmath>
#include <filesystem>
#include <stdexcept>

#include "models/fp8_linear.h"
#include "parallel/fsdp.h"  // Fp8WeightGathering
#include "parallel/strategy.h"
#include "tools/trainer/checkpoint.h"

namespace accel {
namespace fs = std::filesystem;

namespace {
DType compute_dtype_of(MixedPrecision m) {
  switch (m) {
    case MixedPrecision::No:
      return DType::F32;
    case MixedPrecision::Fp16:
      return DType::F16;
    case MixedPrecision::Bf16:
    case MixedPrecision::Fp8:  // everything but the converted linear layers runs in bf16
      return DType::BF16;
  }
  throw std::logic_error("compute_dtype_of: unknown mixed_precision");
}
}  // namespace

Precision::Precision(const Config& cfg)
    : mode_(cfg.mixed_precision),
      fp8_config_(cfg.fp8),
      nan_policy_(cfg.training.nan_policy),
      loss_scale_window_(cfg.training.loss_scale_window),
      compute_dtype_(compute_dtype_of(cfg.mixed_precision)),
      loss_scale_(cfg.mixed_precision == MixedPrecision::Fp16 ? cfg.training.loss_scale_init
                                                              : 1.0) {}

Precision::~Precision() = default;

std::string Precision::name() const {
  return mode_ == MixedPrecision::No ? "fp32" : name_of(mode_);
}

std::string Precision::describe() const { return fp8_ ? fp8_->describe() : ""; }

void Precision::convert(Module& model, Device device) {
  if (mode_ == MixedPrecision::Fp8) fp8_ = apply_fp8(model, fp8_config_, device);
}

void Precision::attach(Strategy& strategy) {
  if (!fp8_ || !fp8_config_.enable_fsdp_float8_all_gather) return;
  // Only a strategy that gathers weights itself can use it (the config loader notes the others).
  auto* gathering = dynamic_cast<Fp8WeightGathering*>(&strategy);
  if (!gathering) return;
  // A tied LM head has no weight of its own to gather in fp8 (it reads the embedding's, gathered
  // in the compute dtype with the root unit); under AO, the only recipe with the fp8 all-gather,
  // it stays in high precision anyway. The experts' weights are gathered in the compute dtype:
  // fp8_grouped_linear casts them itself (and under expert parallelism they belong to the
  // expert engine, or to another rank).
  Fp8WeightGathering::Fp8Layers layers;
  for (const Fp8LayerChoice& c : fp8_->layers())
    if (c.fp8 && c.tied_to.empty() && c.expert < 0)
      layers.push_back({c.name, fp8_->layer_context(c.name)});
  gathering->gather_fp8_weights(layers);
}

void Precision::after_optimizer_step(ProcessGroup* group) {
  if (fp8_) fp8_->step_end(group);  // delayed scaling: amax all-reduce, new scales
}

std::string Precision::after_step(const StepResult& r, double loss, int64_t step) {
  const bool fp16 = mode_ == MixedPrecision::Fp16;
  if (fp16) {
    // Dynamic loss scaling: back off on overflow, grow after a window of clean steps.
    if (r.skipped) {
      loss_scale_ = std::max(1.0, loss_scale_ / 2);
      good_steps_ = 0;
    } else if (++good_steps_ % loss_scale_window_ == 0) {
      loss_scale_ *= 2;
    }
  }
  if (!r.skipped && std::isfinite(loss)) return "";
  ++skipped_steps_;
  if (fp16) return "";
  const std::string what =
      "non-finite " + std::string(std::isfinite(loss) ? "gradients" : "loss") + " at step " +
      std::to_string(step) + "; first non-finite gradient: " +
      (r.first_non_finite.empty()
           ? std::string("none (the gradients are finite; their norm overflowed)")
           : r.first_non_finite);
  if (nan_policy_ == NanPolicy::Stop)
    throw std::runtime_error(what + " (training.nan_policy: stop; use skip to skip such steps)");
  return "warning: " + what + "; step skipped";
}

nlohmann::json Precision::metrics() const {
  if (mode_ != MixedPrecision::Fp16) return nullptr;
  return {{"loss_scale", loss_scale_}};
}

Precision::EvalScope::EvalScope(Precision& p) {
  if (p.fp8_) fp8_ = std::make_unique<Fp8EvalScope>(p.fp8_.get());
}

Precision::EvalScope::~EvalScope() = default;

nlohmann::json Precision::save_state(const std::string& dir, int rank, ProcessGroup* group) {
  // The loss scaler whole: its scale and the clean steps towards its next growth.
  nlohmann::json entries = {{"loss_scaler", {{"scale", loss_scale_}, {"good_steps", good_steps_}}}};
  if (!fp8_has_checkpoint_state(fp8_.get())) return entries;
  check_fp8_state_replicated(*fp8_, group);  // every rank (one all-reduce)
  if (rank == 0) save_fp8_state(*fp8_, (fs::path(dir) / kFp8StateFile).string());
  entries["fp8_state_file"] = kFp8StateFile;
  return entries;
}

std::string Precision::restore_state(const LoadedCheckpoint& ck) {
  loss_scale_ = ck.state.loss_scale;
  const nlohmann::json scaler = ck.trainer_state.value("loss_scaler", nlohmann::json::object());
  good_steps_ = scaler.is_object() ? scaler.value("good_steps", int64_t{0}) : 0;
  const fs::path file = fs::path(ck.dir) / kFp8StateFile;
  if (ck.trainer_state.contains("fp8_state_file") && !fs::exists(file))
    throw std::runtime_error(ck.dir + ": trainer_state.json lists " + kFp8StateFile +
                             " but the file is missing; copy it back from where the checkpoint "
                             "came from, or resume from another checkpoint");
  const bool saved = fs::exists(file);
  if (!fp8_has_checkpoint_state(fp8_.get())) {
    if (!saved) return "";
    return file.string() + ": fp8 delayed-scaling state ignored: this run " +
           (fp8_ ? "uses " +
                       std::string(fp8_->recipe().scaling == Fp8Scaling::MxBlock
                                       ? "MXFP8 block scaling"
                                       : "dynamic scaling (backend AO)") +
                       ", which keeps no state"
                 : std::string("does not train in fp8"));
  }
  if (!saved)
    throw std::runtime_error(
        ck.dir + ": the checkpoint has no " + kFp8StateFile +
        ", but this run uses fp8 delayed scaling (fp8_config.backend TE), whose amax histories "
        "and scales a resumed run needs to continue with the same numbers. It was saved by a run "
        "without delayed scaling (or by an accel-train that did not save it). Resume with the "
        "configuration it was saved with, or start a new run with model.init_from pointing at "
        "this folder (weights only; the fp8 scaling then starts afresh)");
  return load_fp8_state(*fp8_, file.string());
}

}  // namespace accel
