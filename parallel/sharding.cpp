#include "parallel/sharding.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "ops/ops.h"
#include "runtime/kernels.h"

namespace accel {

// ---- collectives ---------------------------------------------------------------------------

namespace {
class CompletedWork : public Work {
 public:
  bool is_completed() override { return true; }
  void wait() override {}
  void wait(Millis) override {}
};
}  // namespace

WorkPtr completed_work() { return std::make_shared<CompletedWork>(); }

WorkPtr Comm::all_reduce(const Tensor& t, ReduceOp op) const {
  if (size() == 1) return completed_work();
  return pg_->all_reduce(t, op);
}

WorkPtr Comm::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) const {
  if (size() == 1) {
    if (out.data_ptr() != in.data_ptr()) out.copy_(in);
    return completed_work();
  }
  return pg_->reduce_scatter(out, in, op);
}

WorkPtr Comm::all_gather(const Tensor& out, const Tensor& in) const {
  if (size() == 1) {
    if (out.data_ptr() != in.data_ptr()) out.copy_(in);
    return completed_work();
  }
  return pg_->all_gather(out, in);
}

WorkPtr Comm::broadcast(const Tensor& t, int root) const {
  if (size() == 1) return completed_work();
  return pg_->broadcast(t, root);
}

double Comm::sum(double v, Device device) const {
  if (size() == 1) return v;
  Tensor t = Tensor::full({1}, v, DType::F64, Device::cpu());
  if (pg_->backend() == "nccl") t = t.to(device);
  pg_->all_reduce(t, ReduceOp::Sum)->wait();
  return t.item();
}

// ---- layout --------------------------------------------------------------------------------

namespace {
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
}  // namespace

FlatLayout::FlatLayout(const std::vector<Parameter*>& params, int world_size, Mode m)
    : mode(m), world(world_size) {
  std::vector<FlatSlot> s;
  for (Parameter* p : params) {
    FlatSlot slot;
    slot.param = p;
    slot.name = p->name;
    slot.shape = p->value.shape();
    s.push_back(std::move(slot));
  }
  build(std::move(s));
}

FlatLayout::FlatLayout(const std::vector<std::pair<std::string, Shape>>& params, int world_size,
                       Mode m)
    : mode(m), world(world_size) {
  std::vector<FlatSlot> s;
  for (const auto& [name, shape] : params) {
    FlatSlot slot;
    slot.name = name;
    slot.shape = shape;
    s.push_back(std::move(slot));
  }
  build(std::move(s));
}

void FlatLayout::build(std::vector<FlatSlot> s) {
  if (world < 1) throw std::logic_error("FlatLayout: world size must be >= 1");
  slots = std::move(s);
  numel = 0;
  int64_t per_rank_dim0 = 0;
  for (FlatSlot& slot : slots) {
    slot.numel = shape_numel(slot.shape);
    slot.offset = numel;
    numel += slot.numel;
    slot.rows = slot.shape.empty() ? 1 : slot.shape[0];
    slot.row_numel = slot.rows > 0 ? slot.numel / slot.rows : 0;
    slot.rows_per_rank = (slot.rows + world - 1) / world;
    slot.shard_offset = per_rank_dim0;
    per_rank_dim0 += slot.rows_per_rank * slot.row_numel;
  }
  if (mode == Mode::Contiguous) {
    shard_numel = round_up((numel + world - 1) / world, kFlatAlignment);
    padded_numel = shard_numel * world;
    flat_numel = padded_numel;
  } else {
    shard_numel = round_up(per_rank_dim0, kFlatAlignment);
    padded_numel = shard_numel * world;
    flat_numel = round_up(numel, kFlatAlignment);
  }
}

FlatLayout::Range FlatLayout::owned(size_t slot, int rank) const {
  const FlatSlot& s = slots.at(slot);
  if (mode == Mode::Dim0) {
    const int64_t lo = std::min<int64_t>(rank * s.rows_per_rank, s.rows);
    const int64_t hi = std::min<int64_t>((rank + 1) * s.rows_per_rank, s.rows);
    if (hi <= lo) return {};
    return {lo * s.row_numel, hi * s.row_numel};
  }
  int64_t lo = std::max(s.offset, rank * shard_numel);
  int64_t hi = std::min(s.offset + s.numel, (rank + 1) * shard_numel);
  if (hi <= lo) return {};
  return {lo - s.offset, hi - s.offset};
}

int64_t FlatLayout::shard_offset(size_t slot, int rank) const {
  const FlatSlot& s = slots.at(slot);
  if (mode == Mode::Dim0) return s.shard_offset;
  return s.offset + owned(slot, rank).begin - rank * shard_numel;
}

namespace {
void check_numel(const Tensor& t, int64_t n, const char* what) {
  if (t.numel() != n)
    throw std::logic_error(std::string("FlatLayout: ") + what + " has " +
                           std::to_string(t.numel()) + " elements, the layout needs " +
                           std::to_string(n));
}
}  // namespace

// Dim0 copy-in/copy-out move each rank's rows of each slot as one contiguous run (the GPU's
// vectorized copy). With one 2-d strided view per slot instead (the generic strided copy path),
// FSDP llama-1b on two H200s ran 27% slower end to end. Only the padding of the wire is zeroed.
void FlatLayout::pack(const Tensor& flat, const Tensor& wire) const {
  check_numel(flat, flat_numel, "the flat buffer");
  check_numel(wire, padded_numel, "the wire buffer");
  if (mode == Mode::Contiguous) {
    if (wire.storage() != flat.storage() || wire.offset() != flat.offset()) wire.copy_(flat);
    return;
  }
  int64_t used = 0;  // elements of a shard the slots occupy (the rest is padding)
  for (const FlatSlot& s : slots)
    used = std::max(used, s.shard_offset + s.rows_per_rank * s.row_numel);
  for (int q = 0; q < world; ++q) {
    for (size_t i = 0; i < slots.size(); ++i) {
      const FlatSlot& s = slots[i];
      const int64_t len = s.rows_per_rank * s.row_numel;
      const Range r = owned(i, q);
      const int64_t at = q * shard_numel + s.shard_offset;
      if (r.size() > 0)
        flat_view(wire, at, {r.size()}).copy_(flat_view(flat, s.offset + r.begin, {r.size()}));
      if (r.size() < len) flat_view(wire, at + r.size(), {len - r.size()}).zero_();
    }
    if (used < shard_numel) flat_view(wire, q * shard_numel + used, {shard_numel - used}).zero_();
  }
}

void FlatLayout::unpack(const Tensor& wire, const Tensor& flat) const {
  check_numel(flat, flat_numel, "the flat buffer");
  check_numel(wire, padded_numel, "the wire buffer");
  if (mode == Mode::Contiguous) {
    if (wire.storage() != flat.storage() || wire.offset() != flat.offset()) flat.copy_(wire);
    return;
  }
  for (int q = 0; q < world; ++q)
    for (size_t i = 0; i < slots.size(); ++i) {
      const Range r = owned(i, q);
      if (r.size() > 0)
        flat_view(flat, slots[i].offset + r.begin, {r.size()})
            .copy_(flat_view(wire, q * shard_numel + slots[i].shard_offset, {r.size()}));
    }
  if (flat_numel > numel) flat_view(flat, numel, {flat_numel - numel}).zero_();
}

void FlatLayout::extract_shard(const Tensor& flat, int rank, const Tensor& shard) const {
  check_numel(flat, flat_numel, "the flat buffer");
  check_numel(shard, shard_numel, "the shard");
  if (mode == Mode::Contiguous) {
    shard.copy_(flat_view(flat, rank * shard_numel, {shard_numel}));
    return;
  }
  shard.zero_();
  for (size_t i = 0; i < slots.size(); ++i) {
    Range r = owned(i, rank);
    if (r.size() == 0) continue;
    flat_view(shard, shard_offset(i, rank), {r.size()})
        .copy_(flat_view(flat, slots[i].offset + r.begin, {r.size()}));
  }
}

void FlatLayout::insert_shard(const Tensor& shard, int rank, const Tensor& flat) const {
  check_numel(flat, flat_numel, "the flat buffer");
  check_numel(shard, shard_numel, "the shard");
  for (size_t i = 0; i < slots.size(); ++i) {
    Range r = owned(i, rank);
    if (r.size() == 0) continue;
    flat_view(flat, slots[i].offset + r.begin, {r.size()})
        .copy_(flat_view(shard, shard_offset(i, rank), {r.size()}));
  }
}

nlohmann::json FlatLayout::to_json() const {
  nlohmann::json params = nlohmann::json::array();
  for (const FlatSlot& s : slots) {
    nlohmann::json p = {{"name", s.name}, {"shape", s.shape}, {"offset", s.offset}};
    if (mode == Mode::Dim0) {
      p["rows_per_rank"] = s.rows_per_rank;
      p["shard_offset"] = s.shard_offset;
    }
    params.push_back(p);
  }
  return {{"layout", mode_name(mode)},
          {"numel", numel},
          {"padded_numel", padded_numel},
          {"shard_numel", shard_numel},
          {"flat_numel", flat_numel},
          {"world", world},
          {"params", params}};
}

FlatLayout FlatLayout::from_json(const nlohmann::json& j) {
  const std::string m = j.value("layout", std::string("contiguous"));
  if (m != "contiguous" && m != "dim0")
    throw std::runtime_error("shard layout '" + m + "' is not known (contiguous or dim0)");
  std::vector<std::pair<std::string, Shape>> params;
  for (const nlohmann::json& p : j.at("params"))
    params.push_back({p.at("name").get<std::string>(), p.at("shape").get<Shape>()});
  FlatLayout l(params, j.at("world").get<int>(), m == "dim0" ? Mode::Dim0 : Mode::Contiguous);
  auto mismatch = [&](const std::string& what) {
    throw std::runtime_error("shard layout: " + what +
                             " in the manifest differs from the layout its parameters give (was "
                             "it written by another version?)");
  };
  if (j.at("shard_numel").get<int64_t>() != l.shard_numel) mismatch("shard_numel");
  if (j.at("padded_numel").get<int64_t>() != l.padded_numel) mismatch("padded_numel");
  size_t i = 0;
  for (const nlohmann::json& p : j.at("params")) {
    const FlatSlot& s = l.slots[i++];
    if (p.at("offset").get<int64_t>() != s.offset) mismatch("the offset of " + s.name);
    if (l.mode == Mode::Dim0 && (p.at("shard_offset").get<int64_t>() != s.shard_offset ||
                                 p.at("rows_per_rank").get<int64_t>() != s.rows_per_rank))
      mismatch("the dim-0 split of " + s.name);
  }
  return l;
}

std::vector<std::vector<Parameter*>> make_buckets(const std::vector<Parameter*>& params,
                                                  double cap_bytes, size_t element_size) {
  std::vector<std::vector<Parameter*>> out;
  double bytes = 0;
  for (Parameter* p : params) {
    double b = static_cast<double>(p->value.numel()) * static_cast<double>(element_size);
    if (out.empty() || (!out.back().empty() && bytes + b > cap_bytes)) {
      out.emplace_back();
      bytes = 0;
    }
    out.back().push_back(p);
    bytes += b;
  }
  return out;
}

// ---- storage -------------------------------------------------------------------------------

void release_storage(Storage& s) {
  if (!s.data && s.nbytes == 0) return;
  // A temporary owner frees the bytes through the allocator and un-counts them.
  { Storage owner(s.data, s.nbytes, s.device, s.category); }
  s.data = nullptr;
  s.nbytes = 0;
}

void materialize_storage(Storage& s, size_t nbytes) {
  if (s.data || s.nbytes)
    throw std::logic_error("materialize_storage: storage already holds bytes");
  std::shared_ptr<Storage> fresh = allocate_storage(nbytes, s.device, s.category);
  s.data = fresh->data;
  s.nbytes = fresh->nbytes;
  // The bytes (and their accounting) now belong to `s`; `fresh` frees nothing.
  fresh->data = nullptr;
  fresh->nbytes = 0;
}

bool storage_materialized(const Storage& s) { return s.data != nullptr || s.nbytes > 0; }

Tensor flat_view(const Tensor& flat, int64_t offset, const Shape& shape) {
  if (offset < 0 || offset + shape_numel(shape) > flat.numel())
    throw std::logic_error("flat_view: [" + std::to_string(offset) + ", +" +
                           std::to_string(shape_numel(shape)) + ") outside " + flat.str());
  return Tensor::from_storage(flat.storage(), flat.dtype(), shape, contiguous_strides(shape),
                              flat.offset() + offset);
}

// ---- flat parameter group ------------------------------------------------------------------

std::unique_ptr<FlatParamGroup> FlatParamGroup::make(std::string name,
                                                     const std::vector<Parameter*>& params,
                                                     int world, DType dtype, Device device,
                                                     FlatLayout::Mode mode) {
  std::unique_ptr<FlatParamGroup> g(new FlatParamGroup);
  g->name_ = std::move(name);
  g->layout_ = FlatLayout(params, world, mode);
  g->dtype_ = dtype;
  g->device_ = device;
  g->full_ = Tensor::zeros({g->layout_.flat_numel}, dtype, device, MemCategory::Params);
  NoGradGuard no_grad;
  for (const FlatSlot& s : g->layout_.slots) {
    Tensor leaf = flat_view(g->full_, s.offset, s.shape);
    leaf.copy_(s.param->value);
    leaf.set_requires_grad(true);
    leaf.set_name(s.name);
    s.param->value = leaf;  // the old tensor is freed unless someone else holds it
    g->params_.push_back(leaf);
  }
  return g;
}

Tensor FlatParamGroup::full_chunk(int rank) const {
  if (!layout_.wire_is_flat())
    throw std::logic_error(
        "FlatParamGroup::full_chunk: the dim-0 layout has no chunk of the flat "
        "buffer per rank (use FlatLayout::extract_shard)");
  return flat_view(full_, rank * layout_.shard_numel, {layout_.shard_numel});
}

void FlatParamGroup::release() { release_storage(*full_.storage()); }

void FlatParamGroup::materialize() {
  if (materialized()) return;
  materialize_storage(*full_.storage(),
                      static_cast<size_t>(layout_.flat_numel) * dtype_size(dtype_));
}

Tensor FlatParamGroup::grad_chunk(int rank) const {
  if (!layout_.wire_is_flat())
    throw std::logic_error("FlatParamGroup::grad_chunk: not with the dim-0 layout");
  return flat_view(grad_, rank * layout_.shard_numel, {layout_.shard_numel});
}

void FlatParamGroup::allocate_grad() {
  if (!grad_.defined())
    grad_ = Tensor::zeros({layout_.flat_numel}, dtype_, device_, MemCategory::Grads);
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].grad().defined())
      params_[i].set_grad(flat_view(grad_, layout_.slots[i].offset, layout_.slots[i].shape));
}

void FlatParamGroup::adopt_grad(size_t slot) {
  const Tensor& p = params_.at(slot);
  const FlatSlot& s = layout_.slots[slot];
  Tensor g = p.grad();
  if (g.defined() && g.storage() == grad_.storage() && g.offset() == grad_.offset() + s.offset)
    return;  // already accumulating in place
  Tensor view = flat_view(grad_, s.offset, s.shape);
  if (g.defined()) kernels::accumulate(view, g.is_contiguous() ? g : g.clone());
  p.set_grad(view);
}

void FlatParamGroup::attach_grad_views() {
  if (!grad_.defined()) return;
  for (size_t i = 0; i < params_.size(); ++i) adopt_grad(i);
}

void FlatParamGroup::free_grad() {
  for (const Tensor& p : params_) p.zero_grad();
  grad_ = Tensor();
}

// ---- gradient readiness --------------------------------------------------------------------

struct GradReadiness::State {
  Callbacks cb;
  std::vector<std::vector<std::string>> names;
  std::vector<std::vector<char>> ready;
  std::vector<int> count;
  int next_launch = 0;
  bool active = true;
  bool seen = false;

  int size(int b) const { return static_cast<int>(ready[b].size()); }

  void on_ready(int b, int s) {
    if (!active) return;
    if (ready[b][s])
      throw std::logic_error("the gradient of " + names[b][s] +
                             " completed twice in one backward pass (is it used in two "
                             "activation-checkpointed blocks?)");
    seen = true;
    if (count[b] == 0 && cb.on_first) cb.on_first(b);
    if (cb.on_grad) cb.on_grad(b, s);
    ready[b][s] = 1;
    if (++count[b] == size(b)) {
      if (cb.on_complete) cb.on_complete(b);
      launch_ready();
    }
  }

  void launch_ready() {
    const int n = static_cast<int>(ready.size());
    while (next_launch < n && count[next_launch] == size(next_launch)) {
      int b = next_launch++;
      if (cb.launch) cb.launch(b);
    }
  }

  void reset() {
    for (auto& r : ready) std::fill(r.begin(), r.end(), 0);
    std::fill(count.begin(), count.end(), 0);
    next_launch = 0;
    seen = false;
  }
};

GradReadiness::GradReadiness(const std::vector<std::vector<Tensor>>& buckets,
                             const std::vector<std::vector<std::string>>& names,
                             Callbacks callbacks)
    : state_(std::make_shared<State>()) {
  if (names.size() != buckets.size()) throw std::logic_error("GradReadiness: one name per leaf");
  state_->cb = std::move(callbacks);
  state_->names = names;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (names[b].size() != buckets[b].size())
      throw std::logic_error("GradReadiness: one name per leaf");
    state_->ready.emplace_back(buckets[b].size(), 0);
    state_->count.push_back(0);
    for (size_t s = 0; s < buckets[b].size(); ++s) {
      std::weak_ptr<State> weak = state_;
      int bi = static_cast<int>(b), si = static_cast<int>(s);
      buckets[b][s].add_grad_ready_hook([weak, bi, si](const Tensor&) {
        if (auto st = weak.lock()) st->on_ready(bi, si);
      });
    }
  }
}

void GradReadiness::set_active(bool active) { state_->active = active; }
bool GradReadiness::active() const { return state_->active; }
bool GradReadiness::pending() const { return state_->seen; }

void GradReadiness::finish(bool allow_unused) {
  State& st = *state_;
  if (!st.active || !st.seen) {
    st.reset();
    return;
  }
  std::vector<std::string> unused;
  for (size_t b = 0; b < st.ready.size(); ++b)
    for (size_t s = 0; s < st.ready[b].size(); ++s)
      if (!st.ready[b][s]) {
        unused.push_back(st.names[b][s]);
        if (allow_unused) {
          st.ready[b][s] = 1;
          ++st.count[b];
        }
      }
  if (!unused.empty() && !allow_unused) {
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 5; ++i) list += (i ? ", '" : "'") + unused[i] + "'";
    if (unused.size() > 5) list += " and " + std::to_string(unused.size() - 5) + " more";
    st.reset();
    throw std::runtime_error(
        "parameter" + std::string(unused.size() > 1 ? "s " : " ") + list +
        " received no gradient in this backward pass; data-parallel training reduces every "
        "parameter's gradient, so each must take part in the loss on every rank. Set "
        "distributed.find_unused_parameters: true to reduce zeros for them instead");
  }
  st.launch_ready();
  st.reset();
}

// ---- unit scheduler ------------------------------------------------------------------------

struct UnitScheduler::State {
  enum class Phase { Released, InFlight, Gathered };
  Callbacks cb;
  int layers = 0;  // units excluding the root unit
  int root = -1;   // index of the root unit, or -1
  std::vector<Phase> phase;
  std::vector<WorkPtr> work;
  bool backward_pending = false;  // a forward with recording ended; its backward has not ended
  bool reshard_after_forward = true;

  int total() const { return static_cast<int>(phase.size()); }

  void prefetch(int u) {
    if (u < 0 || u >= total() || phase[u] != Phase::Released) return;
    work[u] = cb.start_gather(u);
    phase[u] = Phase::InFlight;
  }
  void ensure(int u) {
    if (phase[u] == Phase::Gathered) return;
    prefetch(u);
    work[u]->wait_stream();
    work[u] = nullptr;
    if (cb.finish_gather) cb.finish_gather(u);
    phase[u] = Phase::Gathered;
  }
  void release(int u) {
    if (phase[u] == Phase::Released) return;
    if (phase[u] == Phase::InFlight) {
      work[u]->wait();
      work[u] = nullptr;
    }
    cb.release(u);
    phase[u] = Phase::Released;
  }
  void release_all() {
    for (int u = 0; u < total(); ++u) release(u);
  }

  void pre_root() {
    if (backward_pending) {  // the last forward had no backward (or it never ended)
      release_all();
      backward_pending = false;
    }
    if (root >= 0) ensure(root);
  }
  void post_root() {
    if (grad_enabled())
      backward_pending = true;
    else
      release_all();
  }
  void pre_unit(int u) {
    ensure(u);
    if (!backward_pending && u + 1 < layers) prefetch(u + 1);
  }
  void post_unit(int u) {
    if (backward_pending) return;  // recomputation inside backward: backward releases it
    if (grad_enabled() && (u == layers - 1 || !reshard_after_forward)) return;  // for backward
    release(u);
  }
};

UnitScheduler::UnitScheduler(Module& root, std::vector<Module*> units, bool root_unit,
                             Callbacks callbacks, bool reshard_after_forward)
    : state_(std::make_shared<State>()) {
  State& st = *state_;
  st.cb = std::move(callbacks);
  st.reshard_after_forward = reshard_after_forward;
  st.layers = static_cast<int>(units.size());
  st.root = root_unit ? st.layers : -1;
  int n = st.layers + (root_unit ? 1 : 0);
  st.phase.assign(n, State::Phase::Gathered);  // make() leaves parameters materialized
  st.work.assign(n, nullptr);
  std::weak_ptr<State> weak = state_;
  for (int u = 0; u < st.layers; ++u) {
    units[u]->add_pre_forward_hook([weak, u](Module&) {
      if (auto s = weak.lock()) s->pre_unit(u);
    });
    units[u]->add_post_forward_hook([weak, u](Module&) {
      if (auto s = weak.lock()) s->post_unit(u);
    });
  }
  root.add_pre_forward_hook([weak](Module&) {
    if (auto s = weak.lock()) s->pre_root();
  });
  root.add_post_forward_hook([weak](Module&) {
    if (auto s = weak.lock()) s->post_root();
  });
}

int UnitScheduler::num_units() const { return state_->total(); }
bool UnitScheduler::gathered(int unit) const {
  return state_->phase.at(unit) == State::Phase::Gathered;
}
void UnitScheduler::ensure(int unit) { state_->ensure(unit); }
void UnitScheduler::prefetch(int unit) { state_->prefetch(unit); }
void UnitScheduler::release(int unit) { state_->release(unit); }
void UnitScheduler::release_all() { state_->release_all(); }

void UnitScheduler::backward_unit_started(int unit) {
  State& st = *state_;
  if (unit == st.root) return;
  if (st.phase[unit] != State::Phase::Gathered)
    throw std::logic_error("unit " + std::to_string(unit) +
                           " produced gradients while its parameters were not gathered");
  st.prefetch(unit - 1);
}

void UnitScheduler::backward_unit_done(int unit) {
  State& st = *state_;
  if (unit == st.root) return;  // kept until end_backward
  st.release(unit);
  if (unit >= 1) st.ensure(unit - 1);
}

void UnitScheduler::end_backward() {
  state_->release_all();
  state_->backward_pending = false;
}

// ---- gradient norm -------------------------------------------------------------------------

double global_grad_norm(const std::vector<Tensor>& grads, const Comm& comm, bool sharded,
                        Device device) {
  double sq = sum_of_squares(grads);
  if (sharded) sq = comm.sum(sq, device);
  return std::sqrt(sq);
}

}  // namespace accel
