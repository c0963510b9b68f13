#include "runtime/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

#include "runtime/json.h"

namespace accel {
namespace {

[[noreturn]] void fail(const std::string& where, const std::string& m) {
  throw std::invalid_argument(where + ": " + m);
}

// The keys each rope type reads besides rope_type / type / rope_theta / partial_rotary_factor.
std::set<std::string> keys_of(const std::string& type) {
  if (type == "default") return {};
  if (type == "linear" || type == "dynamic") return {"factor"};
  if (type == "llama3")
    return {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
  return {"factor",           "original_max_position_embeddings",
          "beta_fast",        "beta_slow",
          "mscale",           "mscale_all_dim",
          "attention_factor", "truncate"};
}

}  // namespace

bool RopeScaling::operator==(const RopeScaling& o) const {
  return rope_type == o.rope_type && factor == o.factor && low_freq_factor == o.low_freq_factor &&
         high_freq_factor == o.high_freq_factor &&
         original_max_position_embeddings == o.original_max_position_embeddings &&
         beta_fast == o.beta_fast && beta_slow == o.beta_slow &&
         attention_factor == o.attention_factor && mscale == o.mscale &&
         mscale_all_dim == o.mscale_all_dim && truncate == o.truncate;
}

nlohmann::json RopeScaling::to_json() const {
  nlohmann::json j = {{"rope_type", rope_type}};
  if (rope_type == "default") return j;
  j["factor"] = factor;
  if (rope_type == "llama3") {
    j["low_freq_factor"] = low_freq_factor;
    j["high_freq_factor"] = high_freq_factor;
    j["original_max_position_embeddings"] = original_max_position_embeddings;
  } else if (rope_type == "yarn") {
    // Only what was given: 0 stands for Hugging Face's default (a missing key).
    if (original_max_position_embeddings)
      j["original_max_position_embeddings"] = original_max_position_embeddings;
    if (beta_fast) j["beta_fast"] = beta_fast;
    if (beta_slow) j["beta_slow"] = beta_slow;
    if (attention_factor) j["attention_factor"] = attention_factor;
    if (mscale) j["mscale"] = mscale;
    if (mscale_all_dim) j["mscale_all_dim"] = mscale_all_dim;
    if (!truncate) j["truncate"] = false;
  }
  return j;
}

RopeScaling parse_rope_scaling(const nlohmann::json& j, const std::string& where, double* theta) {
  if (!j.is_object()) fail(where, "must be an object, got " + json_excerpt(j));
  RopeScaling s;
  const bool has_type = j.contains("rope_type"), has_old = j.contains("type");
  if (!has_type && !has_old) fail(where, "has no rope_type");
  const nlohmann::json& t = has_type ? j["rope_type"] : j["type"];
  if (!t.is_string()) fail(where, "rope_type must be a string, got " + json_excerpt(t));
  s.rope_type = t.get<std::string>();
  if (has_type && has_old && j["type"] != j["rope_type"])
    fail(where, "type " + json_excerpt(j["type"]) + " and rope_type " +
                    json_excerpt(j["rope_type"]) + " disagree");
  if (std::find(std::begin(kRopeTypes), std::end(kRopeTypes), s.rope_type) == std::end(kRopeTypes))
    fail(where, "rope_type '" + text_excerpt(s.rope_type) +
                    "' is not supported (supported: default, linear, dynamic, llama3, yarn)");
  const std::set<std::string> keys = keys_of(s.rope_type);
  auto number = [&](const std::string& key) {
    const nlohmann::json& v = j[key];
    if (!v.is_number()) fail(where, key + " must be a number, got " + json_excerpt(v));
    const double d = v.get<double>();
    if (!std::isfinite(d)) fail(where, key + " must be finite");
    return d;
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "rope_type" || key == "type") continue;
    if (key == "rope_theta") {
      if (!theta) fail(where, "rope_theta belongs at the top level of config.json here");
      *theta = number(key);
      continue;
    }
    if (key == "partial_rotary_factor") {
      if (number(key) != 1.0)
        fail(where, "partial_rotary_factor " + json_excerpt(v) +
                        " is not supported (RoPE over the whole head only)");
      continue;
    }
    if (!keys.count(key))
      fail(where, "key '" + text_excerpt(key) + "' is not part of rope_type " + s.rope_type +
                      (v.is_null() ? "" : " (" + json_excerpt(v) + ")") +
                      "; accel-train would not use it");
    if (v.is_null()) continue;  // Hugging Face's default
    if (key == "truncate") {
      if (!v.is_boolean()) fail(where, "truncate must be true or false, got " + json_excerpt(v));
      s.truncate = v.get<bool>();
    } else if (key == "original_max_position_embeddings") {
      if (!v.is_number_integer() || v.get<int64_t>() <= 0)
        fail(where, key + " must be a positive integer, got " + json_excerpt(v));
      s.original_max_position_embeddings = v.get<int64_t>();
    } else {
      const double d = number(key);
      if (key == "factor") s.factor = d;
      if (key == "low_freq_factor") s.low_freq_factor = d;
      if (key == "high_freq_factor") s.high_freq_factor = d;
      if (key == "beta_fast") s.beta_fast = d;
      if (key == "beta_slow") s.beta_slow = d;
      if (key == "attention_factor") s.attention_factor = d;
      if (key == "mscale") s.mscale = d;
      if (key == "mscale_all_dim") s.mscale_all_dim = d;
    }
  }
  return s;
}

void validate_rope_scaling(const RopeScaling& s, int64_t max_position_embeddings,
                           const std::string& where) {
  if (std::find(std::begin(kRopeTypes), std::end(kRopeTypes), s.rope_type) == std::end(kRopeTypes))
    fail(where, "rope_type '" + text_excerpt(s.rope_type) +
                    "' is not supported (supported: default, linear, dynamic, llama3, yarn)");
  if (s.is_default()) return;
  const bool yarn = s.rope_type == "yarn";
  // yarn may leave factor to max_position_embeddings / original_max_position_embeddings.
  if (!(yarn && s.factor == 0 && s.original_max_position_embeddings > 0) &&
      !(std::isfinite(s.factor) && s.factor > 0))
    fail(where,
         "rope_type " + s.rope_type + " needs a positive factor, got " + std::to_string(s.factor));
  if (s.rope_type == "dynamic" && s.factor < 1)
    fail(where, "rope_type dynamic needs factor >= 1, got " + std::to_string(s.factor));
  if (s.rope_type == "llama3") {
    if (s.original_max_position_embeddings <= 0)
      fail(where, "rope_type llama3 needs original_max_position_embeddings");
    if (!(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor))
      fail(where, "rope_type llama3 needs 0 < low_freq_factor < high_freq_factor, got " +
                      std::to_string(s.low_freq_factor) + " and " +
                      std::to_string(s.high_freq_factor));
  }
  if (yarn) {
    if (s.beta_fast < 0 || s.beta_slow < 0 || s.attention_factor < 0 || s.mscale < 0 ||
        s.mscale_all_dim < 0)
      fail(where,
           "rope_type yarn: beta_fast, beta_slow, attention_factor, mscale and "
           "mscale_all_dim must not be negative");
    if (s.original_max_position_embeddings > max_position_embeddings)
      fail(where, "original_max_position_embeddings " +
                      std::to_string(s.original_max_position_embeddings) +
                      " exceeds max_position_embeddings " +
                      std::to_string(max_position_embeddings));
  }
}

}  // namespace accel
