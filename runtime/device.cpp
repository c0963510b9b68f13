#include "runtime/device.h"

#include <cstdlib>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

namespace accel {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

const char* mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Params:
      return "params";
    case MemCategory::Grads:
      return "grads";
    case MemCategory::OptimizerState:
      return "optimizer_state";
    case MemCategory::Activations:
      return "activations";
    case MemCategory::Comm:
      return "comm";
    case MemCategory::Other:
      return "other";
  }
  return "?";
}

namespace {
constexpr int kMaxDevices = 17;  // slot 0 = cpu, 1.. = cuda:0..
std::mutex g_stats_mu;
MemoryStats g_stats[kMaxDevices];

int slot(Device d) {
  int s = d.is_cpu() ? 0 : 1 + d.index;
  if (s < 0 || s >= kMaxDevices) throw std::out_of_range("device index out of range: " + d.str());
  return s;
}
}  // namespace

void memory_stats_add(Device d, MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  MemoryStats& s = g_stats[slot(d)];
  int i = static_cast<int>(c);
  s.current[i] += bytes;
  s.current_total += bytes;
  if (s.current[i] > s.peak[i]) s.peak[i] = s.current[i];
  if (s.current_total > s.peak_total) s.peak_total = s.current_total;
}

MemoryStats memory_stats(Device d) {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  return g_stats[slot(d)];
}

void reset_peak_memory_stats(Device d) {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  MemoryStats& s = g_stats[slot(d)];
  s.peak = s.current;
  s.peak_total = s.current_total;
}

std::shared_ptr<Storage> allocate_storage(size_t nbytes, Device d, MemCategory c) {
  void* p = nullptr;
  if (d.is_cpu()) {
    // 64-byte alignment suits AVX-512 loads and Eigen; round the size up as aligned_alloc requires.
    if (nbytes > static_cast<size_t>(INT64_MAX) - 63)
      throw std::length_error("cannot allocate " + std::to_string(nbytes) + " bytes on the CPU");
    size_t rounded = (nbytes + 63) / 64 * 64;
    if (rounded > 0) {
      p = std::aligned_alloc(64, rounded);
      if (!p)
        throw std::runtime_error("out of memory on the CPU: tried to allocate " +
                                 std::to_string(nbytes >> 20) + " MiB for " + mem_category_name(c) +
                                 "; " + std::to_string(memory_stats(d).current_total >> 20) +
                                 " MiB held by accel-train (a smaller model or batch fits)");
    }
    memory_stats_add(d, c, static_cast<int64_t>(nbytes));
  } else {
    p = cuda::device_malloc(nbytes, d.index, c);  // counts its own bytes
  }
  return std::make_shared<Storage>(p, nbytes, d, c);
}

void recategorize(Storage& s, MemCategory c) {
  if (s.category == c) return;
  memory_stats_add(s.device, s.category, -static_cast<int64_t>(s.nbytes));
  memory_stats_add(s.device, c, static_cast<int64_t>(s.nbytes));
  s.category = c;
}

Storage::~Storage() {
  if (device.is_cpu()) {
    std::free(data);
    memory_stats_add(device, category, -static_cast<int64_t>(nbytes));
  } else {
    cuda::device_free(data, nbytes, device.index, category);
  }
}

}  // namespace accel
