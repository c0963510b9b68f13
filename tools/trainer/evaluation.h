// Evaluation and sampling of a run's model, in precision's evaluation mode, without gradients.
#pragma once

#include <string>

namespace accel {

struct Run;
struct Batch;
class Tensor;

// The model's mean loss over the trained tokens of a batch, on the run's device, with the
// batch's layout (packed documents: position and segment ids) when it has one. grad_scale: the
// factor training backpropagates it with (CausalLM::forward_loss).
Tensor batch_loss(Run& run, const Batch& b, double grad_scale = 1.0);

// The mean loss per trained token over training.eval_batches of the evaluation data on all ranks
// (every rank calls it); NaN without evaluation data. The evaluation source is rewound, so every
// evaluation sees the same batches.
double evaluate(Run& run);

// The greedy continuation of training.sample_prompt (training.sample_tokens tokens), or "" when
// no sample is asked for or there is no tokenizer. Rank 0 samples; with sharded parameters
// (every forward is a collective) all ranks sample together and get the same text.
std::string final_sample(Run& run);

}  // namespace accel
