// Module / Parameter: modules own named parameters and child modules. named_parameters() yields
// dotted names identical to Hugging Face's ("model.layers.0.self_attn.q_proj.weight"), so
// safetensors checkpoints map one to one. Pre/post forward hooks let sharding strategies gather
// parameters before a module runs and release them after.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/tensor.h"

namespace accel {

// A parameter slot. Strategies may swap the tensor a slot holds (a gathered full weight, a
// 16-bit compute copy, an empty placeholder) without the module noticing.
struct Parameter {
  std::string name;  // full dotted name, set by the root's finalize()
  Tensor value;
};

class Module {
 public:
  using Hook = std::function<void(Module&)>;

  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The class name as Hugging Face spells it ("LlamaDecoderLayer"), for wrap policies.
  virtual std::string type_name() const = 0;

  // All parameters below this module, in registration order, with full dotted names.
  std::vector<Parameter*> parameters();
  std::vector<std::pair<std::string, Module*>> named_modules();  // pre-order, this first
  const std::vector<std::pair<std::string, Module*>>& children() const { return children_; }
  const std::string& full_name() const { return full_name_; }

  // Sets full names from this module down; call once on the root after building.
  void finalize(const std::string& prefix = "");

  void add_pre_forward_hook(Hook h) { pre_hooks_.push_back(std::move(h)); }
  void add_post_forward_hook(Hook h) { post_hooks_.push_back(std::move(h)); }
  bool has_forward_hooks() const { return !pre_hooks_.empty() || !post_hooks_.empty(); }
  // Subclasses call these around their forward computation.
  void run_pre_forward_hooks() {
    for (auto& h : pre_hooks_) h(*this);
  }
  void run_post_forward_hooks() {
    for (auto& h : post_hooks_) h(*this);
  }

 protected:
  Parameter& register_parameter(const std::string& local_name, Tensor value);
  template <class M>
  M& register_module(const std::string& local_name, std::unique_ptr<M> m) {
    M& ref = *m;
    owned_.push_back(std::move(m));
    children_.push_back({local_name, &ref});
    return ref;
  }

 private:
  std::vector<std::pair<std::string, std::unique_ptr<Parameter>>> params_;
  std::vector<std::unique_ptr<Module>> owned_;
  std::vector<std::pair<std::string, Module*>> children_;
  std::vector<Hook> pre_hooks_, post_hooks_;
  std::string full_name_;
};

// Runs a module's forward between its pre and post hooks.
template <class F>
auto with_forward_hooks(Module& m, F&& f) {
  m.run_pre_forward_hooks();
  auto out = f();
  m.run_post_forward_hooks();
  return out;
}

}  // namespace accel
