// Compiled when the build has no CUDA: the NCCL backend says so.
#include <stdexcept>

#include "parallel/process_group.h"

namespace accel {

bool nccl_available() { return false; }

std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<TcpStore>, int, int, int,
                                                      ProcessGroupOptions) {
  throw std::runtime_error(
      "the nccl process group is not available: this build of accel-train was built without "
      "NCCL (CUDA off); rebuild with -DACCEL_CUDA=ON on a machine with the CUDA toolkit and NCCL, "
      "or use the cpu backend (distributed_type: MULTI_CPU)");
}

}  // namespace accel
