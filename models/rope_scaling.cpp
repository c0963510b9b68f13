#include "models/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace accel {
namespace {
constexpr double kPi = 3.14159265358979323846;
}  // namespace

RopeFrequencies rope_frequencies(const RopeScaling& s, double theta, int64_t head_dim,
                                 int64_t max_position_embeddings, int64_t seq_len) {
  const int64_t dim = head_dim, half = dim / 2;
  // base^(float(2i) / dim) in float32, as torch's `base ** (arange(0, dim, 2).float() / dim)`.
  auto powers = [&](double base) {
    std::vector<float> p(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i)
      p[i] =
          std::pow(static_cast<float>(base), static_cast<float>(2 * i) / static_cast<float>(dim));
    return p;
  };
  RopeFrequencies f = default_rope_frequencies(theta, dim);
  std::vector<float>& inv = f.inv_freq;
  const std::string& type = s.rope_type;
  if (type == "linear") {
    for (float& v : inv) v /= static_cast<float>(s.factor);
  } else if (type == "dynamic") {
    // Hugging Face computes the raised base in double at initialization (seq_len up to
    // max_position_embeddings, where the ratio is 1 up to rounding) and in float32 from the
    // position tensor when a longer sequence comes (dynamic_rope_update).
    const double exponent = static_cast<double>(dim) / static_cast<double>(dim - 2);
    float base = 0;
    if (seq_len > max_position_embeddings) {
      float ratio = static_cast<float>(s.factor) * static_cast<float>(seq_len);
      ratio =
          ratio / static_cast<float>(max_position_embeddings) - static_cast<float>(s.factor - 1);
      base = static_cast<float>(theta) * std::pow(ratio, static_cast<float>(exponent));
    } else {
      const double ratio = s.factor * static_cast<double>(max_position_embeddings) /
                               static_cast<double>(max_position_embeddings) -
                           (s.factor - 1);
      base = static_cast<float>(theta * std::pow(ratio, exponent));
    }
    const std::vector<float> p = powers(base);
    for (int64_t i = 0; i < half; ++i) inv[i] = 1.0f / p[i];
  } else if (type == "llama3") {
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const float low_wavelen = static_cast<float>(old_len / s.low_freq_factor);
    const float high_wavelen = static_cast<float>(old_len / s.high_freq_factor);
    const float factor = static_cast<float>(s.factor);
    for (float& v : inv) {
      // torch's `scalar / tensor` is reciprocal(tensor) * scalar.
      const float wavelen = (1.0f / v) * static_cast<float>(2 * kPi);
      // Long wavelengths are divided by the factor, short ones kept, the band between smoothed.
      const float scaled = wavelen > low_wavelen ? v / factor : v;
      if (wavelen < high_wavelen || wavelen > low_wavelen) {
        v = scaled;
      } else {
        const float smooth = ((1.0f / wavelen) * static_cast<float>(old_len) -
                              static_cast<float>(s.low_freq_factor)) /
                             static_cast<float>(s.high_freq_factor - s.low_freq_factor);
        v = (1.0f - smooth) * scaled / factor + smooth * scaled;
      }
    }
  } else if (type == "yarn") {
    const int64_t original = s.original_max_position_embeddings ? s.original_max_position_embeddings
                                                                : max_position_embeddings;
    const double factor =
        s.factor ? s.factor
                 : static_cast<double>(max_position_embeddings) / static_cast<double>(original);
    auto mscale_of = [](double scale, double m) {
      return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
    };
    if (s.attention_factor)
      f.attention_scaling = s.attention_factor;
    else if (s.mscale && s.mscale_all_dim)
      f.attention_scaling = mscale_of(factor, s.mscale) / mscale_of(factor, s.mscale_all_dim);
    else
      f.attention_scaling = mscale_of(factor, 1.0);
    const double beta_fast = s.beta_fast ? s.beta_fast : 32.0;
    const double beta_slow = s.beta_slow ? s.beta_slow : 1.0;
    // The dimension whose wavelength makes num_rotations turns over the original context.
    auto correction_dim = [&](double num_rotations) {
      return static_cast<double>(dim) *
             std::log(static_cast<double>(original) / (num_rotations * 2 * kPi)) /
             (2 * std::log(theta));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;  // Hugging Face's guard against a zero-width ramp
    const float ramp_low = static_cast<float>(low), ramp_width = static_cast<float>(high - low);
    const std::vector<float> p = powers(theta);
    const float factor_f = static_cast<float>(factor);
    for (int64_t i = 0; i < half; ++i) {
      const float ramp =
          std::min(1.0f, std::max(0.0f, (static_cast<float>(i) - ramp_low) / ramp_width));
      const float extrapolation = 1.0f - ramp;  // share of the unscaled frequency
      const float inv_extrapolation = 1.0f / p[i];
      const float inv_interpolation = 1.0f / (factor_f * p[i]);
      inv[i] = inv_interpolation * (1.0f - extrapolation) + inv_extrapolation * extrapolation;
    }
  }
  return f;
}

DynamicRope::DynamicRope(const RopeScaling& s, double theta, int64_t head_dim,
                         int64_t max_position_embeddings)
    : scaling_(s),
      theta_(theta),
      head_dim_(head_dim),
      original_(max_position_embeddings),
      original_freqs_(
          rope_frequencies(s, theta, head_dim, max_position_embeddings, max_position_embeddings)),
      current_(original_freqs_),
      cached_(max_position_embeddings) {}

const RopeFrequencies& DynamicRope::update(int64_t seq_len) {
  if (seq_len > cached_) {  // growth: the frequencies of this length
    current_ = rope_frequencies(scaling_, theta_, head_dim_, original_, seq_len);
    cached_ = seq_len;
  }
  if (seq_len < original_ && cached_ > original_) {  // back within the original context
    current_ = original_freqs_;
    cached_ = original_;
  }
  return current_;
}

void DynamicRope::restore(int64_t max_seq_len_cached) {
  current_ = original_freqs_;
  cached_ = original_;
  if (max_seq_len_cached > original_) update(max_seq_len_cached);
}

}  // namespace accel
