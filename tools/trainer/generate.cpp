#include "tools/trainer/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace accel {

void SamplingOptions::validate() const {
  auto bad = [](const std::string& what) { throw std::invalid_argument(what); };
  if (!(temperature >= 0) || !std::isfinite(temperature))
    bad("temperature must be >= 0 (0 is greedy), got " + std::to_string(temperature));
  if (top_k < 0) bad("top_k must be >= 0 (0 keeps every token), got " + std::to_string(top_k));
  if (!(top_p > 0 && top_p <= 1)) bad("top_p must be in (0, 1], got " + std::to_string(top_p));
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
    bad("repetition_penalty must be > 0 (1 is none), got " + std::to_string(repetition_penalty));
  if (max_new_tokens < 0) bad("max_new_tokens must be >= 0, got " + std::to_string(max_new_tokens));
}

uint32_t sample_next(std::vector<double> logits, const std::vector<uint32_t>& context,
                     const SamplingOptions& o, std::mt19937_64& rng) {
  const size_t V = logits.size();
  if (V == 0) throw std::invalid_argument("sample_next: no logits");
  if (o.repetition_penalty != 1.0) {
    std::vector<bool> seen(V, false);
    for (uint32_t id : context)
      if (id < V) seen[id] = true;
    for (size_t i = 0; i < V; ++i)
      if (seen[i])
        logits[i] =
            logits[i] > 0 ? logits[i] / o.repetition_penalty : logits[i] * o.repetition_penalty;
  }
  if (o.temperature == 0)
    return static_cast<uint32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  for (double& l : logits) l /= o.temperature;
  // Tokens by decreasing logit (ties: lower id first, a stable order).
  std::vector<uint32_t> order(V);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return logits[a] > logits[b]; });
  size_t keep = V;
  if (o.top_k > 0 && static_cast<size_t>(o.top_k) < V) {
    keep = static_cast<size_t>(o.top_k);  // and the tokens tied with the k-th, as transformers
    while (keep < V && logits[order[keep]] == logits[order[keep - 1]]) ++keep;
  }
  std::vector<double> p(keep);
  const double top = logits[order[0]];
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += p[i] = std::exp(logits[order[i]] - top);
  for (double& x : p) x /= total;
  if (o.top_p < 1.0) {
    // transformers drops the tokens whose ascending cumulative probability is <= 1 - top_p:
    // from the top, a token stays while the tokens above it sum to less than top_p.
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += p[n++];
      if (cum >= o.top_p) break;
    }
    keep = n;
    p.resize(keep);
    total = std::accumulate(p.begin(), p.end(), 0.0);
    for (double& x : p) x /= total;
  }
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1), any platform
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += p[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

std::vector<uint32_t> generate(CausalLM& model, const std::vector<uint32_t>& prompt,
                               const SamplingOptions& o, Device device,
                               const std::function<void(uint32_t)>& on_token) {
  o.validate();
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
  NoGradGuard no_grad;
  std::mt19937_64 rng(o.seed);
  KVCache cache;
  std::vector<uint32_t> context = prompt, out;
  const int64_t max_pos = model.config.max_position_embeddings;
  std::vector<int64_t> next(prompt.begin(), prompt.end());
  if (static_cast<int64_t>(next.size()) > max_pos)  // keep the prompt's end
    next.erase(next.begin(), next.end() - max_pos);
  while (static_cast<int64_t>(out.size()) < o.max_new_tokens) {
    const int64_t n = static_cast<int64_t>(next.size());
    Tensor logits = model.forward(Tensor::from_vector(next, {1, n}, DType::I64, device), &cache);
    std::vector<double> last = narrow(reshape(logits, {n, -1}), 0, n - 1, 1).to_vector();
    const uint32_t id = sample_next(std::move(last), context, o, rng);
    out.push_back(id);
    context.push_back(id);
    if (on_token) on_token(id);
    if ((o.stop_token && id == *o.stop_token) || cache.length() >= max_pos) break;
    next = {static_cast<int64_t>(id)};
  }
  return out;
}

std::string TextStream::add(uint32_t id) {
  ids_.push_back(id);
  const std::string text = tok_.decode(ids_);
  static const std::string kReplacement = "\xEF\xBF\xBD";
  size_t ready = text.size();
  if (ready >= emitted_ + 3 && text.compare(ready - 3, 3, kReplacement) == 0) ready -= 3;
  if (ready <= emitted_) return "";
  std::string fresh = text.substr(emitted_, ready - emitted_);
  emitted_ = ready;
  return fresh;
}

std::string TextStream::finish() {
  const std::string text = tok_.decode(ids_);
  std::string rest = text.size() > emitted_ ? text.substr(emitted_) : "";
  emitted_ = text.size();
  return rest;
}

}  // namespace accel
