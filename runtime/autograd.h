// Reverse-mode autograd over a dynamic graph.
//
// An op whose inputs need gradients records one Node on its output: the inputs and a closure that
// maps the output's gradient to one gradient per input (undefined where an input needs none).
// backward() sorts the graph topologically, runs the closures once each, accumulates gradients into
// leaves and fires each leaf's grad-ready hooks as soon as its gradient is complete (this is where
// data-parallel strategies start communication).
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "runtime/tensor.h"

namespace accel {

using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output)>;
// A backward function that folds a pending gradient into its result for one input (the node's
// fold_input); see record_folding.
using FoldingBackwardFn =
    std::function<std::vector<Tensor>(const Tensor& grad_output, const Tensor& pending)>;

struct Node {
  const char* name = "";
  std::vector<Tensor> inputs;
  BackwardFn backward;              // set by record
  FoldingBackwardFn fold_backward;  // set by record_folding (then `backward` is empty)
  int fold_input = -1;              // the input fold_backward folds into, or -1
};

bool grad_enabled();

// Turns recording off in its scope (evaluation, optimizer updates, recomputation set-up).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Attaches a node to `out` when recording is on and any input requires a gradient; returns `out`.
// `backward` must return one gradient per input, shaped like that input (or undefined).
Tensor record(const char* name, Tensor out, std::vector<Tensor> inputs, BackwardFn backward);

// Like record, for a backward that adds an already accumulated gradient of one input into its own
// result for that input in the same pass (rms_norm: its input gradient plus the residual stream's
// in one kernel, instead of a separate sum).
//
// When the node runs, the engine passes as `pending` the gradient that inputs[fold_input] has
// accumulated so far in this backward pass (the sum of what its consumers that ran earlier gave
// it), or an undefined tensor if none has arrived yet (or that input needs no gradient). A defined
// result for fold_input must then include `pending`: it REPLACES the engine's slot for that input
// instead of being added to it (an undefined result leaves the slot as it was). Gradients that
// arrive later for that input (consumers after this node in the topological order) accumulate as
// usual, so the result equals the unfolded one for any graph and order. `pending` is this pass's
// value only (never a leaf's .grad) and may be shared with other inputs' gradients: read it, never
// write into it. The engine never accumulates in place into the returned gradient (a later
// contribution makes a new sum), so it may alias `pending` or another returned gradient.
Tensor record_folding(const char* name, Tensor out, std::vector<Tensor> inputs, int fold_input,
                      FoldingBackwardFn backward);

// The engine behind Tensor::backward.
void run_backward(const Tensor& root, const Tensor& grad_output, bool retain_graph);

// root.backward() with a number as the one-element root's gradient (the trainer's loss scale):
// the same gradients as root.backward(full(seed)), and while the pass runs, the root's op can read
// that number on the host through backward_seed_value.
void backward_with_seed(const Tensor& root, double seed);

// The number given to backward_with_seed when `g` is that pass's seed tensor itself (the upstream
// gradient of the root's own op), else nothing (another pass, a nested one, any other tensor). A
// loss op that made its gradients for an expected factor in forward (linear_cross_entropy) thus
// knows without a device read that the factor was exact.
std::optional<double> backward_seed_value(const Tensor& g);

// What a checkpoint recomputes in backward.
enum class CheckpointMode {
  Full,       // everything fn computed
  Selective,  // all but the outputs of the ops that compute through keep_outputs (GEMMs, attention)
};

// Activation checkpointing: runs fn(inputs) without keeping its intermediate activations, and in
// backward runs fn again with recording on to get the gradients. fn must be deterministic.
// Parameters fn uses (leaves reached through its closure) receive their gradients as usual.
//
// Selective mode keeps, besides the inputs, the outputs of fn's expensive ops (those computing
// through keep_outputs) in the order fn computed them. The recomputation in backward runs fn
// again, but each expensive op hands back its kept outputs instead of computing, and records its
// node with the inputs the recomputation made: only the cheap work between them (norms, RoPE,
// SwiGLU, casts, bias adds) runs twice, and no GEMM does. This is PyTorch's selective checkpoint
// with a fixed policy; it fits a tape engine whose nodes hold their inputs, where an op's saved
// input cannot be dropped and rebuilt on its own.
Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                  const std::vector<Tensor>& inputs, CheckpointMode mode = CheckpointMode::Full);

// How an expensive op (a GEMM, attention) computes its outputs, so that a selective checkpoint
// keeps them: returns compute(), except during a selective checkpoint's recomputation, where it
// returns what the same call kept in that checkpoint's forward (new handles on the same storage).
// compute() records nothing (the op records its node around the result, in both cases). `op` (a
// string literal) names the call; the recomputation must make the same calls in the same order,
// or it throws std::logic_error naming both.
std::vector<Tensor> keep_outputs(const char* op,
                                 const std::function<std::vector<Tensor>()>& compute);
Tensor keep_output(const char* op, const std::function<Tensor()>& compute);

}  // namespace accel
