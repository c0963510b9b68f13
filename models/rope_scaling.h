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

}  // namespace accel
