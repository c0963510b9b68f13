// The algorithm, top-down: train() runs the steps; train_step() is one optimizer step over
// gradient_accumulation_steps micro-batches; forward_backward() is one micro-batch.
#include "tools/trainer/train.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "runtime/host_copies.h"
#include "tools/trainer/checkpointing.h"
#include "tools/trainer/evaluation.h"
#include "tools/trainer/run.h"
#include "tools/trainer/run_log.h"
#include "tools/trainer/stop_signals.h"

namespace accel {

namespace {

// Test hook (docs/fault_tolerance.md): ACCEL_TEST_INJECT_NAN_STEP=N makes step N's loss NaN
// (ACCEL_TEST_INJECT_NAN_WHERE=grad: only the gradients, the logged loss stays finite;
// ACCEL_TEST_INJECT_NAN_RANK=R: only on rank R).
struct NanInjection {
  int64_t step = -1;  // 1-based step whose last micro-batch is poisoned; -1: none
  bool grad_only = false;

  static NanInjection from_env(int rank) {
    NanInjection n;
    const char* step = std::getenv("ACCEL_TEST_INJECT_NAN_STEP");
    const char* where = std::getenv("ACCEL_TEST_INJECT_NAN_WHERE");
    const char* only_rank = std::getenv("ACCEL_TEST_INJECT_NAN_RANK");
    if (step && (!only_rank || std::atoi(only_rank) == rank)) n.step = std::atoll(step);
    n.grad_only = where && std::string(where) == "grad";
    return n;
  }
};

enum class Poison { None, Loss, Gradients };

// The micro-batches' losses, read on the host once the optimizer step is queued. On a GPU they
// are copied into page-locked memory behind the backward that made them (cuda::HostCopies) and
// read after the step's own reads (the gradient norm) have waited for that backward anyway:
// reading each loss at once kept the GPU idle while the host prepared the optimizer step after
// it (0.4 ms of a llama-1b step, 0.2 ms of a llama-125m step, by the timeline). On the CPU
// read() reads the tensors themselves.
class DeferredScalars {
 public:
  explicit DeferredScalars(Device device) : device_(device) {}
  ~DeferredScalars() {
    copies_.reset();  // waits for copies still in flight into pinned_
    if (pinned_) cuda::pinned_free(pinned_);
  }
  DeferredScalars(const DeferredScalars&) = delete;
  DeferredScalars& operator=(const DeferredScalars&) = delete;

  void add(const Tensor& one_element) { pending_.push_back(one_element.detach()); }
  // After the last add(): the copies start behind the work queued so far.
  void start_copies() {
    if (device_.is_cpu()) return;
    copies_.reset();
    if (capacity_ < pending_.size()) {
      if (pinned_) cuda::pinned_free(pinned_);
      capacity_ = std::max<size_t>(16, 2 * pending_.size());
      pinned_ = static_cast<char*>(cuda::pinned_alloc(capacity_ * kSlot));
    }
    copies_ = std::make_unique<cuda::HostCopies>(device_.index);
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (pending_[i].numel() != 1 || pending_[i].nbytes() > static_cast<int64_t>(kSlot))
        throw std::logic_error("DeferredScalars: one element of at most 8 bytes, got " +
                               pending_[i].str());
      copies_->add(pinned_ + i * kSlot, pending_[i].data_ptr(),
                   static_cast<size_t>(pending_[i].nbytes()));
    }
    copies_->close();
  }
  // The values in add() order (waits for the copies); the next step starts afresh.
  std::vector<double> read() {
    std::vector<double> values;
    if (!device_.is_cpu() && !pending_.empty() && !copies_)
      throw std::logic_error("DeferredScalars: read() without start_copies() after the last add()");
    if (copies_) {
      copies_->wait();
      copies_.reset();
    }
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (device_.is_cpu()) {
        values.push_back(pending_[i].item());
        continue;
      }
      Tensor host = Tensor::empty({}, pending_[i].dtype());
      std::memcpy(host.data_ptr(), pinned_ + i * kSlot, static_cast<size_t>(host.nbytes()));
      values.push_back(host.item());
    }
    pending_.clear();
    return values;
  }

 private:
  static constexpr size_t kSlot = 8;  // pinned bytes per value: f64 at most
  Device device_;
  std::vector<Tensor> pending_;
  std::unique_ptr<cuda::HostCopies> copies_;
  char* pinned_ = nullptr;
  size_t capacity_ = 0;  // values
};

// One micro-batch: forward, loss, backward of loss * scale. Returns the loss (unscaled; for a
// mixture of experts with output_router_logits it includes router_aux_loss_coef x aux). `aux`
// receives the router's load-balancing loss of the micro-batch (undefined for a dense model);
// its term in the loss is backpropagated with `aux_scale` instead of `scale`: it is a mean over
// micro-batches, not over trained tokens.
Tensor forward_backward(Run& run, const Batch& b, double scale, double aux_scale, Poison poison,
                        HostTimes& t, Tensor& aux) {
  Tensor loss, root;
  double seed = scale;  // root's gradient
  t.time(HostTimes::kForward, [&] {
    // The LM loss is backpropagated with `scale`: the fused head makes its gradients for it, and
    // takes them as made when the backward's seed is that number (backward_with_seed).
    loss = batch_loss(run, b, scale);
    aux = run.model->router_aux_loss();
    if (poison == Poison::Loss) loss = mul(loss, NAN);
    root = loss;
    const DecoderConfig& mc = run.model->config;
    if (aux.defined() && mc.output_router_logits && aux_scale != scale) {
      Tensor term = mul(cast(aux, loss.dtype()), mc.router_aux_loss_coef);
      root = add(mul(sub(loss, term), scale), mul(term, aux_scale));
      seed = 1.0;
    }
    if (poison == Poison::Gradients) root = mul(root, NAN);
  });
  t.time(HostTimes::kBackward, [&] { backward_with_seed(root, seed); });
  // The values only: the graph is freed here, while the GPU still runs the backward, and not
  // after the caller's loss read has drained it (about a millisecond of host time at 1B).
  if (aux.defined()) aux = aux.detach();
  return loss.detach();
}

struct StepOutput {
  double loss = 0;  // mean per trained token over micro-batches and ranks
  double lr = 0;
  StepResult result;
  StepTokens tokens;  // all ranks
  MoeStepStats moe;   // mixture of experts: the aux loss and the tokens per expert
};

// Optimizer step `step` (0-based): the micro-batches' gradients, then the update.
StepOutput train_step(Run& run, int64_t step, const LRSchedule& schedule,
                      const NanInjection& inject, HostTimes& t, DeferredScalars& scalars) {
  const int64_t accum = run.cfg.gradient_accumulation_steps;
  StepOutput out;
  out.lr = schedule.at(step);
  // The step's loss is the mean over every trained token of its micro-batches on all ranks, as
  // if they were one batch: micro-batch m (mean loss over its n_m trained tokens) is weighted
  // n_m * world / N, N counting the step's trained tokens on all ranks (the strategies average
  // gradients over ranks). Token streams train every position: n_m is the same everywhere and
  // the weight is 1 / accum without counting across ranks.
  std::vector<Batch> batches;
  double local_trained = 0, positions = 0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    batches.push_back(run.data.train->next());
    local_trained += static_cast<double>(batches.back().trained_tokens);
    positions += static_cast<double>(batches.back().input_ids.numel());
  }
  const double world = run.dist.world();
  const bool by_tokens = run.data.train->has_documents();
  double trained = local_trained * world;
  if (by_tokens) {
    const std::vector<double> all = run.dist.all_gather({local_trained, positions}, run.device);
    trained = positions = 0;
    for (size_t r = 0; r < all.size(); r += 2) trained += all[r], positions += all[r + 1];
  } else {
    positions *= world;
  }
  out.tokens = {static_cast<int64_t>(positions), static_cast<int64_t>(trained)};
  // Mixture of experts: the aux loss summed over this rank's micro-batches (its term joins the
  // loss as a mean over micro-batches and ranks, whatever their token counts), and the routed
  // slots per layer and expert.
  const bool moe = run.model->config.is_moe();
  const double aux_coef =
      run.model->config.output_router_logits ? run.model->config.router_aux_loss_coef : 0.0;
  std::vector<std::vector<double>> expert_slots;
  std::vector<double> trained_per_micro;
  std::vector<bool> has_aux;
  for (int64_t micro = 0; micro < accum; ++micro) {
    const bool last = micro == accum - 1;
    run.strategy->begin_micro_batch(last);
    const Batch& b = batches[static_cast<size_t>(micro)];
    const Poison poison = inject.step == step + 1 && last
                              ? (inject.grad_only ? Poison::Gradients : Poison::Loss)
                              : Poison::None;
    const double n = static_cast<double>(b.trained_tokens);
    const double ls = run.precision->loss_scale();
    const double scale = by_tokens ? ls * n * world / trained : ls / static_cast<double>(accum);
    Tensor aux;
    Tensor loss = forward_backward(run, b, scale, ls / static_cast<double>(accum), poison, t, aux);
    scalars.add(loss);  // read after the optimizer step is queued
    if (aux.defined()) scalars.add(aux);
    trained_per_micro.push_back(n);
    has_aux.push_back(aux.defined());
    if (moe) {
      const std::vector<std::vector<int64_t>> counts = run.model->expert_counts();
      expert_slots.resize(counts.size());
      for (size_t l = 0; l < counts.size(); ++l) {
        expert_slots[l].resize(counts[l].size(), 0.0);
        for (size_t e = 0; e < counts[l].size(); ++e)
          expert_slots[l][e] += static_cast<double>(counts[l][e]);
      }
    }
    run.strategy->end_micro_batch();
  }
  scalars.start_copies();
  t.time(HostTimes::kOptimizer, [&] {
    out.result =
        run.strategy->step(out.lr, run.cfg.optimizer.grad_clip, 1.0 / run.precision->loss_scale());
    run.precision->after_optimizer_step(run.dist.pg.get());
  });
  double loss_sum = 0;  // by_tokens: the sum over this rank's trained tokens
  double aux_sum = 0;
  const std::vector<double> values = scalars.read();
  for (size_t micro = 0, at = 0; micro < trained_per_micro.size(); ++micro) {
    const double loss_value = values.at(at++);
    const double aux_value = has_aux[micro] ? values.at(at++) : 0.0;
    aux_sum += aux_value;
    loss_sum +=
        by_tokens ? (loss_value - aux_coef * aux_value) * trained_per_micro[micro] : loss_value;
  }
  const double aux_mean =
      moe ? run.dist.mean_across_ranks(aux_sum / static_cast<double>(accum), run.device) : 0.0;
  out.loss =
      by_tokens
          ? run.dist.mean_across_ranks(loss_sum, run.device) * world / trained + aux_coef * aux_mean
          : run.dist.mean_across_ranks(loss_sum / static_cast<double>(accum), run.device);
  if (moe) {
    out.moe.aux_loss = aux_mean;
    // Every rank's counts, summed (one all-gather of the flattened table).
    std::vector<double> flat;
    for (const auto& row : expert_slots) flat.insert(flat.end(), row.begin(), row.end());
    const std::vector<double> all = run.dist.all_gather(flat, run.device);
    out.moe.expert_tokens = expert_slots;
    size_t at = 0;
    for (auto& row : out.moe.expert_tokens)
      for (double& v : row) {
        v = 0;
        for (size_t r = at; r < all.size(); r += flat.size()) v += all[r];
        ++at;
      }
  }
  return out;
}

std::string format_millions(int64_t n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1fM", static_cast<double>(n) / 1e6);
  return buf;
}

void print_run_line(const Run& run) {
  if (!run.main_rank()) return;
  const DecoderConfig& mc = run.model_config;
  std::fprintf(
      stderr,
      "model: %s %.1fM params%s, %lld layers, hidden %lld | device %s | precision %s | "
      "strategy %s x %d | data %s | %lld tokens/step | startup %.1fs\n",
      mc.model_type.c_str(), static_cast<double>(mc.num_parameters()) / 1e6,
      mc.is_moe() ? (" (" + format_millions(mc.num_active_parameters()) + " active)").c_str() : "",
      static_cast<long long>(mc.num_hidden_layers), static_cast<long long>(mc.hidden_size),
      run.device.str().c_str(), run.precision->mixed_precision(), run.strategy->name().c_str(),
      run.dist.world(), run.data.train->describe().c_str(),
      static_cast<long long>(run.tokens_per_step()),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - run.start_time).count());
  const std::string precision = run.precision->describe();
  if (!precision.empty()) std::fprintf(stderr, "%s\n", precision.c_str());
}

}  // namespace

int train(Run& run, const ResumeRequest& resume) {
  const TrainingConfig& tc = run.cfg.training;
  int64_t step = resume.spec.empty() ? 0 : resume_run(run, resume);
  if (step > 0 && step >= tc.max_steps) {
    // A finished run resumed: no step to log, so no loss (never the NaN of an empty mean).
    if (run.main_rank())
      std::fprintf(stderr,
                   "checkpoint step %lld is %s training.max_steps (%lld); nothing to train "
                   "(raise training.max_steps to continue)\n",
                   static_cast<long long>(step), step == tc.max_steps ? "already" : "past",
                   static_cast<long long>(tc.max_steps));
    run.dist.barrier();
    return 0;
  }
  print_run_line(run);
  const LRSchedule schedule{run.cfg.optimizer.lr_schedule, run.cfg.optimizer.lr,
                            run.cfg.optimizer.warmup_steps, tc.max_steps,
                            run.cfg.optimizer.min_lr_ratio};
  const NanInjection inject = NanInjection::from_env(run.dist.rank());
  note_completed_steps(step);
  install_stop_signal_handlers();
  // The checkpoints first: a snapshot block reserved at setup is not in step 1's time.
  RunCheckpoints checkpoints(run, step);
  RunLog log(run, step);
  DeferredScalars scalars(run.device);

  while (step < tc.max_steps) {
    const StepOutput out = train_step(run, step, schedule, inject, log.host_times(), scalars);
    ++step;
    note_completed_steps(step);
    const std::string warning = run.precision->after_step(out.result, out.loss, step);
    if (!warning.empty()) log.println(warning);
    std::optional<double> eval_loss;
    if (tc.eval_every > 0 && step % tc.eval_every == 0) eval_loss = evaluate(run);
    log.step(step, out.loss, out.lr, out.result, eval_loss, out.tokens,
             run.model->config.is_moe() ? &out.moe : nullptr);
    if (checkpoints.after_step(step, tc.max_steps, log)) return kExitPreempted;  // SIGTERM
  }
  log.end_of_steps();
  checkpoints.at_end(step, log);
  const double final_eval = tc.eval_every > 0 ? evaluate(run) : NAN;
  log.finish(step, final_eval, [&run] { return final_sample(run); });
  run.dist.barrier();
  return 0;
}

}  // namespace accel
