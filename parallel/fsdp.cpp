#include "parallel/fsdp.h"

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "ops/ops.h"
#include "runtime/config.h"

namespace accel {

namespace {
std::vector<std::string> split_names(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
  }
  return out;
}
}  // namespace

FsdpOptions FsdpOptions::from_config(const Config& cfg, DType compute_dtype) {
  const FsdpConfig& f = cfg.fsdp;
  if (f.fsdp_version != 2)
    throw std::invalid_argument("fsdp_config.fsdp_version " + std::to_string(f.fsdp_version) +
                                " is not supported: accel-train implements FSDP2 only; set "
                                "fsdp_config.fsdp_version: 2");
  FsdpOptions o;
  o.compute_dtype = compute_dtype;
  o.auto_wrap_policy = f.fsdp_auto_wrap_policy;
  o.layer_cls_to_wrap = split_names(f.fsdp_transformer_layer_cls_to_wrap);
  o.min_num_params = f.fsdp_min_num_params;
  o.reshard_after_forward = f.fsdp_reshard_after_forward;
  o.offload_params = f.fsdp_offload_params;
  o.state_dict_type = f.fsdp_state_dict_type;
  o.find_unused_parameters = cfg.distributed.find_unused_parameters;
  if (o.auto_wrap_policy != "TRANSFORMER_BASED_WRAP" && o.auto_wrap_policy != "SIZE_BASED_WRAP" &&
      o.auto_wrap_policy != "NO_WRAP")
    throw std::invalid_argument(
        "fsdp_config.fsdp_auto_wrap_policy must be TRANSFORMER_BASED_WRAP, "
        "SIZE_BASED_WRAP or NO_WRAP, got '" +
        o.auto_wrap_policy + "'");
  if (o.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" && o.layer_cls_to_wrap.empty())
    throw std::invalid_argument(
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap is empty; name the layer class to wrap "
        "(LlamaDecoderLayer)");
  if (o.state_dict_type != "SHARDED_STATE_DICT" && o.state_dict_type != "FULL_STATE_DICT")
    throw std::invalid_argument(
        "fsdp_config.fsdp_state_dict_type must be SHARDED_STATE_DICT or FULL_STATE_DICT, got '" +
        o.state_dict_type + "'");
  if (cfg.fp8.enable_fsdp_float8_all_gather)
    throw std::invalid_argument(
        "fp8_config.enable_fsdp_float8_all_gather is not implemented yet in accel-train's FSDP; "
        "set it to false (the fp8 GEMMs still run with mixed_precision: fp8)");
  return o;
}

std::vector<Module*> fsdp_units(Module& root, const FsdpOptions& o) {
  std::vector<Module*> out;
  if (o.auto_wrap_policy == "NO_WRAP") return out;
  if (o.auto_wrap_policy == "TRANSFORMER_BASED_WRAP") {
    const auto& types = o.layer_cls_to_wrap;
    std::function<void(Module&)> visit = [&](Module& m) {
      for (const auto& [name, child] : m.children()) {
        if (std::find(types.begin(), types.end(), child->type_name()) != types.end())
          out.push_back(child);
        else
          visit(*child);
      }
    };
    visit(root);
    if (out.empty())
      throw std::invalid_argument(
          "fsdp_config.fsdp_transformer_layer_cls_to_wrap: no module of the model is of a listed "
          "class; the model's layer class is LlamaDecoderLayer");
    return out;
  }
  // SIZE_BASED_WRAP, bottom-up. Returns the parameters of `m` not inside a chosen unit and
  // whether a unit was chosen at or below m.
  std::function<int64_t(Module&, bool, bool*)> visit = [&](Module& m, bool is_root,
                                                           bool* chosen) -> int64_t {
    // Children first, but units must come out in pre-order: collect per child, then splice.
    int64_t rest = 0;
    bool below = false;
    size_t mark = out.size();
    for (const auto& [name, child] : m.children()) {
      bool c = false;
      rest += visit(*child, false, &c);
      below = below || c;
    }
    int64_t own = 0;  // parameters registered directly on m
    {
      std::set<Parameter*> in_children;
      for (const auto& [name, child] : m.children())
        for (Parameter* p : child->parameters()) in_children.insert(p);
      for (Parameter* p : m.parameters())
        if (!in_children.count(p)) own += p->value.numel();
    }
    rest += own;
    const bool eligible = !is_root && !below && !m.children().empty() &&
                          m.type_name() != "ModuleList" && rest > 0 && rest >= o.min_num_params;
    if (eligible) {
      out.insert(out.begin() + static_cast<std::ptrdiff_t>(mark), &m);
      *chosen = true;
      return 0;
    }
    *chosen = below;
    return rest;
  };
  bool chosen = false;
  visit(root, true, &chosen);
  return out;
}

FsdpStrategy::FsdpStrategy(std::shared_ptr<ProcessGroup> pg, FsdpOptions options)
    : FlatDataParallel(std::move(pg),
                       [&options] {
                         DataParallelOptions d;
                         d.zero_stage = 3;
                         d.compute_dtype = options.compute_dtype;
                         d.find_unused_parameters = options.find_unused_parameters;
                         d.offload_params = options.offload_params;
                         d.offload_optimizer = options.offload_params;
                         FsdpOptions copy = options;
                         d.select_units = [copy](Module& m) { return fsdp_units(m, copy); };
                         d.reshard_after_forward = options.reshard_after_forward;
                         d.reduce_in_fp32 = true;
                         return d;
                       }()),
      fsdp_(std::move(options)) {}

std::vector<std::pair<std::string, Tensor>> FsdpStrategy::full_state_dict() {
  if (fsdp_.state_dict_type == "FULL_STATE_DICT") return gather_fp32_weights();
  return {};
}

nlohmann::json FsdpStrategy::checkpoint_manifest() const {
  nlohmann::json j = FlatDataParallel::checkpoint_manifest();
  j["fsdp_version"] = 2;
  j["fsdp_state_dict_type"] = fsdp_.state_dict_type;
  j["fsdp_auto_wrap_policy"] = fsdp_.auto_wrap_policy;
  return j;
}

// ---- fp8 all-gather ----------------------------------------------------------------------------

Fp8AllGather::Fp8AllGather(const std::vector<std::vector<Parameter*>>& unit_weights, int world) {
  int64_t n = 0;
  for (const auto& ws : unit_weights) {
    for (Parameter* p : ws)
      if (p->value.dim() != 2)
        throw std::logic_error("fp8 all-gather: weight " + p->name + " is not 2-d");
    layouts_.emplace_back(ws, world);
    first_.push_back(n);
    n += static_cast<int64_t>(ws.size());
  }
  scales_ = Tensor::full({std::max<int64_t>(n, 1)}, 1.0, DType::F32, Device::cpu());
}

void Fp8AllGather::precompute_scales(const std::vector<Tensor>& shards, const Comm& comm) {
  if (shards.size() != layouts_.size())
    throw std::logic_error("fp8 all-gather: one shard per unit expected");
  NoGradGuard no_grad;
  const int rank = comm.rank();
  std::vector<float> local;
  Device dev = shards.empty() ? Device::cpu() : shards[0].device();
  for (size_t u = 0; u < layouts_.size(); ++u) {
    const FlatLayout& l = layouts_[u];
    for (size_t i = 0; i < l.slots.size(); ++i) {
      FlatLayout::Range r = l.owned(i, rank);
      float a = 0.0f;
      if (r.size() > 0) {
        const int64_t off = l.slots[i].offset + r.begin - rank * l.shard_numel;
        a = static_cast<float>(fp8_amax(flat_view(shards[u], off, {1, r.size()})).item());
      }
      local.push_back(a);
    }
  }
  if (local.empty()) return;
  // One MAX all-reduce for every fp8 weight of the model.
  Tensor amax = Tensor::from_vector(local, {static_cast<int64_t>(local.size())}).to(dev);
  comm.all_reduce(amax, ReduceOp::Max)->wait();
  std::vector<double> g = amax.to_vector();
  std::vector<float> sc(g.size());
  for (size_t i = 0; i < g.size(); ++i)
    sc[i] = fp8_scale_for_amax(static_cast<float>(g[i]), kE4M3Max, 0, 1.0f);
  scales_ = Tensor::from_vector(sc, {static_cast<int64_t>(sc.size())});
}

Tensor Fp8AllGather::scale(int unit, int slot) const {
  return flat_view(scales_, first_.at(unit) + slot, {1});
}

std::vector<Fp8Tensor> Fp8AllGather::gather(int unit, const Tensor& shard, const Comm& comm) const {
  NoGradGuard no_grad;
  const FlatLayout& l = layouts_.at(unit);
  const int rank = comm.rank();
  const Device dev = shard.device();
  // Copy-in: this rank's chunk of the fp8 buffer, each weight's part cast with its global scale.
  Tensor full = Tensor::zeros({l.padded_numel}, DType::E4M3, dev, MemCategory::Comm);
  Tensor chunk = flat_view(full, rank * l.shard_numel, {l.shard_numel});
  for (size_t i = 0; i < l.slots.size(); ++i) {
    FlatLayout::Range r = l.owned(i, rank);
    if (r.size() == 0) continue;
    const int64_t off = l.slots[i].offset + r.begin - rank * l.shard_numel;
    Fp8Tensor q = fp8_cast(flat_view(shard, off, {1, r.size()}), DType::E4M3,
                           scale(unit, static_cast<int>(i)).to(dev));
    flat_view(chunk, off, {1, r.size()}).copy_(q.data);
  }
  comm.all_gather(full, chunk)->wait();
  // Copy-out: each weight's bytes, padded to multiples of 16 for the GEMM.
  std::vector<Fp8Tensor> out;
  for (size_t i = 0; i < l.slots.size(); ++i) {
    const FlatSlot& s = l.slots[i];
    const int64_t rows = s.shape[0], cols = s.shape[1];
    Fp8Tensor t;
    t.rows = rows;
    t.cols = cols;
    const int64_t rp = (rows + 15) / 16 * 16, cp = (cols + 15) / 16 * 16;
    if (rp == rows && cp == cols) {
      t.data = flat_view(full, s.offset, s.shape);
    } else {
      t.data = Tensor::zeros({rp, cp}, DType::E4M3, dev, MemCategory::Comm);
      narrow(narrow(t.data, 0, 0, rows), 1, 0, cols).copy_(flat_view(full, s.offset, s.shape));
    }
    const float sc = static_cast<float>(scale(unit, static_cast<int>(i)).item());
    t.scale = Tensor::full({1}, sc, DType::F32, dev);
    t.scale_inv = Tensor::full({1}, 1.0f / sc, DType::F32, dev);
    out.push_back(t);
  }
  return out;
}

}  // namespace accel
