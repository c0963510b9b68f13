#include "tools/trainer/evaluation.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tools/trainer/generate.h"
#include "tools/trainer/run.h"

namespace accel {

Tensor batch_loss(Run& run, const Batch& b, double grad_scale) {
  TokenLayout layout;
  if (b.position_ids.defined()) layout.position_ids = b.position_ids.to(run.device);
  if (b.segment_ids.defined()) layout.segment_ids = b.segment_ids.to(run.device);
  return run.model->forward_loss(b.input_ids.to(run.device), b.labels.to(run.device), layout,
                                 grad_scale);
}

double evaluate(Run& run) {
  BatchSource* eval = run.data.eval.get();
  if (!eval) return NAN;
  NoGradGuard no_grad;
  Precision::EvalScope scope(*run.precision);
  const DataPosition start = eval->position();
  double loss_sum = 0, trained = 0;  // the loss summed over trained tokens, and their count
  const int64_t n = std::min(run.cfg.training.eval_batches, eval->batches_per_epoch());
  for (int64_t i = 0; i < n; ++i) {
    Batch b = eval->next();
    const double tokens = static_cast<double>(b.trained_tokens);
    loss_sum += batch_loss(run, b).item() * tokens;
    trained += tokens;
  }
  eval->restore(start);
  if (n == 0) return NAN;
  const std::vector<double> all = run.dist.all_gather({loss_sum, trained}, run.device);
  double total_loss = 0, total_trained = 0;
  for (size_t r = 0; r < all.size(); r += 2) total_loss += all[r], total_trained += all[r + 1];
  return total_loss / total_trained;
}

std::string final_sample(Run& run) {
  const TrainingConfig& t = run.cfg.training;
  if (t.sample_tokens <= 0 || !run.tokenizer) return "";
  if (!run.main_rank() && !run.strategy->forward_is_collective()) return "";
  Precision::EvalScope scope(*run.precision);
  std::vector<uint32_t> prompt = run.tokenizer->encode(t.sample_prompt);
  if (prompt.empty()) prompt.push_back(0);
  SamplingOptions greedy;  // what accel-generate --temperature 0 gives
  greedy.temperature = 0;
  greedy.max_new_tokens = t.sample_tokens;
  return run.tokenizer->decode(generate(*run.model, prompt, greedy, run.device));
}

}  // namespace accel
