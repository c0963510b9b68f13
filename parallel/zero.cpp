#include "parallel/zero.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "runtime/kernels.h"

namespace accel {

namespace {
// Gradient reductions allowed in flight before the oldest is waited for (bounds the transient
// flat gradients of stages 2-3 and the reduce-scatter outputs).
constexpr size_t kMaxInFlight = 2;
}  // namespace

std::vector<Module*> find_units(Module& root, const std::vector<std::string>& types) {
  std::vector<Module*> out;
  std::function<void(Module&)> visit = [&](Module& m) {
    for (const auto& [name, child] : m.children()) {
      if (std::find(types.begin(), types.end(), child->type_name()) != types.end())
        out.push_back(child);
      else
        visit(*child);
    }
  };
  visit(root);
  return out;
}

FlatDataParallel::FlatDataParallel(std::shared_ptr<ProcessGroup> pg, DataParallelOptions options)
    : comm_(std::move(pg)), options_(std::move(options)) {
  // The user-facing rules (zero_stage 1..3, offload needs ZeRO / stage 3) are validate_config's;
  // these only guard the engine's own preconditions.
  const int st = options_.zero_stage;
  if (st < 0 || st > 3)
    throw std::logic_error("FlatDataParallel: stage " + std::to_string(st) + " is not 0..3");
  if (options_.layout != FlatLayout::Mode::Contiguous && st != 3)
    throw std::logic_error("the dim-0 shard layout needs stage 3 (FSDP)");
  if (options_.offload_optimizer && st == 0)
    throw std::logic_error("FlatDataParallel: optimizer offload needs stage >= 1");
  if (options_.offload_params && st != 3)
    throw std::logic_error("FlatDataParallel: parameter offload needs stage 3");
  if (!options_.flat_grads && (st != 0 || comm_.size() != 1))
    throw std::logic_error("per-parameter gradients (flat_grads false) need stage 0 over one rank");
  if (!(options_.bucket_cap_mb > 0))
    throw std::invalid_argument("distributed.ddp_bucket_cap_mb must be > 0, got " +
                                std::to_string(options_.bucket_cap_mb));
}

FlatDataParallel::~FlatDataParallel() {
  // Collectives still in flight reference our buffers; let them finish quietly.
  for (Pending& p : pending_) {
    try {
      p.work->wait();
    } catch (...) {
    }
  }
}

std::string FlatDataParallel::name() const {
  return options_.zero_stage == 0 ? "ddp" : "zero" + std::to_string(options_.zero_stage);
}

std::vector<Parameter*> FlatDataParallel::own_params(Module& m) const {
  std::vector<Parameter*> all = m.parameters();
  if (!options_.param_filter) return all;
  std::vector<Parameter*> out;
  for (Parameter* p : all)
    if (options_.param_filter(p->name)) out.push_back(p);
  return out;
}

void FlatDataParallel::build_groups(Module& model,
                                    std::vector<std::vector<Parameter*>>* group_params,
                                    std::vector<Module*>* units, bool* root_unit) {
  std::vector<Parameter*> params = own_params(model);
  *root_unit = false;
  if (options_.zero_stage < 3) {
    // Gradients arrive roughly in reverse registration order.
    std::vector<Parameter*> backward(params.rbegin(), params.rend());
    *group_params = make_buckets(backward, options_.bucket_cap_mb * 1024.0 * 1024.0,
                                 dtype_size(options_.compute_dtype));
    return;
  }
  *units =
      options_.select_units ? options_.select_units(model) : find_units(model, options_.unit_types);
  std::set<Parameter*> in_unit;
  std::vector<std::vector<Parameter*>> forward;
  for (Module* u : *units) {
    forward.push_back(own_params(*u));
    for (Parameter* p : forward.back())
      if (!in_unit.insert(p).second)
        throw std::invalid_argument("ZeRO-3: parameter " + p->name +
                                    " is shared by two gather units; it cannot be partitioned");
  }
  // Units that hold no parameters would never see a gradient; drop them.
  std::vector<Module*> kept;
  std::vector<std::vector<Parameter*>> kept_params;
  for (size_t i = 0; i < units->size(); ++i)
    if (!forward[i].empty()) {
      kept.push_back((*units)[i]);
      kept_params.push_back(forward[i]);
    }
  *units = kept;
  // Backward order: the last unit first, the root unit (embeddings, final norm, head) last.
  group_params->assign(kept_params.rbegin(), kept_params.rend());
  std::vector<Parameter*> rest;
  for (Parameter* p : params)
    if (!in_unit.count(p)) rest.push_back(p);
  if (!rest.empty()) {
    group_params->push_back(rest);
    *root_unit = true;
  }
}

int FlatDataParallel::unit_of_group(int g) const {
  // Groups are [unit L-1, ..., unit 0, root]; the scheduler numbers units in forward order.
  return g < num_layer_units_ ? num_layer_units_ - 1 - g : num_layer_units_;
}

int FlatDataParallel::group_of_unit(int unit) const {
  return unit < num_layer_units_ ? num_layer_units_ - 1 - unit : num_layer_units_;
}

WorkPtr FlatDataParallel::start_group_gather(int gi) {
  if (resident_) return completed_work();  // the shard is the gathered buffer
  Group& g = groups_[gi];
  g.flat->materialize();
  const FlatLayout& l = g.flat->layout();
  Tensor wire = g.flat->full();
  if (!l.wire_is_flat()) {
    wire = Tensor::empty({l.padded_numel}, g.flat->dtype(), device_, MemCategory::Comm);
    g.wire = wire;
  }
  Tensor chunk = flat_view(wire, comm_.rank() * l.shard_numel, {l.shard_numel});
  chunk.copy_(g.shard);
  count_gather(gi, static_cast<int64_t>(wire.nbytes()));
  return comm_.all_gather(wire, chunk);
}

void FlatDataParallel::finish_group_gather(int gi) {
  Group& g = groups_[gi];
  if (!g.wire.defined()) return;
  NoGradGuard no_grad;
  g.flat->layout().unpack(g.wire, g.flat->full());  // copy-out
  g.wire = Tensor();
}

void FlatDataParallel::release_group(int gi) {
  groups_[gi].wire = Tensor();
  if (!resident_) groups_[gi].flat->release();
}

void FlatDataParallel::count_gather(int gi, int64_t bytes) {
  GroupComm& c = group_comm_.at(gi);
  ++c.all_gathers;
  c.all_gather_bytes += bytes;
}

void FlatDataParallel::reset_group_comm() {
  for (GroupComm& c : group_comm_) c = GroupComm{};
}

void FlatDataParallel::setup(Module& model, const OptimizerOptions& opts) {
  if (!groups_.empty()) throw std::logic_error(name() + ": setup called twice");
  const int stage = options_.zero_stage;
  const int world = comm_.size(), rank = comm_.rank();
  const DType cdt = options_.compute_dtype;
  std::vector<Parameter*> all = own_params(model);
  if (all.empty())
    throw std::invalid_argument(name() + ": the model has no parameters" +
                                (options_.param_filter ? " of this engine's share" : ""));
  for (size_t i = 0; i < all.size(); ++i) {
    model_order_[all[i]->name] = static_cast<int64_t>(i);
    model_names_.push_back(all[i]->name);
  }
  device_ = all[0]->value.device();
  for (Parameter* p : all) {
    if (p->value.dtype() != DType::F32)
      throw std::logic_error("strategy setup expects fp32 parameters, " + p->name + " is " +
                             dtype_name(p->value.dtype()));
    if (p->value.device() != device_)
      throw std::logic_error("strategy setup expects every parameter on " + device_.str() + ", " +
                             p->name + " is on " + p->value.device().str());
  }

  std::vector<std::vector<Parameter*>> group_params;
  std::vector<Module*> units;
  bool root_unit = false;
  build_groups(model, &group_params, &units, &root_unit);
  num_layer_units_ = static_cast<int>(units.size());

  const Device host = Device::cpu();
  const Device master_dev = options_.offload_optimizer ? host : device_;
  // fp32, or bf16 (optimizer.master_weights bf16, validated to compute in bf16): then the
  // master weights are the compute weights where they live on the same device.
  const DType mdt = opts.master_dtype;
  if (mdt != DType::F32 && mdt != cdt)
    throw std::logic_error(name() + ": " + dtype_name(mdt) + " master weights need " +
                           dtype_name(mdt) + " compute, not " + dtype_name(cdt));
  std::vector<Tensor> masters, copies;
  std::vector<std::string> names;
  std::vector<std::vector<ParamSpan>> spans;  // bf16 masters, stages 1-3
  // Compute in another dtype than the masters, both on one device: the optimizer writes the
  // compute copy in its update (one pass over the weights instead of an update and a copy).
  optimizer_writes_compute_ =
      cdt != mdt && !options_.offload_optimizer && !(stage == 3 && options_.offload_params);
  NoGradGuard no_grad;
  for (size_t gi = 0; gi < group_params.size(); ++gi) {
    Group g;
    const std::string gname = "group" + std::to_string(gi);
    // fp32 values of rank 0, flat and padded: the source of the master weights.
    FlatLayout layout(group_params[gi], world, options_.layout);
    Tensor flat32 =
        Tensor::zeros({layout.flat_numel}, DType::F32, device_, MemCategory::OptimizerState);
    for (const FlatSlot& s : layout.slots)
      flat_view(flat32, s.offset, s.shape).copy_(s.param->value);
    if (world > 1) {
      comm_.broadcast(flat32, 0)->wait();
      for (const FlatSlot& s : layout.slots)
        s.param->value.copy_(flat_view(flat32, s.offset, s.shape));
    }

    g.flat = FlatParamGroup::make(gname, group_params[gi], world, cdt, device_, options_.layout);
    const bool master_here = cdt == mdt && !options_.offload_optimizer;
    if (stage == 0) {
      // Stage 0 never offloads, so bf16 masters are always the compute buffer here.
      g.master_is_compute = master_here;
      g.master = master_here ? g.flat->full() : flat32.to(master_dev);
    } else if (stage < 3) {
      g.master_is_compute = master_here;
      if (master_here) {
        g.master = g.flat->full_chunk(rank);
      } else {
        g.master =
            Tensor::empty({layout.shard_numel}, mdt, master_dev, MemCategory::OptimizerState);
        layout.extract_shard(flat32, rank, g.master);
      }
    } else {
      const Device shard_dev = options_.offload_params ? host : device_;
      resident_ = world == 1 && !options_.offload_params && shard_may_alias_flat_buffer();
      if (resident_) {
        g.shard = g.flat->full();
      } else {
        g.shard = Tensor::empty({layout.shard_numel}, cdt, shard_dev, MemCategory::Params);
        layout.extract_shard(g.flat->full(), rank, g.shard);
      }
      g.master_is_compute = master_here && !options_.offload_params;
      if (g.master_is_compute) {
        g.master = g.shard;
      } else {
        g.master =
            Tensor::empty({layout.shard_numel}, mdt, master_dev, MemCategory::OptimizerState);
        layout.extract_shard(flat32, rank, g.master);
      }
    }
    flat32 = Tensor();
    if (stage <= 1 && options_.flat_grads) g.flat->allocate_grad();
    if (stage >= 1) {
      masters.push_back(g.master);
      names.push_back(gname);
      if (mdt == DType::BF16) {  // where each parameter's owned elements sit in the chunk
        spans.emplace_back();
        for (size_t s = 0; s < layout.slots.size(); ++s) {
          const FlatLayout::Range owned = layout.owned(s, rank);
          if (owned.size() > 0)
            spans.back().push_back(
                {layout.shard_offset(s, rank), owned.size(), layout.slots[s].name, owned.begin});
        }
      }
      if (optimizer_writes_compute_)  // where the 16-bit compute weights of the master chunk live
        copies.push_back(stage < 3 ? g.flat->full_chunk(rank) : g.shard);
    }
    groups_.push_back(std::move(g));
  }
  model_slots_.resize(all.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const std::vector<FlatSlot>& slots = groups_[gi].flat->layout().slots;
    for (size_t s = 0; s < slots.size(); ++s)
      model_slots_[model_order_.at(slots[s].name)] = {static_cast<int>(gi), s};
  }
  if (stage == 0) {
    // Stage 0 holds whole parameters: the optimizer takes each one (views of the flat buffers)
    // in model order, so its state is keyed by parameter names and a parameter without a
    // gradient can be left out of the update.
    for (const SlotRef& r : model_slots_) {
      const Group& g = groups_[r.group];
      const FlatSlot& s = g.flat->layout().slots[r.slot];
      masters.push_back(flat_view(g.master, s.offset, s.shape));
      names.push_back(s.name);
      if (optimizer_writes_compute_) copies.push_back(flat_view(g.flat->full(), s.offset, s.shape));
    }
  }
  optimizer_ =
      std::make_unique<Optimizer>(opts, masters, names, std::move(copies), std::move(spans));
  group_comm_.assign(groups_.size(), GroupComm{});
  if (!options_.flat_grads) return;  // no collectives: no grad-ready hooks

  std::vector<std::vector<Tensor>> leaves;
  std::vector<std::vector<std::string>> leaf_names;
  for (const Group& g : groups_) {
    leaves.push_back(g.flat->params());
    leaf_names.emplace_back();
    for (const FlatSlot& s : g.flat->layout().slots) leaf_names.back().push_back(s.name);
  }
  GradReadiness::Callbacks cb;
  cb.on_grad = [this](int g, int slot) {
    FlatParamGroup& f = *groups_[g].flat;
    if (!f.grad().defined()) f.allocate_grad();
    f.adopt_grad(static_cast<size_t>(slot));
  };
  cb.launch = [this](int g) { launch_reduction(g); };
  if (stage == 3) {
    cb.on_first = [this](int g) { scheduler_->backward_unit_started(unit_of_group(g)); };
    cb.on_complete = [this](int g) { scheduler_->backward_unit_done(unit_of_group(g)); };
  }
  readiness_ = std::make_unique<GradReadiness>(leaves, leaf_names, std::move(cb));

  if (stage == 3) {
    UnitScheduler::Callbacks sc;
    sc.start_gather = [this](int unit) { return start_group_gather(group_of_unit(unit)); };
    sc.finish_gather = [this](int unit) { finish_group_gather(group_of_unit(unit)); };
    sc.release = [this](int unit) { release_group(group_of_unit(unit)); };
    scheduler_ = std::make_unique<UnitScheduler>(model, units, root_unit, std::move(sc),
                                                 options_.reshard_after_forward);
    scheduler_->release_all();
  }
}

void FlatDataParallel::begin_micro_batch(bool last) {
  const int stage = options_.zero_stage;
  // Stages 0-1 keep full gradients and communicate only after the last micro-batch; 2-3 reduce
  // every micro-batch (their gradients are partitioned).
  if (!readiness_) return;  // per-parameter gradients: nothing to prepare
  readiness_->set_active(stage >= 2 || last);
  if (stage <= 1)
    for (Group& g : groups_) g.flat->attach_grad_views();
}

void FlatDataParallel::end_micro_batch() {
  if (!readiness_) return;
  if (readiness_->active()) {
    readiness_->finish(options_.find_unused_parameters);
    wait_pending(0);
  }
  if (scheduler_) scheduler_->end_backward();
  readiness_->set_active(true);
}

void FlatDataParallel::launch_reduction(int gi) {
  Group& g = groups_[gi];
  FlatParamGroup& f = *g.flat;
  const int stage = options_.zero_stage;
  if (!f.grad().defined()) f.allocate_grad();  // every parameter unused: zeros
  Pending p;
  const bool one_rank = comm_.size() == 1;  // a reduction over one rank is the identity
  if (stage == 0) {
    p.work = comm_.all_reduce(f.grad(), ReduceOp::Avg);
  } else {
    const DType rdt = stage >= 2 && options_.reduce_in_fp32 ? DType::F32 : f.dtype();
    // Stages 2-3: the first micro-batch's output becomes the gradient shard itself.
    const bool adopt = stage >= 2 && !g.shard_grad.defined();
    Tensor in = f.grad();
    if (!f.layout().wire_is_flat()) {
      // Dim-0 layout: copy-in into rank-major order (widening to the reduce dtype on the way).
      Tensor wire = Tensor::empty({f.layout().padded_numel}, rdt, device_,
                                  one_rank && adopt ? MemCategory::Grads : MemCategory::Comm);
      f.layout().pack(in, wire);
      in = wire;
    } else if (in.dtype() != rdt) {  // widen before the reduction (FSDP's fp32 reduce dtype)
      Tensor wide = Tensor::empty(in.shape(), rdt, device_,
                                  one_rank && adopt ? MemCategory::Grads : MemCategory::Comm);
      wide.copy_(in);
      in = wide;
    }
    Tensor out = in;
    if (one_rank) {
      p.work = completed_work();
    } else {
      out = Tensor::empty({f.layout().shard_numel}, rdt, device_,
                          adopt ? MemCategory::Grads : MemCategory::Comm);
      p.work = comm_.reduce_scatter(out, in, ReduceOp::Avg);
      ++group_comm_[gi].reduce_scatters;
      group_comm_[gi].reduce_scatter_bytes += static_cast<int64_t>(in.nbytes());
    }
    if (stage == 1) {
      Tensor chunk = f.grad_chunk(comm_.rank());
      if (!one_rank) p.done = [chunk, out] { chunk.copy_(out); };
    } else {
      f.free_grad();  // `in` stays alive until the reduction is done
      p.done = [this, gi, out, in] {
        Group& owner = groups_[gi];
        if (owner.shard_grad.defined())
          kernels::accumulate(owner.shard_grad, out);
        else
          owner.shard_grad = out;
      };
    }
  }
  pending_.push_back(std::move(p));
  if (stage >= 1) wait_pending(kMaxInFlight);
}

void FlatDataParallel::wait_pending(size_t keep) {
  while (pending_.size() > keep) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    p.work->wait();
    if (p.done) p.done();
  }
}

std::vector<Tensor> FlatDataParallel::owned_grads() const {
  std::vector<Tensor> out;
  const int stage = options_.zero_stage;
  if (stage == 0) {
    for (const SlotRef& r : model_slots_) {
      const FlatParamGroup& f = *groups_[r.group].flat;
      const FlatSlot& s = f.layout().slots[r.slot];
      out.push_back(options_.flat_grads ? flat_view(f.grad(), s.offset, s.shape)
                                        : f.params()[r.slot].grad());
    }
    return out;
  }
  for (const Group& g : groups_) {
    if (stage == 1)
      out.push_back(g.flat->grad_chunk(comm_.rank()));
    else if (g.shard_grad.defined())
      out.push_back(g.shard_grad);
    else
      throw std::logic_error(name() + ": " + g.flat->name() +
                             " has no reduced gradient this step (no micro-batch reduced it)");
  }
  return out;
}

void FlatDataParallel::refresh_compute(bool after_update) {
  NoGradGuard no_grad;
  const int stage = options_.zero_stage, rank = comm_.rank();
  // After an update the optimizer has already written this rank's compute weights.
  const bool copy = !(after_update && optimizer_writes_compute_);
  std::vector<WorkPtr> works;
  for (Group& g : groups_) {
    if (stage == 0) {
      if (!g.master_is_compute && copy) g.flat->full().copy_(g.master);
    } else if (stage < 3) {
      Tensor chunk = g.flat->full_chunk(rank);
      if (!g.master_is_compute && copy) chunk.copy_(g.master);
      works.push_back(comm_.all_gather(g.flat->full(), chunk));
    } else if (!g.master_is_compute && copy) {
      g.shard.copy_(g.master);
    }
  }
  for (const WorkPtr& w : works) w->wait();
}

// Each rank scans the gradient elements it owns (all of them at stage 0) parameter by parameter;
// one MAX all-reduce of (count - index) then gives the smallest model index over the ranks.
std::string FlatDataParallel::first_non_finite_param(const std::vector<Tensor>& grads) {
  NoGradGuard no_grad;
  const int stage = options_.zero_stage, rank = comm_.rank();
  const int64_t count = static_cast<int64_t>(model_order_.size());
  int64_t first = count;
  if (stage == 0) {  // grads are per parameter, in model order
    for (int64_t i = 0; i < count && first == count; ++i)
      if (grads[i].defined() && has_non_finite(grads[i])) first = i;
  } else {  // grads are this rank's chunk of each group
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const FlatLayout& l = groups_[gi].flat->layout();
      for (size_t s = 0; s < l.slots.size(); ++s) {
        const int64_t index = model_order_.at(l.slots[s].name);
        const FlatLayout::Range owned = l.owned(s, rank);
        if (index >= first || owned.size() == 0) continue;
        if (has_non_finite(flat_view(grads[gi], l.shard_offset(s, rank), {owned.size()})))
          first = index;
      }
    }
  }
  Tensor best = Tensor::from_vector(std::vector<double>{static_cast<double>(count - first)}, {1},
                                    DType::F32, device_);
  comm_.all_reduce(best, ReduceOp::Max)->wait();
  first = count - static_cast<int64_t>(best.item());
  if (first >= count) return "";  // finite everywhere: the norm overflowed
  return model_names_.at(static_cast<size_t>(first));
}

std::vector<Tensor> FlatDataParallel::finish_gradients() {
  if (readiness_ && readiness_->pending()) end_micro_batch();
  wait_pending(0);
  return owned_grads();
}

double FlatDataParallel::grad_sum_of_squares(const std::vector<Tensor>& grads) {
  std::vector<Tensor> present;  // per-parameter gradients: parameters without one are skipped
  for (const Tensor& t : grads)
    if (t.defined()) present.push_back(t);
  // As global_grad_norm, without the root: step()'s norm stays bit-identical to before.
  const double sq = sum_of_squares(present);
  return options_.zero_stage >= 1 ? comm_.sum(sq, device_) : sq;
}

std::string FlatDataParallel::first_non_finite(const std::vector<Tensor>& grads) {
  return first_non_finite_param(grads);
}

void FlatDataParallel::apply_update(const std::vector<Tensor>& grads, double lr,
                                    double multiplier) {
  std::vector<Tensor> opt_grads = grads;
  if (options_.offload_optimizer)
    for (Tensor& t : opt_grads) t = t.to(Device::cpu());
  optimizer_->step(opt_grads, lr, multiplier);
  refresh_compute(/*after_update=*/true);
}

void FlatDataParallel::clear_gradients() {
  const int stage = options_.zero_stage;
  for (Group& g : groups_) {
    if (!options_.flat_grads)
      for (const Tensor& p : g.flat->params()) p.zero_grad();  // drops it, as autograd made it
    else if (stage <= 1)
      g.flat->grad().zero_();
    else
      g.shard_grad = Tensor();  // the next reduction makes a new one
  }
}

StepResult FlatDataParallel::step(double lr, double max_grad_norm, double grad_scale) {
  std::vector<Tensor> grads = finish_gradients();
  StepResult r;
  r.grad_norm = std::sqrt(grad_sum_of_squares(grads)) * grad_scale;
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;
    r.first_non_finite = first_non_finite(grads);
  } else {
    apply_update(grads, lr, grad_scale * clip_coefficient(r.grad_norm, max_grad_norm));
  }
  clear_gradients();
  return r;
}

Tensor FlatDataParallel::gather_group_master(int gi) {
  Group& g = groups_[gi];
  if (options_.zero_stage == 0) return g.master;
  const FlatLayout& l = g.flat->layout();
  const DType mdt = g.master.dtype();
  Tensor wire = Tensor::empty({l.padded_numel}, mdt, device_, MemCategory::Other);
  Tensor chunk = flat_view(wire, comm_.rank() * l.shard_numel, {l.shard_numel});
  chunk.copy_(g.master);
  comm_.all_gather(wire, chunk)->wait();
  if (l.wire_is_flat()) return wire;
  Tensor full = Tensor::empty({l.flat_numel}, mdt, device_, MemCategory::Other);
  l.unpack(wire, full);  // copy-out
  return full;
}

std::vector<std::pair<std::string, Tensor>> FlatDataParallel::gather_master_weights() {
  NoGradGuard no_grad;
  std::vector<std::pair<std::string, Tensor>> out;
  if (options_.zero_stage == 0) {  // the masters are whole: views of them, in model order
    for (const SlotRef& r : model_slots_) {
      const FlatSlot& s = groups_[r.group].flat->layout().slots[r.slot];
      out.push_back({s.name, flat_view(groups_[r.group].master, s.offset, s.shape)});
    }
    return out;
  }
  for (int gi = 0; gi < num_groups(); ++gi) {
    Tensor full32 = gather_group_master(gi);
    for (const FlatSlot& s : groups_[gi].flat->layout().slots)
      out.push_back({s.name, flat_view(full32, s.offset, s.shape)});
  }
  return out;
}

std::vector<StateDictEntry> FlatDataParallel::master_weights_layout() const {
  std::vector<StateDictEntry> out;
  if (options_.zero_stage == 0) {  // views of the whole masters, in model order
    for (const SlotRef& r : model_slots_) {
      const FlatSlot& s = groups_[r.group].flat->layout().slots[r.slot];
      const Tensor& master = groups_[r.group].master;
      out.push_back({s.name, s.shape, master.dtype(), master.device()});
    }
    return out;
  }
  // gather_group_master: each group's flat master buffer on the compute device, in group order.
  for (const Group& g : groups_)
    for (const FlatSlot& s : g.flat->layout().slots)
      out.push_back({s.name, s.shape, g.master.dtype(), device_});
  return out;
}

std::vector<StateDictEntry> FlatDataParallel::full_state_dict_layout() const {
  if (options_.zero_stage < 3) return master_weights_layout();
  std::vector<StateDictEntry> out;
  if (!options_.save_16bit_model) return out;
  for (const Group& g : groups_)
    for (const FlatSlot& s : g.flat->layout().slots)
      out.push_back({s.name, s.shape, options_.compute_dtype, device_});
  return out;
}

std::vector<std::pair<std::string, Tensor>> FlatDataParallel::full_state_dict() {
  if (options_.zero_stage < 3) return gather_master_weights();
  std::vector<std::pair<std::string, Tensor>> out;
  if (!options_.save_16bit_model) return out;
  // One unit at a time, so the extra memory is one unit in fp32 plus the model in 16 bits.
  NoGradGuard no_grad;
  for (int gi = 0; gi < num_groups(); ++gi) {
    Tensor full32 = gather_group_master(gi);
    for (const FlatSlot& s : groups_[gi].flat->layout().slots) {
      Tensor w = Tensor::empty(s.shape, options_.compute_dtype, device_, MemCategory::Other);
      w.copy_(flat_view(full32, s.offset, s.shape));
      out.push_back({s.name, w});
    }
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> FlatDataParallel::optimizer_state() {
  std::vector<std::pair<std::string, Tensor>> st = optimizer_->state_tensors();
  if (options_.zero_stage == 0) return st;  // per parameter: "<param>.exp_avg", ...
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Group& g : groups_) out.push_back({g.flat->name() + ".master", g.master});
  out.insert(out.end(), st.begin(), st.end());
  return out;
}

int64_t FlatDataParallel::optimizer_steps() const { return optimizer_->step_count(); }

void FlatDataParallel::load_state(
    const std::vector<std::pair<std::string, Tensor>>& full_weights,
    const std::vector<std::pair<std::string, Tensor>>& optimizer_state, int64_t optimizer_steps) {
  std::map<std::string, Tensor> weights(full_weights.begin(), full_weights.end());
  std::map<std::string, Tensor> state(optimizer_state.begin(), optimizer_state.end());
  const int stage = options_.zero_stage, rank = comm_.rank();
  NoGradGuard no_grad;
  auto weight = [&](const FlatSlot& s) -> const Tensor& {
    auto it = weights.find(s.name);
    if (it == weights.end()) throw std::runtime_error("checkpoint has no weight '" + s.name + "'");
    if (it->second.shape() != s.shape)
      throw std::runtime_error("checkpoint weight '" + s.name + "' has shape " +
                               shape_str(it->second.shape()) + ", the model expects " +
                               shape_str(s.shape));
    return it->second;
  };
  auto tensor = [&](const std::string& key, const Shape& shape) -> const Tensor& {
    auto it = state.find(key);
    if (it == state.end())
      throw std::runtime_error("checkpoint optimizer state has no tensor '" + key +
                               "' (was it written by another strategy?)");
    if (it->second.shape() != shape)
      throw std::runtime_error(
          "checkpoint optimizer state tensor '" + key + "' has shape " +
          shape_str(it->second.shape()) + ", this run's layout needs " + shape_str(shape) +
          "; resume with the same num_processes, zero_stage and distributed.ddp_bucket_cap_mb "
          "as the run that wrote it");
    return it->second;
  };

  std::vector<std::pair<std::string, Tensor>> group_state;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    const FlatLayout& l = g.flat->layout();
    if (stage == 0) {
      for (const FlatSlot& s : l.slots) flat_view(g.master, s.offset, s.shape).copy_(weight(s));
      continue;
    }
    const std::string key = g.flat->name() + ".master";
    if (state.count(key)) {
      g.master.copy_(tensor(key, {l.shard_numel}));
    } else {
      Tensor full32 = Tensor::zeros({l.flat_numel}, DType::F32, Device::cpu());
      for (const FlatSlot& s : l.slots) flat_view(full32, s.offset, s.shape).copy_(weight(s));
      l.extract_shard(full32, rank, g.master);
    }
  }
  // Optimizer state under the optimizer's own names ("<param>.<suffix>" at stage 0,
  // "group<i>.<suffix>" otherwise).
  for (const auto& [key, t] : optimizer_->state_tensors())
    group_state.push_back({key, tensor(key, t.shape())});
  optimizer_->load_state(group_state, optimizer_steps);
  refresh_compute(/*after_update=*/false);
}

nlohmann::json FlatDataParallel::checkpoint_manifest() const {
  nlohmann::json groups = nlohmann::json::array();
  for (const Group& g : groups_) {
    nlohmann::json j = g.flat->layout().to_json();
    j["name"] = g.flat->name();
    groups.push_back(j);
  }
  return {{"strategy", name()},
          {"zero_stage", options_.zero_stage},
          {"world_size", comm_.size()},
          {"compute_dtype", dtype_name(options_.compute_dtype)},
          {"bucket_cap_mb", options_.bucket_cap_mb},
          {"sharded", options_.zero_stage >= 1},
          {"groups", groups}};
}

FlatDataParallel::HeldRange FlatDataParallel::held_range(size_t index) const {
  const SlotRef& r = model_slots_.at(index);
  const Group& g = groups_[r.group];
  const FlatLayout& l = g.flat->layout();
  HeldRange h;
  h.slot = &l.slots[r.slot];
  h.master = &g.master;
  if (options_.zero_stage == 0) {  // whole parameters; the optimizer keys them by name
    h.size = h.slot->numel;
    h.at = h.slot->offset;
    h.state_prefix = h.slot->name + ".";
    return h;
  }
  const int rank = comm_.rank();
  const FlatLayout::Range owned = l.owned(r.slot, rank);
  h.begin = owned.begin;
  h.size = owned.size();
  h.at = h.size > 0 ? l.shard_offset(r.slot, rank) : 0;
  h.state_prefix = g.flat->name() + ".";
  return h;
}

std::vector<std::string> FlatDataParallel::state_kinds() const {
  // The optimizer lists its tensors per parameter, the same suffixes for each.
  const std::vector<std::pair<std::string, Tensor>> st = optimizer_->state_tensors();
  const std::vector<std::string>& names = optimizer_->names();
  std::vector<std::string> kinds = {"master"};
  if (names.empty()) return kinds;
  const size_t per = st.size() / names.size();
  for (size_t i = 0; i < per; ++i) kinds.push_back(st[i].first.substr(names[0].size() + 1));
  return kinds;
}

std::vector<ParamStateSlice> FlatDataParallel::param_state_slices() {
  std::map<std::string, Tensor> state;
  for (const auto& [key, t] : optimizer_->state_tensors()) state[key] = t;
  const std::vector<std::string> kinds = state_kinds();
  std::vector<ParamStateSlice> out;
  for (size_t i = 0; i < model_slots_.size(); ++i) {
    const HeldRange h = held_range(i);
    if (h.size == 0) continue;  // this rank holds none of it (a small parameter, many ranks)
    ParamStateSlice p;
    p.name = h.slot->name;
    p.shape = h.slot->shape;
    p.begin = h.begin;
    p.end = h.begin + h.size;
    p.tensors.push_back({"master", flat_view(*h.master, h.at, {h.size})});
    const int64_t at = options_.zero_stage == 0 ? 0 : h.at;  // stage 0: the parameter's own
    for (size_t k = 1; k < kinds.size(); ++k)
      p.tensors.push_back({kinds[k], flat_view(state.at(h.state_prefix + kinds[k]), at, {h.size})});
    out.push_back(std::move(p));
  }
  return out;
}

void FlatDataParallel::import_param_state(const ParamStateReader& read, int64_t optimizer_steps) {
  NoGradGuard no_grad;
  const std::vector<std::pair<std::string, Tensor>> live = optimizer_->state_tensors();
  std::map<std::string, Tensor> state(live.begin(), live.end());
  const std::vector<std::string> kinds = state_kinds();
  // Shard padding (and whatever a parameter's range leaves out) holds zeros, as after setup.
  if (options_.zero_stage > 0) {
    for (Group& g : groups_) g.master.zero_();
    for (const auto& [key, t] : live) t.zero_();
  }
  for (size_t i = 0; i < model_slots_.size(); ++i) {
    const HeldRange h = held_range(i);
    if (h.size == 0) continue;
    Tensor buf = Tensor::empty({h.size}, DType::F32, Device::cpu(), MemCategory::Other);
    read(h.slot->name, "master", h.begin, buf);
    flat_view(*h.master, h.at, {h.size}).copy_(buf);
    const int64_t at = options_.zero_stage == 0 ? 0 : h.at;
    for (size_t k = 1; k < kinds.size(); ++k) {
      read(h.slot->name, kinds[k], h.begin, buf);
      flat_view(state.at(h.state_prefix + kinds[k]), at, {h.size}).copy_(buf);
    }
  }
  optimizer_->load_state(live, optimizer_steps);  // the step count (the tensors are in place)
  refresh_compute(/*after_update=*/false);
}

}  // namespace accel
