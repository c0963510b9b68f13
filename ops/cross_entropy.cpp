// cross_entropy: mean over the rows not ignored; the backward reuses the forward's log-sum-exp
// (kernels cpu/cross_entropy.cpp, cuda/cross_entropy.cu).
#include <string>

#include "ops/common.h"

namespace accel {
using detail::op_error;

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  detail::check_floating("cross_entropy", logits);
  if (logits.dim() != 2) op_error("cross_entropy", "logits must be [N, V], got " + logits.str());
  if (targets.dim() != 1 || targets.size(0) != logits.size(0))
    op_error("cross_entropy",
             "targets must be [N=" + std::to_string(logits.size(0)) + "], got " + targets.str());
  if (targets.dtype() != DType::I64 && targets.dtype() != DType::I32)
    op_error("cross_entropy", "targets must be i64 or i32, got " + targets.str());
  detail::check_same_device("cross_entropy", logits, targets);
  Backend& be = backend_for(logits.device());
  Tensor lc = contiguous(logits), tc = contiguous(targets);
  DType acc = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const int64_t n = logits.size(0);
  // The count of rows whose target is not ignore_index stays on the device: no host sync.
  Tensor ignored =
      equal(tc, Tensor::full({}, static_cast<double>(ignore_index), tc.dtype(), tc.device()));
  Tensor counted = add(mul(sum(cast(ignored, acc)), -1.0), static_cast<double>(n));
  const bool want_grad = grad_enabled() && logits.requires_grad();
  Tensor loss_rows = Tensor::empty({n}, acc, logits.device());
  Tensor lse = want_grad ? Tensor::empty({n}, acc, logits.device()) : Tensor();
  be.cross_entropy(loss_rows, lse, lc, tc, ignore_index);
  Tensor loss = div(sum(loss_rows), counted);  // 0/0 = NaN when every target is ignored
  if (!want_grad) return loss;
  // The gradient is made in backward from the saved lse: the logits are read once more and the
  // upstream gradient folds into the same pass (no gradient held from forward, no extra scaling).
  Tensor saved = lc.detach();
  return record("cross_entropy", loss.detach(), {lc},
                [saved, tc, lse, counted, ignore_index](const Tensor& g) {
                  Tensor scale = div(cast(g, counted.dtype()), counted);
                  Tensor grad = Tensor::empty(saved.shape(), saved.dtype(), saved.device());
                  backend_for(saved.device())
                      .cross_entropy_backward(grad, saved, lse, tc, ignore_index, scale);
                  return std::vector<Tensor>{grad};
                });
}

}  // namespace accel
