// Page-locked host memory and asynchronous device-to-host copies for code that must also build
// without CUDA (checkpoint snapshots, tools/trainer/checkpoint_buffer.h). Implemented in
// runtime/cuda/ (pinned_alloc in context.cpp, HostCopies in host_copies.cpp); in builds without
// CUDA, runtime/no_cuda/cuda_stub.cpp throws that there is no CUDA.
#pragma once

#include <cstddef>
#include <memory>

namespace accel::cuda {

// Page-locked host memory (cudaMallocHost). pinned_alloc throws std::runtime_error naming the
// size and CUDA's reason when the driver refuses (too little host memory).
void* pinned_alloc(size_t nbytes);
void pinned_free(void* p);

// Device-to-host copies into page-locked memory that the host does not wait for: on a copy
// stream of the device's own, after the work queued so far on this thread's stream of `device`.
// close() makes that stream wait for them, so that nothing queued later there (an optimizer
// step, a kernel reusing a freed source) can change a source before it is copied; the host goes
// on. wait() blocks until they are done.
class HostCopies {
 public:
  explicit HostCopies(int device);
  ~HostCopies();  // waits for copies still in flight: their destination may be freed next
  HostCopies(const HostCopies&) = delete;
  HostCopies& operator=(const HostCopies&) = delete;
  // `dst`: page-locked (pinned_alloc); `src`: memory of the caching allocator on `device`.
  void add(void* dst, const void* src, size_t nbytes);
  void close();  // after the last add(): the stream of the constructor waits for the copies
  // Blocks until every copy is done (close() first if needed); returns the seconds from the
  // constructor to their completion, by the device's clock. Not counted in host_wait_seconds():
  // a checkpoint writer thread calls it.
  double wait();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace accel::cuda
