// Reverse-mode autograd over a dynamic graph.
//
// An op whose inputs need gradients records one Node on its output: the inputs and a closure that
// maps the output's gradient to one gradient per input (undefined where an input needs none).
// backward() sorts the graph topologically, runs the closures once each, accumulates gradients into
// leaves and fires each leaf's grad-ready hooks as soon as its gradient is complete (this is where
// data-parallel strategies start communication).
#pragma once

#include <functional>
#include <vector>

#include "runtime/tensor.h"

namespace accel {

using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output)>;

struct Node {
  const char* name = "";
  std::vector<Tensor> inputs;
  BackwardFn backward;
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

// The engine behind Tensor::backward.
void run_backward(const Tensor& root, const Tensor& grad_output, bool retain_graph);

// Activation checkpointing: runs fn(inputs) without keeping its intermediate activations, and in
// backward runs fn again with recording on to get the gradients. fn must be deterministic.
// Parameters fn uses (leaves reached through its closure) receive their gradients as usual.
Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                  const std::vector<Tensor>& inputs);

}  // namespace accel
