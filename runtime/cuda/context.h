// CUDA runtime services for the rest of the code base: error checks, the current device and its
// compute stream, events, pinned host memory, the caching allocator's statistics and scratch
// buffers. Only compiled (and only includable) in builds with CUDA; code that must also build
// without CUDA talks to the entry points in runtime/device.h instead.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "runtime/device.h"

namespace accel::cuda {

// Throws std::runtime_error("<call> failed at file:line: <cuda error string>") unless e is success.
void check(cudaError_t e, const char* call, const char* file, int line);
#define ACCEL_CUDA_CHECK(expr) ::accel::cuda::check((expr), #expr, __FILE__, __LINE__)
// Checks the last kernel launch (bad configuration, too much shared memory ...).
#define ACCEL_CUDA_CHECK_LAUNCH(name) \
  ::accel::cuda::check(cudaGetLastError(), name " launch", __FILE__, __LINE__)

int current_device();
void set_device(int device);

// Sets the current device for a scope, restoring the previous one on exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

// The stream every kernel of this thread runs on, on the current device: the device's compute
// stream unless a StreamGuard says otherwise. The compute stream is created once per device as a
// blocking stream, so work on the legacy default stream (plain cudaMemcpy) stays ordered with it.
cudaStream_t current_stream();
cudaStream_t compute_stream(int device);

// Runs this thread's kernels on `stream` (of the current device) for a scope.
class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  cudaStream_t previous_;
  bool had_previous_;
};

// A CUDA event (timing enabled).
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream = current_stream());
  void wait(cudaStream_t stream = current_stream()) const;  // stream waits for this event
  void synchronize() const;
  bool query() const;                        // true when the recorded work is done
  float elapsed_ms(const Event& end) const;  // both recorded and complete
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// cudaStreamSynchronize, with the time blocked counted in host_wait_seconds().
void wait_for_stream(cudaStream_t stream);
// Copies nbytes from the device to pageable host memory after the work queued on `stream` and
// waits for it (the copy itself blocks until the stream reaches it: counted as waiting too).
void copy_to_host(void* dst, const void* src, size_t nbytes, cudaStream_t stream);

const cudaDeviceProp& device_properties(int device);
int sm_count(int device = current_device());

// Page-locked host memory (for fast, asynchronous host<->device copies).
void* pinned_alloc(size_t nbytes);
void pinned_free(void* p);

// Tells the allocator that the device block containing `p` (any address inside it, e.g. a view's
// data pointer) is used by `stream` (not the stream it was allocated on), so freeing it waits for
// that stream's work before the block is reused.
void record_stream(void* p, cudaStream_t stream);

struct AllocatorStats {
  int64_t reserved_bytes = 0;  // held from cudaMalloc (in use + cached)
  int64_t peak_reserved_bytes = 0;
  int64_t cached_bytes = 0;        // free blocks kept for reuse
  int64_t num_device_mallocs = 0;  // cudaMalloc calls so far
  int64_t num_allocations = 0;     // allocator requests so far
};
AllocatorStats allocator_stats(int device);
// Returns every cached (free) block to the driver.
void empty_cache(int device);

// Temporary device memory from the caching allocator (category Other), freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t nbytes, int device = current_device());
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return nbytes_; }

 private:
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  int device_ = 0;
};

}  // namespace accel::cuda
