#include "parallel/fsdp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "ops/ops.h"
#include "runtime/config.h"
#include "runtime/format.h"

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
  FsdpOptions o;
  o.compute_dtype = compute_dtype;
  o.auto_wrap_policy = f.fsdp_auto_wrap_policy;
  o.layer_cls_to_wrap = split_names(f.fsdp_transformer_layer_cls_to_wrap);
  o.min_num_params = f.fsdp_min_num_params;
  o.reshard_after_forward = f.fsdp_reshard_after_forward;
  o.offload_params = f.fsdp_offload_params;
  o.state_dict_type = f.fsdp_state_dict_type;
  o.find_unused_parameters = cfg.distributed.find_unused_parameters;
  return o;
}

bool reads_init_weights(const Config& cfg, int rank) {
  if (cfg.distributed_type == DistributedType::Fsdp && cfg.fsdp.fsdp_cpu_ram_efficient_loading)
    return rank == 0;
  return true;
}

std::vector<Module*> fsdp_units(Module& root, const FsdpOptions& o) {
  std::vector<Module*> out;
  if (o.auto_wrap_policy == FsdpWrapPolicy::NoWrap) return out;
  if (o.auto_wrap_policy == FsdpWrapPolicy::TransformerBased) {
    out = find_units(root, o.layer_cls_to_wrap);
    if (out.empty())
      throw std::invalid_argument(
          "fsdp_config.fsdp_transformer_layer_cls_to_wrap: no module of the model is of a listed "
          "class; the model's layer class is DecoderLayer");
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
                         d.param_filter = options.param_filter;
                         d.offload_params = options.offload_params;
                         d.offload_optimizer = options.offload_params;
                         FsdpOptions copy = options;
                         d.select_units = [copy](Module& m) { return fsdp_units(m, copy); };
                         d.reshard_after_forward = options.reshard_after_forward;
                         d.reduce_in_fp32 = true;
                         d.layout = FlatLayout::Mode::Dim0;  // FSDP2: every parameter on dim 0
                         return d;
                       }()),
      fsdp_(std::move(options)) {}

// What the fp8 all-gather keeps between setup and the gathers; shared with the weight providers
// installed in the layers' contexts.
struct FsdpStrategy::Fp8State {
  std::unique_ptr<Fp8AllGather> ag;  // one unit per group
  std::shared_ptr<const Fp8Autocast> autocast;
  std::vector<std::vector<Fp8LinearContext*>> ctx;  // [group][slot], null for other slots
  std::vector<char> fp8_mode;                       // [group]: gathered as fp8 bytes
  std::vector<std::unique_ptr<Fp8AllGather::Pending>> pending;  // [group]: in flight
  std::vector<std::vector<Fp8Tensor>> gathered;                 // [group][slot]

  bool autocast_on() const { return !autocast || autocast->enabled; }
};

FsdpStrategy::~FsdpStrategy() {
  // The layers' contexts may outlive us: their providers must not hand out our weights.
  if (!fp8_) return;
  for (auto& group : fp8_->ctx)
    for (Fp8LinearContext* c : group)
      if (c) c->weight_provider = nullptr;
}

void FsdpStrategy::gather_fp8_weights(const Fp8Layers& layers) {
  if (fp8_ || setup_done_) throw std::logic_error("FsdpStrategy::gather_fp8_weights after setup");
  for (const auto& [name, ctx] : layers) {
    if (!ctx) throw std::logic_error("fp8 all-gather: layer " + name + " has no context");
    const Fp8Recipe& r = ctx->recipe;
    if (r.scaling != Fp8Scaling::Dynamic || r.forward_dtype != DType::E4M3 || r.margin != 0 ||
        r.hp_fprop || r.hp_dgrad)
      throw std::invalid_argument(
          "fp8 all-gather: layer " + name + " uses " + r.str() +
          "; the fp8 all-gather needs dynamic (tensorwise) scaling with e4m3 weights, margin 0 "
          "and fp8 fprop/dgrad (fp8_config.backend: AO)");
  }
  fp8_layers_ = layers;
  fp8_all_gather_on_ = true;
}

void FsdpStrategy::setup(Module& model, const OptimizerOptions& opts) {
  FlatDataParallel::setup(model, opts);
  setup_done_ = true;
  if (!fp8_all_gather_on_) return;

  std::map<std::string, Fp8LinearContext*> by_weight;
  for (const auto& [name, ctx] : fp8_layers_) by_weight[name + ".weight"] = ctx;
  auto st = std::make_shared<Fp8State>();
  std::vector<FlatLayout> layouts;
  std::vector<std::vector<bool>> flags;
  for (int g = 0; g < num_groups(); ++g) {
    const FlatLayout& l = group(g).layout();
    layouts.push_back(l);
    flags.emplace_back();
    st->ctx.emplace_back();
    for (const FlatSlot& s : l.slots) {
      auto it = by_weight.find(s.name);
      const bool fp8 = it != by_weight.end();
      if (fp8 && s.shape.size() != 2)
        throw std::logic_error("fp8 all-gather: " + s.name + " is not 2-d");
      flags.back().push_back(fp8);
      st->ctx.back().push_back(fp8 ? it->second : nullptr);
      if (fp8) {
        if (!st->autocast) st->autocast = it->second->autocast;
        by_weight.erase(it);
      }
    }
  }
  if (!by_weight.empty())
    throw std::logic_error("fp8 all-gather: the model has no parameter " +
                           by_weight.begin()->first + " (gather_fp8_weights names the layers)");
  st->ag = std::make_unique<Fp8AllGather>(std::move(layouts), flags);
  st->fp8_mode.assign(num_groups(), 0);
  st->pending.resize(num_groups());
  st->gathered.resize(num_groups());
  // Each fp8 layer takes its weight from the unit's gather; when the unit was gathered in the
  // compute dtype instead (autocast switched on after the gather), it casts the gathered weight
  // itself, exactly as without a provider.
  std::weak_ptr<Fp8State> weak = st;
  for (int g = 0; g < num_groups(); ++g)
    for (size_t i = 0; i < st->ctx[g].size(); ++i) {
      Fp8LinearContext* c = st->ctx[g][i];
      if (!c) continue;
      c->weight_provider = [weak, g, i](const Tensor& w) -> Fp8Tensor {
        auto s = weak.lock();
        if (s && s->fp8_mode[g] && i < s->gathered[g].size() && s->gathered[g][i].data.defined())
          return s->gathered[g][i];
        Fp8CastOptions o;
        o.pad = 16;
        return fp8_cast_dynamic(w.detach(), DType::E4M3, o, 0);
      };
    }
  fp8_ = st;
  precompute_fp8_scales();
}

void FsdpStrategy::precompute_fp8_scales() {
  if (!fp8_) return;
  std::vector<Tensor> shards;
  for (int g = 0; g < num_groups(); ++g)
    shards.push_back(fp8_->ag->num_fp8_weights(g) ? group_shard(g) : Tensor());
  const bool host_reduce = comm().group() && comm().group()->backend() == "cpu";
  fp8_->ag->precompute_scales(shards, comm(), device(), host_reduce ? Device::cpu() : device());
}

void FsdpStrategy::apply_update(const std::vector<Tensor>& grads, double lr, double multiplier) {
  FlatDataParallel::apply_update(grads, lr, multiplier);
  precompute_fp8_scales();  // the weights changed: new global amaxes
}

void FsdpStrategy::load_state(const std::vector<std::pair<std::string, Tensor>>& full_weights,
                              const std::vector<std::pair<std::string, Tensor>>& optimizer_state,
                              int64_t optimizer_steps) {
  FlatDataParallel::load_state(full_weights, optimizer_state, optimizer_steps);
  precompute_fp8_scales();
}

void FsdpStrategy::import_param_state(const ParamStateReader& read, int64_t optimizer_steps) {
  FlatDataParallel::import_param_state(read, optimizer_steps);
  precompute_fp8_scales();
}

WorkPtr FsdpStrategy::start_group_gather(int g) {
  if (!fp8_ || fp8_->ag->num_fp8_weights(g) == 0 || !fp8_->autocast_on()) {
    if (fp8_) fp8_->fp8_mode[g] = 0;
    return FlatDataParallel::start_group_gather(g);
  }
  FlatParamGroup& f = flat_group(g);
  f.materialize();
  Tensor shard = group_shard(g);
  if (shard.device() != device()) shard = shard.to(device());  // offloaded
  auto p = std::make_unique<Fp8AllGather::Pending>(fp8_->ag->start(g, shard, comm()));
  count_gather(g, static_cast<int64_t>(p->wire.nbytes()));
  WorkPtr w = p->work;
  fp8_->pending[g] = std::move(p);
  fp8_->fp8_mode[g] = 1;
  return w;
}

void FsdpStrategy::finish_group_gather(int g) {
  if (!fp8_ || !fp8_->pending[g]) {
    FlatDataParallel::finish_group_gather(g);  // the compute-dtype gather's copy-out
    return;
  }
  std::unique_ptr<Fp8AllGather::Pending> p = std::move(fp8_->pending[g]);
  NoGradGuard no_grad;
  FlatParamGroup& f = flat_group(g);
  fp8_->gathered[g] = fp8_->ag->finish(*p, f.full());
  // The fp8 weights' part of the flat compute buffer was not gathered: NaN, so that anything
  // reading those weights in the compute dtype while the unit is gathered as fp8 shows at once.
  const FlatLayout& l = f.layout();
  for (size_t i = 0; i < l.slots.size(); ++i)
    if (fp8_->ag->is_fp8(g, static_cast<int>(i)))
      flat_view(f.full(), l.slots[i].offset, {l.slots[i].numel}).fill_(std::nan(""));
}

void FsdpStrategy::release_group(int g) {
  FlatDataParallel::release_group(g);
  if (!fp8_) return;
  fp8_->pending[g].reset();
  fp8_->gathered[g].clear();
  fp8_->fp8_mode[g] = 0;
}

const Fp8AllGather* FsdpStrategy::fp8_all_gather() const { return fp8_ ? fp8_->ag.get() : nullptr; }

namespace {
// The longest dotted prefix all of a unit's parameter names share ("model.layers.0").
std::string common_module(const FlatLayout& l) {
  if (l.slots.empty()) return "";
  std::string p = l.slots.front().name;
  p = p.substr(0, p.rfind('.') == std::string::npos ? 0 : p.rfind('.'));
  for (const FlatSlot& s : l.slots)
    while (!p.empty() && s.name.compare(0, p.size() + 1, p + ".") != 0)
      p = p.substr(0, p.rfind('.') == std::string::npos ? 0 : p.rfind('.'));
  return p;
}
}  // namespace

std::vector<FsdpStrategy::UnitComm> FsdpStrategy::unit_comm() const {
  std::vector<UnitComm> out;
  const int n = num_groups();
  for (int k = 0; k < n; ++k) {  // scheduler units: forward order, the root unit last
    const int g = group_of_unit(k);
    const FlatLayout& l = group(g).layout();
    UnitComm u;
    u.name = k >= num_layer_units() ? "root" : common_module(l);
    u.numel = l.numel;
    u.fp8_numel = fp8_ ? fp8_->ag->fp8_numel(g) : 0;
    u.compute_gather_bytes =
        l.padded_numel * static_cast<int64_t>(dtype_size(options().compute_dtype));
    u.comm = group_comm().at(g);
    out.push_back(u);
  }
  return out;
}

std::string FsdpStrategy::describe_unit_comm() const {
  std::ostringstream o;
  for (const UnitComm& u : unit_comm()) {
    o << "unit " << u.name << ": " << u.numel << " params";
    if (u.fp8_numel) o << " (" << u.fp8_numel << " fp8)";
    o << ", " << u.comm.all_gathers << " all-gathers " << format_bytes(u.comm.all_gather_bytes)
      << " (" << dtype_name(options().compute_dtype) << " would be "
      << format_bytes(u.comm.all_gathers * u.compute_gather_bytes) << "), "
      << u.comm.reduce_scatters << " reduce-scatters " << format_bytes(u.comm.reduce_scatter_bytes)
      << "\n";
  }
  return o.str();
}

nlohmann::json FsdpStrategy::run_report() const {
  if (comm().size() <= 1) return nullptr;
  nlohmann::json units = nlohmann::json::array();
  for (const UnitComm& u : unit_comm())
    units.push_back(
        {{"unit", u.name},
         {"params", u.numel},
         {"fp8_params", u.fp8_numel},
         {"all_gathers", u.comm.all_gathers},
         {"all_gather_bytes", u.comm.all_gather_bytes},
         {"compute_dtype_all_gather_bytes", u.comm.all_gathers * u.compute_gather_bytes},
         {"reduce_scatters", u.comm.reduce_scatters},
         {"reduce_scatter_bytes", u.comm.reduce_scatter_bytes}});
  return {{"fsdp_unit_comm", units}};
}

std::string FsdpStrategy::run_report_line() const {
  if (comm().size() <= 1) return "";
  int64_t gathered = 0, compute = 0, scattered = 0;
  for (const UnitComm& u : unit_comm()) {
    gathered += u.comm.all_gather_bytes;
    compute += u.comm.all_gathers * u.compute_gather_bytes;
    scattered += u.comm.reduce_scatter_bytes;
  }
  return "fsdp traffic (rank " + std::to_string(comm().rank()) + "): all-gathers " +
         format_bytes(gathered) + " (" + dtype_name(options().compute_dtype) + " would be " +
         format_bytes(compute) + "), reduce-scatters " + format_bytes(scattered) +
         "; per unit: fsdp_unit_comm in metrics.jsonl";
}

std::vector<std::pair<std::string, Tensor>> FsdpStrategy::full_state_dict() {
  if (fsdp_.state_dict_type == FsdpStateDictType::Full) return gather_master_weights();
  return {};
}

std::vector<StateDictEntry> FsdpStrategy::full_state_dict_layout() const {
  if (fsdp_.state_dict_type == FsdpStateDictType::Full) return master_weights_layout();
  return {};
}

nlohmann::json FsdpStrategy::checkpoint_manifest() const {
  nlohmann::json j = FlatDataParallel::checkpoint_manifest();
  j["fsdp_version"] = 2;
  j["fsdp_state_dict_type"] = name_of(fsdp_.state_dict_type);
  j["fsdp_auto_wrap_policy"] = name_of(fsdp_.auto_wrap_policy);
  return j;
}

// ---- fp8 all-gather ----------------------------------------------------------------------------

namespace {
// A [n] view of `wire` (u8) at `byte_offset` as dtype `dt` (the offset a multiple of its size).
Tensor byte_view(const Tensor& wire, int64_t byte_offset, DType dt, int64_t n) {
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  const int64_t at = wire.offset() + byte_offset;  // bytes from the storage's start
  if (wire.dtype() != DType::U8 || at % es != 0 || byte_offset < 0 ||
      byte_offset + n * es > wire.numel())
    throw std::logic_error("fp8 all-gather: misaligned or out-of-range packed view");
  return Tensor::from_storage(wire.storage(), dt, {n}, {1}, at / es);
}
constexpr int64_t kPackAlign = 16;  // bytes
// One f32 scale per 16 bytes. Each gathered weight's scale is a view into these vectors, and the
// H200's cuBLASLt refused the fp8 GEMM ("the requested functionality is not supported") while
// they were packed 4 bytes apart; 16-byte-aligned scale pointers run.
constexpr int64_t kScaleStride = 4;
}  // namespace

Fp8AllGather::Fp8AllGather(const std::vector<std::vector<Parameter*>>& unit_weights, int world,
                           FlatLayout::Mode mode) {
  for (const auto& ws : unit_weights) {
    for (Parameter* p : ws)
      if (p->value.dim() != 2)
        throw std::logic_error("fp8 all-gather: weight " + p->name + " is not 2-d");
    layouts_.emplace_back(ws, world, mode);
    index_.emplace_back(ws.size(), 0);
  }
  init();
}

Fp8AllGather::Fp8AllGather(std::vector<FlatLayout> layouts,
                           const std::vector<std::vector<bool>>& fp8)
    : layouts_(std::move(layouts)) {
  if (fp8.size() != layouts_.size())
    throw std::logic_error("fp8 all-gather: one flag list per unit");
  for (size_t u = 0; u < layouts_.size(); ++u) {
    if (fp8[u].size() != layouts_[u].slots.size())
      throw std::logic_error("fp8 all-gather: one flag per slot");
    index_.emplace_back();
    for (size_t i = 0; i < fp8[u].size(); ++i) {
      if (fp8[u][i] && layouts_[u].slots[i].shape.size() != 2)
        throw std::logic_error("fp8 all-gather: " + layouts_[u].slots[i].name + " is not 2-d");
      index_.back().push_back(fp8[u][i] ? 0 : -1);
    }
  }
  init();
}

void Fp8AllGather::init() {
  num_fp8_ = 0;
  for (auto& unit : index_)
    for (int64_t& k : unit)
      if (k >= 0) k = num_fp8_++;
  scales_ =
      Tensor::full({std::max<int64_t>(num_fp8_, 1) * kScaleStride}, 1.0, DType::F32, Device::cpu());
  scale_invs_ = scales_.clone();
}

int64_t Fp8AllGather::num_fp8_weights(int unit) const {
  int64_t n = 0;
  for (int64_t k : index_.at(unit)) n += k >= 0;
  return n;
}

int64_t Fp8AllGather::fp8_numel(int unit) const {
  int64_t n = 0;
  for (size_t i = 0; i < index_.at(unit).size(); ++i)
    if (index_[unit][i] >= 0) n += layouts_[unit].slots[i].numel;
  return n;
}

int64_t Fp8AllGather::packed_bytes_per_rank(int unit, size_t element_size) const {
  const FlatLayout& l = layouts_.at(unit);
  int64_t most = 0;
  for (int r = 0; r < l.world; ++r) {
    int64_t bytes = 0;
    for (size_t i = 0; i < l.slots.size(); ++i) {
      const int64_t n = l.owned(i, r).size();
      bytes += is_fp8(unit, static_cast<int>(i)) ? n : n * static_cast<int64_t>(element_size);
    }
    most = std::max(most, bytes);
  }
  return (most + kPackAlign - 1) / kPackAlign * kPackAlign;
}

void Fp8AllGather::precompute_scales(const std::vector<Tensor>& shards, const Comm& comm) {
  Device dev = Device::cpu();
  for (const Tensor& s : shards)
    if (s.defined()) dev = s.device();
  precompute_scales(shards, comm, dev, dev);
}

void Fp8AllGather::precompute_scales(const std::vector<Tensor>& shards, const Comm& comm,
                                     Device device, Device reduce_device) {
  if (shards.size() != layouts_.size())
    throw std::logic_error("fp8 all-gather: one shard per unit expected");
  if (num_fp8_ == 0) return;
  NoGradGuard no_grad;
  const int rank = comm.rank();
  // Every fp8 weight's local amax (0 where this rank holds none of it), one vector for all.
  Tensor amax = Tensor::zeros({num_fp8_}, DType::F32, reduce_device, MemCategory::Comm);
  for (size_t u = 0; u < layouts_.size(); ++u) {
    const FlatLayout& l = layouts_[u];
    for (size_t i = 0; i < l.slots.size(); ++i) {
      const int64_t k = index_[u][i];
      FlatLayout::Range r = l.owned(i, rank);
      if (k < 0 || r.size() == 0) continue;
      if (!shards[u].defined() || shards[u].numel() != l.shard_numel)
        throw std::logic_error("fp8 all-gather: unit " + std::to_string(u) + " has no shard");
      const int64_t off = l.shard_offset(i, rank);
      flat_view(amax, k, {1}).copy_(fp8_amax(flat_view(shards[u], off, {1, r.size()})));
    }
  }
  // One MAX all-reduce for every fp8 weight of the model.
  comm.all_reduce(amax, ReduceOp::Max)->wait();
  std::vector<double> g = amax.to_vector();
  std::vector<float> sc(g.size() * kScaleStride, 1.0f), inv(sc.size(), 1.0f);
  for (size_t i = 0; i < g.size(); ++i) {
    sc[i * kScaleStride] = fp8_scale_for_amax(static_cast<float>(g[i]), kE4M3Max, 0, 1.0f);
    inv[i * kScaleStride] = 1.0f / sc[i * kScaleStride];
  }
  // New tensors (not in place): fp8 tensors handed out earlier keep their scales.
  const Shape n{static_cast<int64_t>(sc.size())};
  scales_ = Tensor::from_vector(sc, n).to(device);
  scale_invs_ = Tensor::from_vector(inv, n).to(device);
}

Tensor Fp8AllGather::scale(int unit, int slot) const {
  const int64_t k = index_.at(unit).at(slot);
  if (k < 0) throw std::logic_error("fp8 all-gather: slot is not an fp8 weight");
  return flat_view(scales_, k * kScaleStride, {1});
}

Fp8AllGather::Pending Fp8AllGather::start(int unit, const Tensor& shard, const Comm& comm) const {
  NoGradGuard no_grad;
  const FlatLayout& l = layouts_.at(unit);
  const int rank = comm.rank();
  const Device dev = shard.device();
  if (shard.numel() != l.shard_numel)
    throw std::logic_error("fp8 all-gather: shard of " + std::to_string(shard.numel()) +
                           " elements, the unit's chunk has " + std::to_string(l.shard_numel));
  Pending p;
  p.unit = unit;
  p.hp_dtype = shard.dtype();
  const int64_t es = static_cast<int64_t>(dtype_size(p.hp_dtype));
  const int64_t per_rank = packed_bytes_per_rank(unit, static_cast<size_t>(es));
  p.wire = Tensor::empty({per_rank * l.world}, DType::U8, dev, MemCategory::Comm);
  Tensor mine = flat_view(p.wire, rank * per_rank, {per_rank});
  // Copy-in: the other slots' elements first (in the shard's dtype), then the fp8 bytes.
  int64_t hp_n = 0, fp8_n = 0;
  for (size_t i = 0; i < l.slots.size(); ++i) {
    const int64_t n = l.owned(i, rank).size();
    (is_fp8(unit, static_cast<int>(i)) ? fp8_n : hp_n) += n;
  }
  int64_t hp_pos = 0, fp8_pos = hp_n * es;
  for (size_t i = 0; i < l.slots.size(); ++i) {
    FlatLayout::Range r = l.owned(i, rank);
    if (r.size() == 0) continue;
    const int64_t off = l.shard_offset(i, rank);
    if (!is_fp8(unit, static_cast<int>(i))) {
      byte_view(mine, hp_pos * es, p.hp_dtype, r.size()).copy_(flat_view(shard, off, {r.size()}));
      hp_pos += r.size();
      continue;
    }
    Tensor sc = scale(unit, static_cast<int>(i));
    if (sc.device() != dev) sc = sc.to(dev);
    Fp8Tensor q = fp8_cast(flat_view(shard, off, {1, r.size()}), DType::E4M3, sc);
    byte_view(mine, fp8_pos, DType::E4M3, r.size()).copy_(flat_view(q.data, 0, {r.size()}));
    fp8_pos += r.size();
  }
  if (fp8_pos < per_rank)  // the padding: no garbage on the wire
    flat_view(mine, fp8_pos, {per_rank - fp8_pos}).zero_();
  (void)fp8_n;
  p.work = comm.all_gather(p.wire, mine);
  return p;
}

std::vector<Fp8Tensor> Fp8AllGather::finish(const Pending& p, const Tensor& hp_full) const {
  NoGradGuard no_grad;
  const int unit = p.unit;
  const FlatLayout& l = layouts_.at(unit);
  const Device dev = p.wire.device();
  const int64_t es = static_cast<int64_t>(dtype_size(p.hp_dtype));
  const int64_t per_rank = p.wire.numel() / l.world;
  const bool any_hp = num_fp8_weights(unit) < static_cast<int64_t>(l.slots.size());
  if (any_hp &&
      (!hp_full.defined() || hp_full.numel() != l.flat_numel || hp_full.dtype() != p.hp_dtype))
    throw std::logic_error("fp8 all-gather: the unit's flat buffer is missing or of another shape");
  // Each fp8 weight's bytes, row-major [rows * cols], assembled from every rank's part.
  std::vector<Tensor> raw(l.slots.size());
  for (size_t i = 0; i < l.slots.size(); ++i)
    if (is_fp8(unit, static_cast<int>(i)))
      raw[i] = Tensor::empty({l.slots[i].numel}, DType::E4M3, dev, MemCategory::Params);
  for (int q = 0; q < l.world; ++q) {
    Tensor part = flat_view(p.wire, q * per_rank, {per_rank});
    int64_t hp_n = 0;
    for (size_t i = 0; i < l.slots.size(); ++i)
      if (!is_fp8(unit, static_cast<int>(i))) hp_n += l.owned(i, q).size();
    int64_t hp_pos = 0, fp8_pos = hp_n * es;
    for (size_t i = 0; i < l.slots.size(); ++i) {
      FlatLayout::Range r = l.owned(i, q);
      if (r.size() == 0) continue;
      if (is_fp8(unit, static_cast<int>(i))) {
        flat_view(raw[i], r.begin, {r.size()})
            .copy_(byte_view(part, fp8_pos, DType::E4M3, r.size()));
        fp8_pos += r.size();
      } else {
        flat_view(hp_full, l.slots[i].offset + r.begin, {r.size()})
            .copy_(byte_view(part, hp_pos * es, p.hp_dtype, r.size()));
        hp_pos += r.size();
      }
    }
  }
  if (any_hp && l.flat_numel > l.numel)
    flat_view(hp_full, l.numel, {l.flat_numel - l.numel}).zero_();
  // Copy-out: padded to multiples of 16 for the GEMM where needed.
  std::vector<Fp8Tensor> out(l.slots.size());
  for (size_t i = 0; i < l.slots.size(); ++i) {
    if (!raw[i].defined()) continue;
    const FlatSlot& s = l.slots[i];
    const int64_t rows = s.shape[0], cols = s.shape[1];
    Fp8Tensor& t = out[i];
    t.rows = rows;
    t.cols = cols;
    const int64_t rp = (rows + 15) / 16 * 16, cp = (cols + 15) / 16 * 16;
    if (rp == rows && cp == cols) {
      t.data = flat_view(raw[i], 0, s.shape);
    } else {
      t.data = Tensor::zeros({rp, cp}, DType::E4M3, dev, MemCategory::Params);
      narrow(narrow(t.data, 0, 0, rows), 1, 0, cols).copy_(flat_view(raw[i], 0, s.shape));
    }
    const int64_t k = index_[unit][i];
    t.scale = flat_view(scales_, k * kScaleStride, {1});
    t.scale_inv = flat_view(scale_invs_, k * kScaleStride, {1});
    if (t.scale.device() != dev) {
      t.scale = t.scale.to(dev);
      t.scale_inv = t.scale_inv.to(dev);
    }
  }
  return out;
}

std::vector<Fp8Tensor> Fp8AllGather::gather(int unit, const Tensor& shard, const Comm& comm,
                                            const Tensor& hp_full) const {
  Pending p = start(unit, shard, comm);
  p.work->wait();
  std::vector<Fp8Tensor> all = finish(p, hp_full);
  return all;
}

}  // namespace accel
