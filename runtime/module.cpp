#include "runtime/module.h"

#include <stdexcept>

namespace accel {

Parameter& Module::register_parameter(const std::string& local_name, Tensor value) {
  for (auto& [n, p] : params_)
    if (n == local_name) throw std::logic_error("parameter '" + local_name + "' registered twice");
  auto p = std::make_unique<Parameter>();
  p->name = local_name;
  p->value = std::move(value);
  Parameter& ref = *p;
  params_.push_back({local_name, std::move(p)});
  return ref;
}

void Module::finalize(const std::string& prefix) {
  full_name_ = prefix;
  for (auto& [n, p] : params_) {
    p->name = prefix.empty() ? n : prefix + "." + n;
    p->value.set_name(p->name);
  }
  for (auto& [n, m] : children_) m->finalize(prefix.empty() ? n : prefix + "." + n);
}

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  for (auto& [n, p] : params_) out.push_back(p.get());
  for (auto& [n, m] : children_) {
    auto sub = m->parameters();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out{{full_name_, this}};
  for (auto& [n, m] : children_) {
    auto sub = m->named_modules();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

}  // namespace accel
