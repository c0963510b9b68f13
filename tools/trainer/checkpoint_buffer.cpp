#include "tools/trainer/checkpoint_buffer.h"

#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "runtime/host_copies.h"

namespace accel {

namespace {
constexpr size_t kAlign = 256;  // more than any dtype needs; whole cache lines per tensor

size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A CPU storage over cudaMallocHost memory. Storage frees CPU memory with free(): the block
// hands it null first and frees the memory through CUDA itself; the views share the block's
// lifetime through an aliasing pointer.
struct PinnedBlock {
  Storage storage;
  PinnedBlock(void* p, size_t n) : storage(p, n, Device::cpu(), MemCategory::Other) {
    memory_stats_add(Device::cpu(), MemCategory::Other, static_cast<int64_t>(n));  // ~Storage
  }
  ~PinnedBlock() {
    void* p = storage.data;
    storage.data = nullptr;
    try {
      cuda::pinned_free(p);
    } catch (const std::exception&) {  // never from a destructor (at exit the context may be gone)
    }
  }
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
};

class PinnedHostMemory : public HostMemory {
 public:
  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    auto block = std::make_shared<PinnedBlock>(cuda::pinned_alloc(nbytes), nbytes);
    return std::shared_ptr<Storage>(block, &block->storage);
  }
  bool pinned() const override { return true; }
};

class PageableHostMemory : public HostMemory {
 public:
  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    return allocate_storage(nbytes, Device::cpu(), MemCategory::Other);
  }
  bool pinned() const override { return false; }
};

std::string gib(size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
  return s;
}
}  // namespace

std::unique_ptr<HostMemory> pinned_host_memory() { return std::make_unique<PinnedHostMemory>(); }
std::unique_ptr<HostMemory> pageable_host_memory() {
  return std::make_unique<PageableHostMemory>();
}

SnapshotBuffer::SnapshotBuffer(std::unique_ptr<HostMemory> pinned,
                               std::unique_ptr<HostMemory> pageable,
                               std::function<void(const std::string&)> warn)
    : pinned_(std::move(pinned)), pageable_(std::move(pageable)), warn_(std::move(warn)) {
  if (!pageable_) throw std::invalid_argument("SnapshotBuffer: no pageable host memory");
  if (!warn_) warn_ = [](const std::string& m) { std::fprintf(stderr, "%s\n", m.c_str()); };
}

std::unique_ptr<SnapshotBuffer> SnapshotBuffer::for_run() {
  return std::make_unique<SnapshotBuffer>(cuda::available() ? pinned_host_memory() : nullptr,
                                          pageable_host_memory());
}

size_t SnapshotBuffer::bytes_for(const std::vector<HostTensorSpec>& specs) {
  size_t total = 0;
  for (const HostTensorSpec& s : specs)
    total += aligned(static_cast<size_t>(shape_numel(s.shape)) * dtype_size(s.dtype));
  return total;
}

void SnapshotBuffer::reserve(const std::vector<HostTensorSpec>& specs, bool want_pinned) {
  if (block_ && block_.use_count() > 1)
    throw std::logic_error("checkpoint snapshot buffer: reserve() while a save holds the block");
  const size_t total = bytes_for(specs);
  block_.reset();
  block_pinned_ = false;
  reserved_ = 0;
  if (total == 0) return;  // nothing to hold (a rank whose saves write nothing)
  if (want_pinned && pinned_) {
    try {
      block_ = pinned_->allocate(total);
    } catch (const std::exception& e) {
      throw std::runtime_error(gib(total) + " of pinned (page-locked) host memory was refused (" +
                               e.what() + ")");
    }
    block_pinned_ = pinned_->pinned();
  } else {
    block_ = pageable_->allocate(total);
    std::memset(block_->data, 0, total);  // backed now, not at the first save's copy
  }
  ++allocations_;
  reserved_ = total;
}

std::vector<Tensor> SnapshotBuffer::carve(const std::vector<HostTensorSpec>& specs,
                                          bool want_pinned) {
  if (block_ && block_.use_count() > 1)
    throw std::logic_error(
        "checkpoint snapshot buffer still in use: the previous save must be written before the "
        "next snapshot is taken");
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const HostTensorSpec& s : specs) {
    offsets.push_back(total);
    total += aligned(static_cast<size_t>(shape_numel(s.shape)) * dtype_size(s.dtype));
  }
  const bool pin = want_pinned && pinned_ && !pinned_refused_;
  const bool fits = block_ && block_->nbytes >= total && (block_pinned_ || !pin);
  if (!fits && total > 0) {
    if (reserved_ > 0)
      warn_("accel-train: WARNING: this checkpoint snapshot needs " + gib(total) +
            (pin ? " of pinned" : " of") + " host memory, which the " + gib(reserved_) +
            (block_pinned_ ? " pinned" : " pageable") +
            " block reserved at setup does not hold; this save allocates a new block and "
            "stalls the training loop for it (the reservation is sized from the strategy's "
            "full_state_dict_layout and param_state_slices: a mismatch is a bug to report)");
    reserved_ = 0;
    block_.reset();  // freed before its successor is allocated: never both at once
    block_pinned_ = false;
    if (pin) {
      try {
        block_ = pinned_->allocate(total);
        block_pinned_ = pinned_->pinned();
      } catch (const std::exception& e) {
        pinned_refused_ = true;
        warn_("accel-train: WARNING: checkpoint snapshots need " + gib(total) +
              " of pinned (page-locked) host memory, which was refused (" + e.what() +
              "). Using pageable host memory for the rest of this run: each save's "
              "device-to-host copy is synchronous and several times slower, so the training "
              "loop stalls longer at every save (the 'saved checkpoint' lines say 'pageable'). "
              "Free host memory, or shard the state over more ranks (ZeRO/FSDP), to get pinned "
              "snapshots back");
      }
    }
    if (!block_) block_ = pageable_->allocate(total);
    ++allocations_;
  }
  std::vector<Tensor> out;
  out.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const HostTensorSpec& s = specs[i];
    if (shape_numel(s.shape) == 0) {  // nothing to hold; may come before any block exists
      out.push_back(Tensor::empty(s.shape, s.dtype, Device::cpu(), MemCategory::Other));
      continue;
    }
    out.push_back(Tensor::from_storage(block_, s.dtype, s.shape, contiguous_strides(s.shape),
                                       static_cast<int64_t>(offsets[i] / dtype_size(s.dtype))));
  }
  return out;
}

}  // namespace accel
