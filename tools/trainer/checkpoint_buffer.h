// The host memory of checkpoint snapshots (tools/trainer/checkpoint.h): one block, page-locked
// where the state is on a GPU, carved into the snapshot's tensors and kept from save to save, so
// that a save neither allocates (and first touches) gigabytes of host memory nor copies twice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/tensor.h"

namespace accel {

// Where a snapshot buffer's block comes from (abstracted so that the reuse logic is tested on
// the CPU).
class HostMemory {
 public:
  virtual ~HostMemory() = default;
  // A CPU storage of nbytes; throws std::runtime_error when refused.
  virtual std::shared_ptr<Storage> allocate(size_t nbytes) = 0;
  virtual bool pinned() const = 0;
};
std::unique_ptr<HostMemory> pinned_host_memory();    // cudaMallocHost (runtime/host_copies.h)
std::unique_ptr<HostMemory> pageable_host_memory();  // the CPU allocator

// Shapes and dtypes of a snapshot's tensors, in order.
struct HostTensorSpec {
  Shape shape;
  DType dtype = DType::F32;
};

class SnapshotBuffer {
 public:
  // `pinned` may be null (no page-locked memory: CPU-only builds, tests). `warn` prints the one
  // warning of a refused pinned allocation (default: stderr).
  SnapshotBuffer(std::unique_ptr<HostMemory> pinned, std::unique_ptr<HostMemory> pageable,
                 std::function<void(const std::string&)> warn = nullptr);
  // The buffer of a run: pinned memory where this build has CUDA.
  static std::unique_ptr<SnapshotBuffer> for_run();

  // Contiguous CPU tensors of `specs`, views into one block, each at a multiple of 256 bytes
  // from its start (page-aligned when pinned, 64-byte aligned when pageable). The
  // block of the previous call is reused when it is large enough (and pinned where `want_pinned`
  // asks for it); else it is freed and one of exactly the size needed is allocated. A refused
  // pinned allocation warns once and uses pageable memory for the rest of the run (no retry at
  // every save). The tensors of the previous call must be gone (the save that used them is
  // written): otherwise std::logic_error, as their bytes would be overwritten.
  std::vector<Tensor> carve(const std::vector<HostTensorSpec>& specs, bool want_pinned);
  // The bytes of the block that carve(specs, ...) lays the tensors out in.
  static size_t bytes_for(const std::vector<HostTensorSpec>& specs);

  // Allocates now the block that carve(specs, want_pinned) will need, so that the save that
  // carves it allocates nothing: a run with periodic background saves reserves it at setup
  // (tools/trainer/checkpointing.h). A pinned block is page-locked by the driver as it is
  // allocated; a pageable one is written once (zeros) so that its pages are backed now, not at
  // the first save's copy. Unlike carve, a refused pinned allocation does not become a pageable
  // block: reserve throws std::runtime_error naming the size and the driver's reason and the
  // buffer stays empty, so that the run can stop with a clear message before any step. A later
  // carve that does not fit the reserved block (a state that grew, or a reservation sized
  // wrong) warns, once, that this save allocates a new block, then does.
  void reserve(const std::vector<HostTensorSpec>& specs, bool want_pinned);
  size_t reserved_bytes() const { return reserved_; }  // 0: nothing reserved

  bool pinned() const { return block_ && block_pinned_; }
  size_t capacity() const { return block_ ? block_->nbytes : 0; }
  int64_t allocations() const { return allocations_; }  // blocks allocated so far
  bool pinned_refused() const { return pinned_refused_; }

 private:
  std::unique_ptr<HostMemory> pinned_, pageable_;
  std::function<void(const std::string&)> warn_;
  std::shared_ptr<Storage> block_;
  bool block_pinned_ = false;  // made by `pinned_`
  int64_t allocations_ = 0;
  bool pinned_refused_ = false;
  size_t reserved_ = 0;  // the block reserve() allocated, until a carve outgrows it
};

}  // namespace accel
