#include "ops/cpu/cpu_backend.h"

namespace accel {

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace accel
