// Compiled when the build has no CUDA: every CUDA entry point says so.
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/host_copies.h"
#include "runtime/kernels.h"

namespace accel {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string(what) +
                           ": this build of accel-train has no CUDA backend (rebuild with nvcc "
                           "installed, or -DACCEL_CUDA=ON)");
}
}  // namespace

namespace cuda {
bool available() { return false; }
int device_count() { return 0; }
void* device_malloc(size_t, int, MemCategory) { no_cuda("cuda::device_malloc"); }
void device_free(void*, size_t, int, MemCategory) {}
void copy_bytes(void*, Device, const void*, Device, size_t) { no_cuda("cuda::copy_bytes"); }
void synchronize(int) { no_cuda("cuda::synchronize"); }
double host_wait_seconds() { return 0.0; }
void* pinned_alloc(size_t) { no_cuda("cuda::pinned_alloc (page-locked host memory)"); }
void pinned_free(void*) {}
struct HostCopies::Impl {};
HostCopies::HostCopies(int) { no_cuda("cuda::HostCopies"); }
HostCopies::~HostCopies() = default;
void HostCopies::add(void*, const void*, size_t) { no_cuda("cuda::HostCopies::add"); }
void HostCopies::close() { no_cuda("cuda::HostCopies::close"); }
double HostCopies::wait() { no_cuda("cuda::HostCopies::wait"); }
}  // namespace cuda

namespace kernels::cuda {
void copy(const Tensor&, const Tensor&) { no_cuda("copy"); }
void fill(const Tensor&, double) { no_cuda("fill"); }
void accumulate(const Tensor&, const Tensor&) { no_cuda("accumulate"); }
void add(const Tensor&, const Tensor&, const Tensor&) { no_cuda("add"); }
}  // namespace kernels::cuda
}  // namespace accel
