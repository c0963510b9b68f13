// The shared core of the data-parallel strategies (DDP, ZeRO-1/2/3, and FSDP2 on top of it):
//
//   Comm            collectives that also run without a process group (world size 1)
//   FlatLayout      parameters laid end to end in one flat buffer and how it is sharded:
//                   Contiguous (ZeRO: rank r owns the chunk [r*shard, (r+1)*shard)) or Dim0
//                   (FSDP2: every parameter split on dim 0, rank-major wire with copy-in/out)
//   FlatParamGroup  one bucket (DDP, ZeRO-1/2) or one gather unit (ZeRO-3): the flat compute
//                   buffer whose views the model's Parameter slots hold, its flat gradient
//                   buffer, and the rank's shard of it
//   release_storage / materialize_storage
//                   give a Storage's bytes back and take new ones while every tensor viewing it
//                   (autograd's saved tensors included) keeps pointing at the same Storage
//   GradReadiness   grad-ready hooks -> per-bucket callbacks; buckets launch their collective
//                   strictly in bucket order (the same on every rank) as soon as they are complete
//   UnitScheduler   forward/backward gather, prefetch and release of parameter units driven by
//                   module hooks and gradient readiness
//   global_grad_norm
//                   the norm over (possibly sharded) gradients
//
// docs/parallel.md describes how the strategies compose these pieces.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "parallel/process_group.h"
#include "runtime/module.h"

namespace accel {

// ---- collectives ---------------------------------------------------------------------------

// A process group or none (one process). Without a group, or with a group of one rank, every
// collective completes at once with the single-rank result.
class Comm {
 public:
  Comm() = default;
  explicit Comm(std::shared_ptr<ProcessGroup> pg) : pg_(std::move(pg)) {}
  int rank() const { return pg_ ? pg_->rank() : 0; }
  int size() const { return pg_ ? pg_->size() : 1; }
  ProcessGroup* group() const { return pg_.get(); }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op) const;
  // out = reduction of chunk rank() of every rank's `in` (in.numel() == size() * out.numel()).
  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) const;
  // out = [in of rank 0 | in of rank 1 | ...]; `in` may be this rank's chunk of `out`.
  WorkPtr all_gather(const Tensor& out, const Tensor& in) const;
  WorkPtr broadcast(const Tensor& t, int root) const;
  // Sum of one value over the ranks (blocking; fp64).
  double sum(double v, Device device) const;

 private:
  std::shared_ptr<ProcessGroup> pg_;
};

// A Work that is already complete.
WorkPtr completed_work();

// ---- layout --------------------------------------------------------------------------------

struct FlatSlot {
  Parameter* param = nullptr;
  std::string name;
  Shape shape;
  int64_t numel = 0;
  int64_t offset = 0;  // first element in the flat (parameter-ordered) buffer
  // Dim0 layout: rows = shape[0] (1-d: its elements; 0-d: 1), row_numel = numel / rows,
  // rows_per_rank = ceil(rows / world), shard_offset = where the slot's rows start inside every
  // rank's shard (sum of rows_per_rank * row_numel of the slots before it).
  int64_t rows = 0, row_numel = 0, rows_per_rank = 0, shard_offset = 0;
};

// How a group of parameters is split over the ranks. Both modes keep the parameters end to end in
// one flat *parameter-ordered* buffer (the compute buffer the Parameter slots view, and the flat
// gradient); they differ in what rank r's shard [shard_numel] holds.
//
// Contiguous (ZeRO-1/2/3): the flat buffer is padded with zeros to world * shard_numel elements
// and rank r owns its chunk [r * shard_numel, (r + 1) * shard_numel); a parameter may straddle two
// or more ranks, and the padding sits at the end. The rank-major collective buffer ("wire": the
// all-gather output, the reduce-scatter input) IS the flat buffer.
//
// Dim0 (FSDP2): every parameter is sharded on dim 0: slot i has rows_per_rank c_i = ceil(d0_i / N)
// and rank r owns rows [r * c_i, min((r + 1) * c_i, d0_i)) (possibly none), zero-padded to c_i
// rows. Rank r's shard is the concatenation over the slots of those c_i * row_numel_i elements,
// then zeros up to shard_numel (a multiple of kFlatAlignment). The wire [world * shard_numel] is
// rank-major and differs from the flat buffer [flat_numel]: a copy-out (unpack) writes the
// gathered rows into the flat buffer, a copy-in (pack) puts the flat gradient into wire order.
//
// Everything that maps a shard to parameters goes through owned() and shard_offset(), so both
// modes share the code.
struct FlatLayout {
  enum class Mode { Contiguous, Dim0 };
  static constexpr int64_t kFlatAlignment = 16;  // elements
  std::vector<FlatSlot> slots;
  Mode mode = Mode::Contiguous;
  int world = 1;
  int64_t numel = 0;         // sum of the parameters' elements
  int64_t padded_numel = 0;  // world * shard_numel: the wire (collective) buffer
  int64_t shard_numel = 0;
  int64_t flat_numel = 0;  // the parameter-ordered buffer: padded_numel (Contiguous),
                           // numel rounded up to kFlatAlignment (Dim0)

  FlatLayout() = default;
  FlatLayout(const std::vector<Parameter*>& params, int world, Mode mode = Mode::Contiguous);
  // Without parameters (param stays null): names and shapes, e.g. from a checkpoint manifest.
  FlatLayout(const std::vector<std::pair<std::string, Shape>>& params, int world,
             Mode mode = Mode::Contiguous);

  struct Range {
    int64_t begin = 0, end = 0;  // in the parameter's own (flattened) element indices
    int64_t size() const { return end - begin; }
  };
  // The elements of slot i that `rank` owns (empty when none): one contiguous range.
  Range owned(size_t slot, int rank) const;
  // Where owned(slot, rank).begin sits inside rank's shard [shard_numel].
  int64_t shard_offset(size_t slot, int rank) const;
  // Whether the wire buffer is the flat buffer itself (Contiguous): no copy-in/copy-out.
  bool wire_is_flat() const { return mode == Mode::Contiguous; }

  // Copies between the flat parameter-ordered buffer [flat_numel] and the rank-major wire
  // [padded_numel] or one rank's shard [shard_numel] (any float dtypes; values are converted;
  // tensors may live on different devices only for the shard copies). Padding in the
  // destination is zeroed where noted.
  void pack(const Tensor& flat, const Tensor& wire) const;    // copy-in; zeroes padding
  void unpack(const Tensor& wire, const Tensor& flat) const;  // copy-out; zeroes the tail
  void extract_shard(const Tensor& flat, int rank, const Tensor& shard) const;  // zeroes padding
  void insert_shard(const Tensor& shard, int rank, const Tensor& flat) const;   // owned part only

  // {"layout": "contiguous"|"dim0", "numel", "padded_numel", "shard_numel", "flat_numel",
  //  "world", "params": [{"name", "shape", "offset", "rows_per_rank", "shard_offset"}]}
  nlohmann::json to_json() const;
  // The layout a to_json() describes (slots without parameters); checks its numbers.
  static FlatLayout from_json(const nlohmann::json& j);
  static const char* mode_name(Mode m) { return m == Mode::Dim0 ? "dim0" : "contiguous"; }

 private:
  void build(std::vector<FlatSlot> slots);
};

// Splits `params` (given in the order their gradients are expected, i.e. backward order) into
// consecutive buckets of at most cap_bytes at `element_size` bytes per element (a parameter
// larger than the cap gets a bucket of its own).
std::vector<std::vector<Parameter*>> make_buckets(const std::vector<Parameter*>& params,
                                                  double cap_bytes, size_t element_size);

// ---- storage that gives its bytes back ------------------------------------------------------

// Frees the bytes of `s` (accounted in its category) and leaves it empty; tensors viewing it
// stay valid objects but must not be read until materialize_storage.
void release_storage(Storage& s);
// Gives an empty storage `nbytes` new (uninitialized) bytes on its device, in its category.
void materialize_storage(Storage& s, size_t nbytes);
bool storage_materialized(const Storage& s);

// A contiguous view [offset, offset + numel) of a 1-D tensor as `shape` (no autograd).
Tensor flat_view(const Tensor& flat, int64_t offset, const Shape& shape);

// ---- a flat parameter group ----------------------------------------------------------------

// One bucket or unit of parameters in one flat buffer of the compute dtype. make() moves the
// parameters' current values into it and makes every Parameter slot hold a view of it: a leaf that
// requires a gradient, carries the parameter's name, and keeps its identity for the whole run.
class FlatParamGroup {
 public:
  // Builds the group for `params` (fp32 or any dtype; values are converted) over `world` ranks.
  static std::unique_ptr<FlatParamGroup> make(std::string name,
                                              const std::vector<Parameter*>& params, int world,
                                              DType dtype, Device device,
                                              FlatLayout::Mode mode = FlatLayout::Mode::Contiguous);

  const std::string& name() const { return name_; }
  const FlatLayout& layout() const { return layout_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  // The leaf tensors the Parameter slots hold (one per slot).
  const std::vector<Tensor>& params() const { return params_; }

  // The flat compute buffer [flat_numel] and (Contiguous layout only) rank r's chunk of it
  // [shard_numel]. Reading them needs materialized().
  Tensor full() const { return full_; }
  Tensor full_chunk(int rank) const;
  bool materialized() const { return storage_materialized(*full_.storage()); }
  void release();      // frees the flat buffer's bytes (the slots keep their tensors)
  void materialize();  // new bytes, contents undefined (fill them: a gather)

  // The flat gradient [flat_numel] in the compute dtype, when allocated; its chunk (Contiguous).
  const Tensor& grad() const { return grad_; }
  Tensor grad_chunk(int rank) const;
  // Allocates a zeroed flat gradient (category Grads) and makes every parameter without a
  // gradient use a view of it, so autograd accumulates in place.
  void allocate_grad();
  // Moves a parameter's gradient that autograd allocated on its own into the flat gradient
  // (which must exist) and replaces it with the view.
  void adopt_grad(size_t slot);
  // Makes every parameter's gradient the view of the flat gradient again (after something
  // dropped or replaced it).
  void attach_grad_views();
  // Drops the flat gradient and the parameters' gradients.
  void free_grad();

 private:
  FlatParamGroup() = default;
  std::string name_;
  FlatLayout layout_;
  DType dtype_ = DType::F32;
  Device device_;
  Tensor full_;
  std::vector<Tensor> params_;
  Tensor grad_;
};

// ---- gradient readiness ----------------------------------------------------------------------

// Watches the parameter leaves of ordered buckets through grad-ready hooks during one backward
// pass at a time. For each gradient: on_grad(bucket, slot), and on_first(bucket) before the
// bucket's first; when a bucket has all its gradients: on_complete(bucket) at once (local work:
// release memory, wait for a prefetch), then launch(bucket) in bucket order: bucket b launches
// only after buckets 0..b-1, so every rank issues its collectives in the same sequence whatever
// the order gradients arrive in.
class GradReadiness {
 public:
  struct Callbacks {
    std::function<void(int bucket, int slot)> on_grad;
    std::function<void(int bucket)> on_first;
    std::function<void(int bucket)> on_complete;
    std::function<void(int bucket)> launch;
  };
  // buckets[b][s]: the leaf tensor of slot s of bucket b; names for messages.
  GradReadiness(const std::vector<std::vector<Tensor>>& buckets,
                const std::vector<std::vector<std::string>>& names, Callbacks callbacks);

  // Whether hooks act in the next backward (false: gradients just accumulate locally).
  void set_active(bool active);
  bool active() const;
  // Whether any gradient arrived since the last finish().
  bool pending() const;
  // Ends the backward pass: a parameter that received no gradient is an error naming it, or,
  // with allow_unused, counts as ready (its gradient slot holds zeros or what earlier
  // micro-batches accumulated); then launches the buckets not launched yet, in order.
  void finish(bool allow_unused);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// ---- units gathered for use -------------------------------------------------------------------

// Gather/release of parameter units (ZeRO-3 layers, FSDP units) around their use.
//
// Forward: a unit's pre-forward hook waits for (or issues and waits for) its gather, then issues
// the gather of the next unit in forward order (prefetch); its post-forward hook releases it,
// except the last unit when a backward will follow. The root module's parameters outside every
// unit form the root unit: gathered at the root's pre-forward and kept until the backward ends.
// Backward: the strategy calls backward_unit_started(u) on unit u's first gradient (prefetch of
// unit u-1) and backward_unit_done(u) when all its gradients are in (release u, wait for u-1), so
// unit u-1 is gathered before any of its backward ops runs: every op lists its activation input
// before its weights, so the engine's topological order finishes a unit's weights before it
// reaches the unit's input. With activation checkpointing the recomputation runs the pre-forward
// hook, which gathers as well. end_backward() releases what is left. Forward passes without
// gradient recording release every unit after use and the root at the end.
class UnitScheduler {
 public:
  struct Callbacks {
    std::function<WorkPtr(int unit)> start_gather;  // allocate + issue the all-gather
    std::function<void(int unit)> finish_gather;    // after the gather completed (may be empty)
    std::function<void(int unit)> release;
  };
  // `units`: modules in forward order, unit i = units[i]; root_unit: true when the root's own
  // parameters form unit units.size(). Units start gathered (call release_all() once the shards
  // are taken). reshard_after_forward false keeps units gathered from their forward to their
  // backward when gradients are recorded (FSDP's fsdp_reshard_after_forward: false).
  UnitScheduler(Module& root, std::vector<Module*> units, bool root_unit, Callbacks callbacks,
                bool reshard_after_forward = true);

  int num_units() const;  // including the root unit
  bool gathered(int unit) const;
  void ensure(int unit);    // gathered on return
  void prefetch(int unit);  // gather issued (no-op when gathered or in flight)
  void release(int unit);   // waits for an in-flight gather first
  void backward_unit_started(int unit);
  void backward_unit_done(int unit);
  void end_backward();
  void release_all();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// The global L2 norm of gradients: each rank's `grads` are disjoint shards of the whole when
// `sharded` (their squared norms are summed over the ranks), or full replicas when not.
double global_grad_norm(const std::vector<Tensor>& grads, const Comm& comm, bool sharded,
                        Device device);

}  // namespace accel
