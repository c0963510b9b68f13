// Shared by the model and data tests that run a small decoder on the CPU: its shape, which each
// test completes with what it is about (head_dim, positions, RoPE, initialization).
#pragma once

#include <cstdint>

#include "models/decoder.h"

namespace accel::testing {

// Two layers of hidden size 32 (MLP 48), 4 query heads over 2 KV heads.
inline DecoderConfig tiny_decoder(int64_t vocab_size) {
  DecoderConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = vocab_size;
  return c;
}

}  // namespace accel::testing
