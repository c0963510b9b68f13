#include "runtime/autograd.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "runtime/kernels.h"

namespace accel {
namespace {
thread_local bool g_grad_enabled = true;

// Whether `g` is the only tensor over its memory, all of it: nothing else can see a write to it.
bool sole_owner_of_its_storage(const Tensor& g) {
  return g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.is_contiguous() &&
         g.offset() == 0 && g.nbytes() == g.storage()->nbytes;
}

// Adds g into the gradient slot. The first contribution becomes the slot: g itself when nothing
// else holds its memory (no copy: at 1B that is 3 GB of copies a step), else a copy of it, so
// that a later in-place accumulation cannot write into a tensor that some backward function
// also returned elsewhere.
void accumulate_into(std::shared_ptr<TensorImpl>& slot, const Tensor& g, MemCategory category) {
  if (!slot) {
    if (sole_owner_of_its_storage(g)) {
      recategorize(*g.storage(), category);
      slot = g.impl_ptr();
    } else {
      slot = g.clone(category).impl_ptr();
    }
    return;
  }
  kernels::accumulate(Tensor(slot), g);
}
}  // namespace

bool grad_enabled() { return g_grad_enabled; }

NoGradGuard::NoGradGuard() : prev_(g_grad_enabled) { g_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { g_grad_enabled = prev_; }

namespace {
// The node for `out`, or null when nothing is recorded (recording off, no input needs a gradient).
std::shared_ptr<Node> new_node(const char* name, std::vector<Tensor>& inputs) {
  if (!g_grad_enabled) return nullptr;
  bool any = false;
  for (const Tensor& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (!any) return nullptr;
  auto node = std::make_shared<Node>();
  node->name = name;
  node->inputs = std::move(inputs);
  return node;
}

Tensor attach(Tensor out, std::shared_ptr<Node> node) {
  out.impl()->grad_fn = std::move(node);
  out.impl()->requires_grad = true;
  return out;
}
}  // namespace

Tensor record(const char* name, Tensor out, std::vector<Tensor> inputs, BackwardFn backward) {
  auto node = new_node(name, inputs);
  if (!node) return out;
  node->backward = std::move(backward);
  return attach(std::move(out), std::move(node));
}

Tensor record_folding(const char* name, Tensor out, std::vector<Tensor> inputs, int fold_input,
                      FoldingBackwardFn backward) {
  if (fold_input < 0 || fold_input >= static_cast<int>(inputs.size()))
    throw std::logic_error(std::string("[record_folding] op '") + name + "': fold input " +
                           std::to_string(fold_input) + " out of " + std::to_string(inputs.size()) +
                           " inputs");
  auto node = new_node(name, inputs);
  if (!node) return out;
  node->fold_backward = std::move(backward);
  node->fold_input = fold_input;
  return attach(std::move(out), std::move(node));
}

namespace {
// The seed of the backward pass running on this thread when given as a number; empty otherwise,
// including inside a nested pass (a checkpoint's recomputation).
struct SeedNote {
  const TensorImpl* impl = nullptr;
  double value = 0;
};
thread_local SeedNote t_seed;

class SeedScope {
 public:
  explicit SeedScope(SeedNote note) : prev_(t_seed) { t_seed = note; }
  ~SeedScope() { t_seed = prev_; }
  SeedScope(const SeedScope&) = delete;
  SeedScope& operator=(const SeedScope&) = delete;

 private:
  SeedNote prev_;
};

void backward_pass(const Tensor& root, const Tensor& grad_output, bool retain_graph);
}  // namespace

void run_backward(const Tensor& root, const Tensor& grad_output, bool retain_graph) {
  SeedScope none(SeedNote{});
  backward_pass(root, grad_output, retain_graph);
}

void backward_with_seed(const Tensor& root, double seed) {
  if (root.numel() != 1)
    throw std::invalid_argument(
        "[backward] a number as the gradient needs a one-element tensor, got " +
        shape_str(root.shape()));
  const Tensor s = Tensor::full(root.shape(), seed, root.dtype(), root.device());
  SeedScope note(SeedNote{s.impl(), seed});
  backward_pass(root, s, false);
}

std::optional<double> backward_seed_value(const Tensor& g) {
  if (!g.defined() || !t_seed.impl || g.impl() != t_seed.impl) return std::nullopt;
  return t_seed.value;
}

namespace {
void backward_pass(const Tensor& root, const Tensor& grad_output, bool retain_graph) {
  if (!root.requires_grad())
    throw std::invalid_argument("[backward] tensor does not require grad and has no history");
  Tensor seed = grad_output;
  if (!seed.defined()) {
    if (root.numel() != 1)
      throw std::invalid_argument("[backward] implicit gradient needs a one-element tensor, got " +
                                  shape_str(root.shape()));
    seed = Tensor::ones(root.shape(), root.dtype(), root.device());
  } else if (seed.shape() != root.shape()) {
    throw std::invalid_argument("[backward] gradient shape " + shape_str(seed.shape()) +
                                " does not match tensor shape " + shape_str(root.shape()));
  }

  // Reverse topological order by iterative depth-first search over tensors.
  std::vector<std::shared_ptr<TensorImpl>> order;
  std::unordered_set<TensorImpl*> visited;
  std::vector<std::pair<std::shared_ptr<TensorImpl>, size_t>> stack{{root.impl_ptr(), 0}};
  visited.insert(root.impl());
  while (!stack.empty()) {
    auto& [impl, next] = stack.back();
    Node* node = impl->grad_fn.get();
    if (node && next < node->inputs.size()) {
      const Tensor& in = node->inputs[next++];
      if (in.defined() && in.requires_grad() && visited.insert(in.impl()).second)
        stack.push_back({in.impl_ptr(), 0});
      continue;
    }
    order.push_back(impl);
    stack.pop_back();
  }

  std::unordered_map<TensorImpl*, std::shared_ptr<TensorImpl>> grads;
  // Sums this pass allocated: only these may be accumulated into in place (a backward function's
  // result may alias a tensor it also returned for another input).
  std::unordered_set<TensorImpl*> owned_sums;
  grads[root.impl()] = seed.impl_ptr();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    TensorImpl* impl = it->get();
    auto found = grads.find(impl);
    if (found == grads.end()) continue;  // no path carried a gradient here
    Tensor g(found->second);
    owned_sums.erase(found->second.get());  // g may now be passed on (aliased) as it is
    grads.erase(found);
    if (!impl->grad_fn) {
      accumulate_into(impl->grad, g, MemCategory::Grads);
      Tensor leaf(*it);
      for (auto& hook : impl->grad_ready_hooks) hook(leaf);
      continue;
    }
    Node* node = impl->grad_fn.get();
    if (!node->backward && !node->fold_backward)
      throw std::runtime_error(std::string("[backward] the graph through '") + node->name +
                               "' was already freed; pass retain_graph=true to backward twice");
    // A folding node gets the gradient its fold input has accumulated so far in this pass.
    const int fold = node->fold_input;
    Tensor pending;
    if (fold >= 0) {
      const Tensor& in = node->inputs[fold];
      if (in.defined() && in.requires_grad()) {
        auto slot = grads.find(in.impl());
        if (slot != grads.end()) pending = Tensor(slot->second);
      }
    }
    std::vector<Tensor> in_grads;
    {
      NoGradGuard no_grad;  // backward functions compute values, not new graphs
      in_grads = node->fold_backward ? node->fold_backward(g, pending) : node->backward(g);
    }
    if (in_grads.size() != node->inputs.size())
      throw std::logic_error(std::string("[backward] op '") + node->name + "' returned " +
                             std::to_string(in_grads.size()) + " gradients for " +
                             std::to_string(node->inputs.size()) + " inputs");
    // The fold input goes first: its gradient replaces the slot, so the same tensor passed again
    // as another input of this node then adds to the replaced value.
    std::vector<size_t> visit(in_grads.size());
    std::iota(visit.begin(), visit.end(), size_t{0});
    if (fold > 0) std::rotate(visit.begin(), visit.begin() + fold, visit.begin() + fold + 1);
    for (size_t i : visit) {
      const Tensor& in = node->inputs[i];
      const Tensor& gi = in_grads[i];
      if (!in.defined() || !in.requires_grad() || !gi.defined()) continue;
      if (gi.shape() != in.shape() || gi.dtype() != in.dtype())
        throw std::logic_error(std::string("[backward] op '") + node->name + "' returned " +
                               gi.str() + " as the gradient of input " + std::to_string(i) +
                               " which is " + in.str());
      auto slot = grads.find(in.impl());
      if (static_cast<int>(i) == fold && pending.defined()) {
        // gi includes pending: it replaces the slot. It is not a sum this pass owns (it may alias
        // what the backward returned elsewhere), so a later contribution makes a new sum.
        owned_sums.erase(slot->second.get());
        slot->second = gi.impl_ptr();
      } else if (slot == grads.end()) {
        grads.emplace(in.impl(), gi.impl_ptr());
      } else if (owned_sums.count(slot->second.get())) {
        kernels::accumulate(Tensor(slot->second), gi);
      } else {
        Tensor sum = kernels::sum_of(Tensor(slot->second), gi);
        slot->second = sum.impl_ptr();
        owned_sums.insert(sum.impl());
      }
    }
    if (!retain_graph) {
      node->backward = nullptr;  // frees the saved tensors
      node->fold_backward = nullptr;
    }
  }
}
}  // namespace

namespace {
// The outputs a selective checkpoint's forward kept, in call order, with the op names (string
// literals) that kept them.
struct KeptOutputs {
  std::vector<std::pair<const char*, std::vector<Tensor>>> calls;
};

// Where keep_outputs puts or finds outputs on this thread: the selective checkpoint whose forward
// (keeping) or recomputation (replaying from `next`) is running; null elsewhere, and inside a
// full checkpoint (which keeps nothing of its own).
struct KeepScope {
  KeptOutputs* kept = nullptr;
  bool replaying = false;
  size_t next = 0;
};
thread_local KeepScope* g_keep_scope = nullptr;

class KeepScopeGuard {
 public:
  explicit KeepScopeGuard(KeepScope* scope) : prev_(g_keep_scope) { g_keep_scope = scope; }
  ~KeepScopeGuard() { g_keep_scope = prev_; }
  KeepScopeGuard(const KeepScopeGuard&) = delete;
  KeepScopeGuard& operator=(const KeepScopeGuard&) = delete;

 private:
  KeepScope* prev_;
};

// Recording is off inside backward functions; a recomputation turns it back on.
class EnableGrad {
 public:
  EnableGrad() : prev_(g_grad_enabled) { g_grad_enabled = true; }
  ~EnableGrad() { g_grad_enabled = prev_; }
  EnableGrad(const EnableGrad&) = delete;
  EnableGrad& operator=(const EnableGrad&) = delete;

 private:
  bool prev_;
};
}  // namespace

std::vector<Tensor> keep_outputs(const char* op,
                                 const std::function<std::vector<Tensor>()>& compute) {
  KeepScope* scope = g_keep_scope;
  if (!scope) return compute();
  auto& calls = scope->kept->calls;
  if (!scope->replaying) {
    std::vector<Tensor> out;
    {
      KeepScopeGuard inner(nullptr);  // what compute calls itself is part of this op
      out = compute();
    }
    // Kept as detached views (the same storage): the checkpoint's output can be one of these
    // tensors, and its node holds `kept`, so keeping the tensor itself would make a reference
    // cycle wherever that node's backward does not run to its end (a retained graph, a throw).
    std::vector<Tensor> views;
    for (const Tensor& t : out) views.push_back(t.defined() ? t.detach() : t);
    calls.push_back({op, std::move(views)});
    return out;
  }
  if (scope->next >= calls.size() || std::strcmp(calls[scope->next].first, op) != 0)
    throw std::logic_error(std::string("[checkpoint] the selective recomputation called '") + op +
                           "' where its forward " +
                           (scope->next < calls.size()
                                ? std::string("called '") + calls[scope->next].first + "'"
                                : "made no more calls") +
                           " (call " + std::to_string(scope->next) +
                           "): the checkpointed function must run the same ops in the same order");
  std::vector<Tensor> out;
  for (const Tensor& t : calls[scope->next++].second) out.push_back(t.defined() ? t.detach() : t);
  return out;
}

Tensor keep_output(const char* op, const std::function<Tensor()>& compute) {
  return keep_outputs(op, [&] { return std::vector<Tensor>{compute()}; })[0];
}

Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                  const std::vector<Tensor>& inputs, CheckpointMode mode) {
  if (!grad_enabled()) return fn(inputs);
  std::shared_ptr<KeptOutputs> kept;
  if (mode == CheckpointMode::Selective) kept = std::make_shared<KeptOutputs>();
  Tensor out;
  {
    NoGradGuard no_grad;
    KeepScope keeping{kept.get()};
    KeepScopeGuard scope(kept ? &keeping : nullptr);
    out = fn(inputs);
  }
  std::vector<Tensor> saved(inputs);
  return record("checkpoint", out, inputs, [fn, saved, kept](const Tensor& g) {
    std::vector<Tensor> detached;
    detached.reserve(saved.size());
    for (const Tensor& t : saved) {
      Tensor d = t.detach();
      if (t.requires_grad()) d.set_requires_grad(true);
      detached.push_back(d);
    }
    {
      EnableGrad enable;
      Tensor recomputed;
      {
        KeepScope replaying{kept.get(), true};
        KeepScopeGuard scope(kept ? &replaying : nullptr);
        recomputed = fn(detached);
        if (kept && replaying.next != kept->calls.size())
          throw std::logic_error("[checkpoint] the selective recomputation made " +
                                 std::to_string(replaying.next) + " of the " +
                                 std::to_string(kept->calls.size()) +
                                 " kept calls of its forward: the checkpointed function must run "
                                 "the same ops in the same order");
      }
      if (recomputed.requires_grad()) run_backward(recomputed, g, false);
    }
    std::vector<Tensor> grads;
    for (const Tensor& d : detached) grads.push_back(d.requires_grad() ? d.grad() : Tensor());
    return grads;
  });
}

}  // namespace accel
