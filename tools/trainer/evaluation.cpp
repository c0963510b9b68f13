#include "tools/trainer/evaluation.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tools/trainer/run.h"

namespace accel {

namespace {
std::string greedy_sample(LlamaForCausalLM& model, const Tokenizer& tok, const std::string& prompt,
                          int64_t n, Device device) {
  NoGradGuard no_grad;
  std::vector<uint32_t> ids;
  tok.encode(prompt, &ids);
  if (ids.empty()) ids.push_back(0);
  std::vector<uint32_t> generated;
  for (int64_t i = 0; i < n; ++i) {
    int64_t ctx =
        std::min<int64_t>(static_cast<int64_t>(ids.size()), model.config.max_position_embeddings);
    std::vector<int64_t> window(ids.end() - ctx, ids.end());
    Tensor in = Tensor::from_vector(window, {1, ctx}, DType::I64, device);
    Tensor logits = model.forward(in);
    std::vector<double> last = narrow(reshape(logits, {ctx, -1}), 0, ctx - 1, 1).to_vector();
    uint32_t best =
        static_cast<uint32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    ids.push_back(best);
    generated.push_back(best);
  }
  return tok.decode(generated);
}
}  // namespace

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
    Tensor logits = run.model->forward(b.input_ids.to(run.device));
    total += LlamaForCausalLM::loss(logits, b.labels.to(run.device)).item();
  }
  eval->restore(start);
  return run.dist.mean_across_ranks(n ? total / static_cast<double>(n) : NAN, run.device);
}

std::string final_sample(Run& run) {
  const TrainingConfig& t = run.cfg.training;
  if (t.sample_tokens <= 0 || !run.tokenizer) return "";
  if (!run.main_rank() && !run.strategy->forward_is_collective()) return "";
  Precision::EvalScope scope(*run.precision);
  return greedy_sample(*run.model, *run.tokenizer, t.sample_prompt, t.sample_tokens, run.device);
}

}  // namespace accel
