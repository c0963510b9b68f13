// cuda::HostCopies (runtime/host_copies.h): device-to-host copies into pinned memory on a copy
// stream, ordered after the caller's stream and making it wait for them, without blocking the host.
#include "runtime/host_copies.h"

#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>

#include "runtime/cuda/context.h"

namespace accel::cuda {

namespace {
constexpr int kMaxCopyDevices = 16;

// One per device, never destroyed (as the compute streams). Non-blocking: the legacy default
// stream (plain cudaMemcpy elsewhere) must not serialize it with the compute stream.
cudaStream_t copy_stream(int device) {
  if (device < 0 || device >= device_count() || device >= kMaxCopyDevices)
    throw std::out_of_range("HostCopies: CUDA device " + std::to_string(device) +
                            " does not exist (this machine has " + std::to_string(device_count()) +
                            ")");
  static std::mutex mu;
  static cudaStream_t streams[kMaxCopyDevices] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (!streams[device]) {
    DeviceGuard g(device);
    ACCEL_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
  }
  return streams[device];
}
}  // namespace

struct HostCopies::Impl {
  int device = 0;
  cudaStream_t copies = nullptr;  // the copy stream
  cudaStream_t caller = nullptr;  // the stream whose work the copies follow
  Event start, boundary, done;
  bool closed = false, waited = false;
  double seconds = 0;
};

HostCopies::HostCopies(int device) {
  DeviceGuard g(device);
  impl_ = std::make_unique<Impl>();  // its events belong to `device`
  Impl& m = *impl_;
  m.device = device;
  m.copies = copy_stream(device);
  m.caller = current_stream();
  // The copy stream is idle here, so `start` completes at about this moment: elapsed(start,
  // done) is the time from now until the copies are done.
  m.start.record(m.copies);
  m.boundary.record(m.caller);
  m.boundary.wait(m.copies);
}

HostCopies::~HostCopies() {
  if (!impl_ || impl_->waited) return;
  // Copies may still be writing into memory that is freed next (an exception between add() and
  // wait()): let them finish. Errors are not thrown from a destructor.
  if (cudaStreamSynchronize(impl_->copies) != cudaSuccess) cudaGetLastError();
}

void HostCopies::add(void* dst, const void* src, size_t nbytes) {
  if (impl_->closed) throw std::logic_error("HostCopies::add after close()");
  if (nbytes == 0) return;
  DeviceGuard g(impl_->device);
  ACCEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, impl_->copies));
  // A source freed before the copy ran (a gathered temporary) is not handed out again until the
  // copy stream is past this point, whichever stream asks for it.
  record_stream(const_cast<void*>(src), impl_->copies);
}

void HostCopies::close() {
  if (impl_->closed) return;
  DeviceGuard g(impl_->device);
  impl_->done.record(impl_->copies);
  impl_->done.wait(impl_->caller);
  impl_->closed = true;
}

double HostCopies::wait() {
  close();
  if (impl_->waited) return impl_->seconds;
  // Raw, not Event::synchronize(): this is the writer thread's wait, not the training loop's.
  ACCEL_CUDA_CHECK(cudaEventSynchronize(impl_->done.get()));
  impl_->waited = true;
  impl_->seconds = impl_->start.elapsed_ms(impl_->done) / 1000.0;
  return impl_->seconds;
}

}  // namespace accel::cuda
