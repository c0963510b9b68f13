// Evaluation and sampling of a run's model, in precision's evaluation mode, without gradients.
#pragma once

#include <string>

namespace accel {

struct Run;

// The mean loss over training.eval_batches of the evaluation data, averaged over the ranks
// (every rank calls it); NaN without evaluation data. The evaluation source is rewound, so every
// evaluation sees the same batches.
double evaluate(Run& run);

// The greedy continuation of training.sample_prompt (training.sample_tokens tokens), or "" when
// no sample is asked for or there is no tokenizer. Rank 0 samples; with sharded parameters
// (every forward is a collective) all ranks sample together and get the same text.
std::string final_sample(Run& run);

}  // namespace accel
