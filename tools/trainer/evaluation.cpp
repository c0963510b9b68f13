#include "tools/trainer/evaluation.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tools/trainer/generate.h"
#include "tools/trainer/run.h"

namespace accel {

double evaluate(Run& run) {
  BatchSource* eval = run.data.eval.get();
  if (!eval) return NAN;
  NoGradGuard no_grad;
  Precision::EvalScope scope(*run.precision);
  const DataPosition start = eval->position();
  double total = 0;
  const int64_t n = std::min(run.cfg.training.eval_batches, eval->batches_per_epoch());
  for (int64_t i = 0; i < n; ++i) {
    Batch b = eval->next();
    total += run.model->forward_loss(b.input_ids.to(run.device), b.labels.to(run.device)).item();
  }
  eval->restore(start);
  return run.dist.mean_across_ranks(n ? total / static_cast<double>(n) : NAN, run.device);
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
