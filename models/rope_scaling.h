// The inverse frequencies of Hugging Face's RoPE scalings (transformers' modeling_rope_utils):
// default, linear, dynamic (NTK), llama3 and yarn, computed in float32 with Hugging Face's order
// of operations.
#pragma once

#include <cstdint>

#include "ops/ops.h"
#include "runtime/rope_scaling.h"

namespace accel {

// The frequencies of RoPE over head_dim with base theta, for a forward whose positions are below
// seq_len (only dynamic depends on it: past max_position_embeddings it raises the base, as
// transformers' dynamic_rope_update does for the sequence at hand).
RopeFrequencies rope_frequencies(const RopeScaling& s, double theta, int64_t head_dim,
                                 int64_t max_position_embeddings, int64_t seq_len);

// The frequencies a model instance with rope_type dynamic uses from one forward to the next, as
// transformers' dynamic_rope_update keeps them (the rotary embedding's max_seq_len_cached and
// inv_freq): a forward whose length L (largest position + 1) is above the longest seen so far
// recomputes them for L; a forward shorter than max_position_embeddings after a longer one goes
// back to the original frequencies; any other forward keeps the frequencies it finds, those of
// the longest sequence since the last reset (so a forward of length L may use the frequencies of
// a longer one). Applying the same L twice changes nothing (activation checkpointing recomputes
// a layer with the frequencies of its forward).
class DynamicRope {
 public:
  DynamicRope(const RopeScaling& s, double theta, int64_t head_dim,
              int64_t max_position_embeddings);
  // The frequencies for a forward of length seq_len, after updating the state as above.
  const RopeFrequencies& update(int64_t seq_len);
  const RopeFrequencies& current() const { return current_; }
  // transformers' max_seq_len_cached: max_position_embeddings until a longer forward.
  int64_t max_seq_len_cached() const { return cached_; }
  // Puts the state where update() leaves it when the longest length since the last reset is
  // `max_seq_len_cached` (max_position_embeddings or less: the original frequencies).
  void restore(int64_t max_seq_len_cached);

 private:
  RopeScaling scaling_;
  double theta_;
  int64_t head_dim_, original_;
  RopeFrequencies original_freqs_, current_;
  int64_t cached_;
};

}  // namespace accel
