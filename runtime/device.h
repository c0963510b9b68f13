// Devices, memory categories and the allocators behind tensor storage.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace accel {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::CUDA, index}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;  // "cpu", "cuda:0"
};

// What a block of memory holds, for the per-category peak report.
enum class MemCategory : uint8_t { Params, Grads, OptimizerState, Activations, Comm, Other };
constexpr int kNumMemCategories = 6;
const char* mem_category_name(MemCategory c);  // "params", "grads", "optimizer_state", ...

struct MemoryStats {
  std::array<int64_t, kNumMemCategories> current{};
  std::array<int64_t, kNumMemCategories> peak{};  // peak of each category on its own
  int64_t current_total = 0;
  int64_t peak_total = 0;  // peak of the sum
};

// Bytes in use per category on one device, counted by its allocator.
MemoryStats memory_stats(Device d);
void reset_peak_memory_stats(Device d);

// A block of device or host memory; frees itself through the allocator that made it.
struct Storage {
  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  MemCategory category = MemCategory::Other;
  Storage(void* data, size_t nbytes, Device device, MemCategory category)
      : data(data), nbytes(nbytes), device(device), category(category) {}
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

std::shared_ptr<Storage> allocate_storage(size_t nbytes, Device d, MemCategory c);
// Counts `s` under category `c` from now on (a buffer that changes role: a backward result
// kept as a parameter's gradient).
void recategorize(Storage& s, MemCategory c);

// Counts bytes in and out of one device's pool; the CPU and CUDA allocators both use it.
void memory_stats_add(Device d, MemCategory c, int64_t bytes);

// CUDA entry points the runtime needs. Built from runtime/cuda/ with nvcc, or from
// runtime/no_cuda/ where they report that this build has no CUDA.
namespace cuda {
bool available();  // built with CUDA and at least one device visible
int device_count();
void* device_malloc(size_t nbytes, int device, MemCategory c);
void device_free(void* p, size_t nbytes, int device, MemCategory c);
// Synchronous copies: kind is host->device, device->host or device->device by the two devices.
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes);
void synchronize(int device);
// Seconds this process's host threads have spent blocked on the devices (stream/event/device
// synchronization) since start: per step, close to 0 means the host is the bottleneck (the GPU
// waits for launches), a large share means the GPU is.
double host_wait_seconds();
}  // namespace cuda

}  // namespace accel
