// RoPE scaling as Hugging Face's config.json describes it: transformers 5's `rope_parameters`, or
// the older `rope_scaling` beside a top-level `rope_theta` (the frequencies:
// models/rope_scaling.h).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace accel {

struct RopeScaling {
  std::string rope_type = "default";  // default, linear, dynamic, llama3, yarn
  // linear, dynamic, llama3, yarn (yarn: 0 = max_position_embeddings / original's)
  double factor = 0;
  double low_freq_factor = 0, high_freq_factor = 0;  // llama3
  // llama3 (required), yarn (0 = max_position_embeddings)
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 0, beta_slow = 0;    // yarn; 0 = 32 and 1
  double attention_factor = 0;            // yarn; 0 = from factor (and mscale / mscale_all_dim)
  double mscale = 0, mscale_all_dim = 0;  // yarn
  bool truncate = true;                   // yarn: correction range rounded to whole dims

  bool operator==(const RopeScaling& o) const;
  bool operator!=(const RopeScaling& o) const { return !(*this == o); }
  bool is_default() const { return rope_type == "default"; }
  // The scaling's own keys as config.json spells them (without rope_theta), e.g.
  // {"rope_type": "llama3", "factor": 32.0, ...}; {"rope_type": "default"} for the default.
  nlohmann::json to_json() const;
};

// The rope types this runtime computes.
const char* const kRopeTypes[] = {"default", "linear", "dynamic", "llama3", "yarn"};

// Reads one rope_scaling / rope_parameters object (`where` names it in messages, e.g.
// "config.json: rope_scaling"). `type` is accepted for `rope_type` (older files). A rope_theta
// inside (transformers 5) is stored into *theta when given, else refused. Throws
// std::invalid_argument naming the key: an unknown rope type (longrope, ...), a key the type does
// not have, a partial_rotary_factor other than 1, a value of the wrong type.
RopeScaling parse_rope_scaling(const nlohmann::json& j, const std::string& where, double* theta);

// Throws std::invalid_argument (prefixed by `where`) when the values cannot describe a scaling:
// factor not positive, llama3 without its four values, low_freq_factor >= high_freq_factor, ...
void validate_rope_scaling(const RopeScaling& s, int64_t max_position_embeddings,
                           const std::string& where);

}  // namespace accel
