// Packed documents against each document alone, for the CPU (tests/data) and CUDA (tests/cuda)
// tests: a packed row's logits must equal those of its documents run one by one.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "models/decoder.h"
#include "runtime/data/loader.h"

namespace accel::testing {

// The largest |difference| between the logits of `b`'s packed rows (with its layout) and those of
// each segment run alone through `model` (positions 0 .. n-1), over every position; the model
// lives on `device`.
inline double packed_vs_alone_max_diff(CausalLM& model, const Batch& b, Device device) {
  TokenLayout layout;
  if (b.position_ids.defined()) layout.position_ids = b.position_ids.to(device);
  layout.segment_ids = b.segment_ids.to(device);
  const std::vector<double> packed =
      model.forward(b.input_ids.to(device), nullptr, layout).to_vector();
  const int64_t B = b.input_ids.size(0), S = b.input_ids.size(1), V = model.config.vocab_size;
  const int64_t* ids = b.input_ids.data<int64_t>();
  const int32_t* seg = b.segment_ids.data<int32_t>();
  double worst = 0;
  for (int64_t r = 0; r < B; ++r) {
    for (int64_t start = 0; start < S;) {
      int64_t end = start;
      while (end < S && seg[r * S + end] == seg[r * S + start]) ++end;
      std::vector<int64_t> doc(ids + r * S + start, ids + r * S + end);
      const std::vector<double> alone =
          model.forward(Tensor::from_vector(doc, {1, end - start}, DType::I64).to(device))
              .to_vector();
      for (int64_t t = start; t < end; ++t)
        for (int64_t v = 0; v < V; ++v)
          worst = std::max(worst, std::abs(packed[static_cast<size_t>((r * S + t) * V + v)] -
                                           alone[static_cast<size_t>((t - start) * V + v)]));
      start = end;
    }
  }
  return worst;
}

}  // namespace accel::testing
