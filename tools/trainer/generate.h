// Text generation from a Llama model: transformers' sampling (repetition penalty, temperature,
// top-k, top-p) over a KV cache, tokens handed out as they come.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "runtime/data/tokenizer.h"

namespace accel {

struct SamplingOptions {
  double temperature = 1.0;         // 0: greedy (the most likely token)
  int64_t top_k = 0;                // keep the k most likely tokens; 0: all
  double top_p = 1.0;               // keep the fewest tokens whose probability reaches p; 1: all
  double repetition_penalty = 1.0;  // > 1 makes tokens already in the context less likely
  uint64_t seed = 0;
  int64_t max_new_tokens = 64;
  std::optional<uint32_t> stop_token;  // end of text: generation stops after it

  // Throws std::invalid_argument naming the option when a value is out of range.
  void validate() const;
};

// The next token for one position's logits, after the context `context` (prompt and tokens so
// far), in transformers' order: repetition penalty, then temperature, top-k, top-p, then a draw
// from what is left (or the argmax at temperature 0).
uint32_t sample_next(std::vector<double> logits, const std::vector<uint32_t>& context,
                     const SamplingOptions& o, std::mt19937_64& rng);

// Generates after `prompt` (not empty). The prompt runs through the model once, filling the KV
// cache; each new token then runs alone. on_token sees every token as it is chosen. Stops at
// max_new_tokens, after the stop token, or when the model's positions run out.
std::vector<uint32_t> generate(CausalLM& model, const std::vector<uint32_t>& prompt,
                               const SamplingOptions& o, Device device,
                               const std::function<void(uint32_t)>& on_token = nullptr);

// Turns a growing list of ids into text to print: each call returns only what is new, holding
// back a partial UTF-8 character (decoded as U+FFFD) until its bytes have all arrived.
class TextStream {
 public:
  explicit TextStream(const Tokenizer& tok) : tok_(tok) {}
  std::string add(uint32_t id);
  std::string finish();  // whatever was held back

 private:
  const Tokenizer& tok_;
  std::vector<uint32_t> ids_;
  size_t emitted_ = 0;
};

}  // namespace accel
