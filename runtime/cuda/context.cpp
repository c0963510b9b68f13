// CUDA device entry points (runtime/device.h), streams, events, pinned memory and the caching
// allocator.
//
// Allocator: requests are rounded to a size class; small classes (<= 1 MiB, 512-byte steps) are
// carved from 2 MiB segments, large classes (1/8-power-of-two steps) get their own cudaMalloc.
// A freed block goes back to the free list of its (stream, class) and is reused by the next request
// of that class on that stream, which is safe without synchronization because work on one stream
// runs in order. Blocks used on other streams (record_stream) wait for an event recorded there.
// cudaMalloc runs only when a class has no cached block (the first steps of training); when it
// fails, every cached block is released and the call is retried once.
#include "runtime/cuda/context.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace accel::cuda {

void check(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  throw std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                           ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

int current_device() {
  int d = 0;
  ACCEL_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int device) { ACCEL_CUDA_CHECK(cudaSetDevice(device)); }

DeviceGuard::DeviceGuard(int device) : previous_(current_device()) {
  if (device != previous_) set_device(device);
}
DeviceGuard::~DeviceGuard() { cudaSetDevice(previous_); }

namespace {
constexpr int kMaxDevices = 16;

int checked_device_count() {
  static int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

void check_device_index(int device, const char* what) {
  if (device < 0 || device >= checked_device_count() || device >= kMaxDevices)
    throw std::out_of_range(std::string(what) + ": CUDA device " + std::to_string(device) +
                            " does not exist (this machine has " +
                            std::to_string(checked_device_count()) + ")");
}

std::mutex g_stream_mu;
cudaStream_t g_compute_streams[kMaxDevices] = {};
thread_local cudaStream_t t_stream_override[kMaxDevices] = {};
thread_local bool t_has_override[kMaxDevices] = {};
}  // namespace

cudaStream_t compute_stream(int device) {
  check_device_index(device, "compute_stream");
  std::lock_guard<std::mutex> lock(g_stream_mu);
  if (!g_compute_streams[device]) {
    DeviceGuard g(device);
    ACCEL_CUDA_CHECK(cudaStreamCreateWithFlags(&g_compute_streams[device], cudaStreamDefault));
  }
  return g_compute_streams[device];
}

cudaStream_t current_stream() {
  int d = current_device();
  if (d < kMaxDevices && t_has_override[d]) return t_stream_override[d];
  return compute_stream(d);
}

StreamGuard::StreamGuard(cudaStream_t stream) {
  int d = current_device();
  previous_ = t_stream_override[d];
  had_previous_ = t_has_override[d];
  t_stream_override[d] = stream;
  t_has_override[d] = true;
}
StreamGuard::~StreamGuard() {
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess || d >= kMaxDevices) return;
  t_stream_override[d] = previous_;
  t_has_override[d] = had_previous_;
}

Event::Event() { ACCEL_CUDA_CHECK(cudaEventCreate(&event_)); }
Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}
void Event::record(cudaStream_t stream) { ACCEL_CUDA_CHECK(cudaEventRecord(event_, stream)); }
void Event::wait(cudaStream_t stream) const {
  ACCEL_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}
namespace {
std::atomic<int64_t> g_host_wait_ns{0};

// Runs a blocking CUDA call and adds the time it blocked to g_host_wait_ns.
template <class F>
void timed_wait(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  g_host_wait_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
}
}  // namespace

double host_wait_seconds() { return static_cast<double>(g_host_wait_ns.load()) * 1e-9; }
void wait_for_stream(cudaStream_t stream) {
  timed_wait([&] { ACCEL_CUDA_CHECK(cudaStreamSynchronize(stream)); });
}
void copy_to_host(void* dst, const void* src, size_t nbytes, cudaStream_t stream) {
  timed_wait([&] {
    ACCEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream));
    ACCEL_CUDA_CHECK(cudaStreamSynchronize(stream));
  });
}
void Event::synchronize() const {
  timed_wait([&] { ACCEL_CUDA_CHECK(cudaEventSynchronize(event_)); });
}
bool Event::query() const {
  cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  ACCEL_CUDA_CHECK(e);
  return true;
}
float Event::elapsed_ms(const Event& end) const {
  float ms = 0;
  ACCEL_CUDA_CHECK(cudaEventElapsedTime(&ms, event_, end.event_));
  return ms;
}

const cudaDeviceProp& device_properties(int device) {
  check_device_index(device, "device_properties");
  static std::mutex mu;
  static std::unique_ptr<cudaDeviceProp> props[kMaxDevices];
  std::lock_guard<std::mutex> lock(mu);
  if (!props[device]) {
    props[device] = std::make_unique<cudaDeviceProp>();
    ACCEL_CUDA_CHECK(cudaGetDeviceProperties(props[device].get(), device));
  }
  return *props[device];
}

int sm_count(int device) { return device_properties(device).multiProcessorCount; }

void* pinned_alloc(size_t nbytes) {
  void* p = nullptr;
  if (nbytes == 0) return p;
  const cudaError_t e = cudaMallocHost(&p, nbytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("cudaMallocHost of " + std::to_string(nbytes >> 20) +
                             " MiB of page-locked host memory failed: " + cudaGetErrorName(e) +
                             " (" + cudaGetErrorString(e) + ")");
  }
  return p;
}
void pinned_free(void* p) {
  if (p) ACCEL_CUDA_CHECK(cudaFreeHost(p));
}

// ---- caching allocator -----------------------------------------------------------------------
namespace {

constexpr size_t kSmallLimit = 1 << 20;  // classes up to 1 MiB come from shared segments
constexpr size_t kSmallStep = 512;
constexpr size_t kSegmentSize = 2 << 20;

size_t size_class(size_t n) {
  if (n <= kSmallLimit)
    return std::max<size_t>(kSmallStep, (n + kSmallStep - 1) / kSmallStep * kSmallStep);
  int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(n));
  size_t step = size_t(1) << (log2 - 3);
  return (n + step - 1) / step * step;
}

struct Block {
  size_t cls = 0;
  cudaStream_t stream = nullptr;
  bool small = false;
  std::vector<cudaStream_t> used_on;  // other streams (record_stream)
};

struct PendingFree {
  void* ptr;
  Block block;
  std::vector<cudaEvent_t> events;
};

class DeviceAllocator {
 public:
  explicit DeviceAllocator(int device) : device_(device) {}

  void* allocate(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.num_allocations++;
    process_pending();
    cudaStream_t stream = current_stream_of_device();
    size_t cls = size_class(nbytes);
    auto key = std::make_pair(stream, cls);
    auto it = free_.find(key);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= static_cast<int64_t>(cls);
      live_[p] = Block{cls, stream, cls <= kSmallLimit, {}};
      return p;
    }
    void* p = cls <= kSmallLimit ? carve_small(cls, stream) : malloc_with_retry(cls);
    live_[p] = Block{cls, stream, cls <= kSmallLimit, {}};
    return p;
  }

  void free(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours (cannot happen through Storage)
    Block b = std::move(it->second);
    live_.erase(it);
    if (!b.used_on.empty()) {
      PendingFree pf{p, b, {}};
      DeviceGuard g(device_);
      for (cudaStream_t s : b.used_on) {
        cudaEvent_t e;
        ACCEL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        ACCEL_CUDA_CHECK(cudaEventRecord(e, s));
        pf.events.push_back(e);
      }
      pending_.push_back(std::move(pf));
      return;
    }
    cache(p, b);
  }

  void record_stream(void* p, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    // The block that contains p (p may point into a view of a larger storage).
    auto it = live_.upper_bound(p);
    if (it != live_.begin()) --it;
    if (it == live_.end() || p < it->first ||
        static_cast<char*>(p) >= static_cast<char*>(it->first) + it->second.cls)
      throw std::invalid_argument("record_stream: pointer is not inside a live CUDA block");
    if (s == it->second.stream) return;
    auto& u = it->second.used_on;
    if (std::find(u.begin(), u.end(), s) == u.end()) u.push_back(s);
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    release_cached();
  }

 private:
  cudaStream_t current_stream_of_device() {
    DeviceGuard g(device_);
    return current_stream();
  }

  void cache(void* p, const Block& b) {
    free_[std::make_pair(b.stream, b.cls)].push_back(p);
    stats_.cached_bytes += static_cast<int64_t>(b.cls);
  }

  void process_pending() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done = true;
      for (cudaEvent_t e : it->events) {
        cudaError_t r = cudaEventQuery(e);
        if (r == cudaErrorNotReady) {
          done = false;
          break;
        }
        ACCEL_CUDA_CHECK(r);
      }
      if (!done) {
        ++it;
        continue;
      }
      for (cudaEvent_t e : it->events) cudaEventDestroy(e);
      cache(it->ptr, it->block);
      it = pending_.erase(it);
    }
  }

  void* raw_malloc(size_t n) {
    DeviceGuard g(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    stats_.num_device_mallocs++;
    stats_.reserved_bytes += static_cast<int64_t>(n);
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    return p;
  }

  void* malloc_with_retry(size_t n) {
    void* p = raw_malloc(n);
    if (p) return p;
    {
      DeviceGuard g(device_);
      ACCEL_CUDA_CHECK(cudaDeviceSynchronize());
    }
    process_pending();
    release_cached();
    p = raw_malloc(n);
    if (p) return p;
    size_t free_b = 0, total_b = 0;
    {
      DeviceGuard g(device_);
      cudaMemGetInfo(&free_b, &total_b);
    }
    throw std::runtime_error(
        "CUDA out of memory on cuda:" + std::to_string(device_) + ": tried to allocate " +
        std::to_string(n >> 20) + " MiB; " + std::to_string(stats_.reserved_bytes >> 20) +
        " MiB held by accel-train, " + std::to_string(free_b >> 20) + " MiB free of " +
        std::to_string(total_b >> 20) +
        " MiB (lower the micro-batch size or sequence length, or shard with FSDP/ZeRO)");
  }

  void* carve_small(size_t cls, cudaStream_t stream) {
    auto& seg = bump_[stream];
    if (seg.first == nullptr || seg.second + cls > kSegmentSize) {
      char* base = static_cast<char*>(malloc_with_retry(kSegmentSize));
      segments_.push_back(base);
      seg = {base, 0};
    }
    void* p = seg.first + seg.second;
    seg.second += cls;
    return p;
  }

  // Frees cached large blocks. Small blocks share segments with live ones and stay cached.
  void release_cached() {
    DeviceGuard g(device_);
    for (auto it = free_.begin(); it != free_.end();) {
      if (it->first.second <= kSmallLimit) {
        ++it;
        continue;
      }
      for (void* p : it->second) {
        cudaFree(p);
        stats_.reserved_bytes -= static_cast<int64_t>(it->first.second);
        stats_.cached_bytes -= static_cast<int64_t>(it->first.second);
      }
      it = free_.erase(it);
    }
  }

  int device_;
  std::mutex mu_;
  std::map<std::pair<cudaStream_t, size_t>, std::vector<void*>> free_;
  std::map<void*, Block> live_;  // ordered: record_stream looks up interior pointers
  std::deque<PendingFree> pending_;
  std::map<cudaStream_t, std::pair<char*, size_t>> bump_;  // current small segment per stream
  std::vector<char*> segments_;
  AllocatorStats stats_;
};

DeviceAllocator& allocator(int device) {
  check_device_index(device, "CUDA allocator");
  static std::mutex mu;
  // Never destroyed: tensors may be freed during static destruction after the allocator's turn.
  static DeviceAllocator* allocators[kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (!allocators[device]) allocators[device] = new DeviceAllocator(device);
  return *allocators[device];
}

}  // namespace

void record_stream(void* p, cudaStream_t stream) {
  allocator(current_device()).record_stream(p, stream);
}
AllocatorStats allocator_stats(int device) { return allocator(device).stats(); }
void empty_cache(int device) { allocator(device).empty_cache(); }

DeviceBuffer::DeviceBuffer(size_t nbytes, int device) : nbytes_(nbytes), device_(device) {
  ptr_ = device_malloc(nbytes, device, MemCategory::Other);
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) device_free(ptr_, nbytes_, device_, MemCategory::Other);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(o.ptr_), nbytes_(o.nbytes_), device_(o.device_) {
  o.ptr_ = nullptr;
  o.nbytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) device_free(ptr_, nbytes_, device_, MemCategory::Other);
    ptr_ = o.ptr_;
    nbytes_ = o.nbytes_;
    device_ = o.device_;
    o.ptr_ = nullptr;
    o.nbytes_ = 0;
  }
  return *this;
}

// ---- runtime/device.h entry points ------------------------------------------------------------

bool available() { return device_count() > 0; }

int device_count() { return std::min(checked_device_count(), kMaxDevices); }

void* device_malloc(size_t nbytes, int device, MemCategory c) {
  if (nbytes == 0) return nullptr;
  void* p = allocator(device).allocate(nbytes);
  memory_stats_add(Device::cuda(device), c, static_cast<int64_t>(nbytes));
  return p;
}

void device_free(void* p, size_t nbytes, int device, MemCategory c) {
  if (!p) return;
  allocator(device).free(p);
  memory_stats_add(Device::cuda(device), c, -static_cast<int64_t>(nbytes));
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::copy_n(static_cast<const char*>(src), nbytes, static_cast<char*>(dst));
    return;
  }
  // Order after the work already queued on the device's compute stream, then wait: the copy is
  // synchronous from the caller's view.
  int dev = dst_dev.is_cuda() ? dst_dev.index : src_dev.index;
  DeviceGuard g(dev);
  cudaStream_t s = current_stream();
  cudaMemcpyKind kind = dst_dev.is_cpu()   ? cudaMemcpyDeviceToHost
                        : src_dev.is_cpu() ? cudaMemcpyHostToDevice
                                           : cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDeviceToHost) return copy_to_host(dst, src, nbytes, s);
  if (kind == cudaMemcpyDeviceToDevice && dst_dev.index != src_dev.index) {
    wait_for_stream(compute_stream(src_dev.index));
    ACCEL_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_dev.index, src, src_dev.index, nbytes, s));
    wait_for_stream(s);
    return;
  }
  // From pageable memory the copy call itself may wait for the stream: count it as waiting.
  timed_wait([&] {
    ACCEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, s));
    ACCEL_CUDA_CHECK(cudaStreamSynchronize(s));
  });
}

void synchronize(int device) {
  DeviceGuard g(device);
  timed_wait([] { ACCEL_CUDA_CHECK(cudaDeviceSynchronize()); });
}

}  // namespace accel::cuda
