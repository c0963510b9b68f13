// The fused fp8 Llama MLP on the GPU (swiglu fused into the casts: ops/cuda/fp8_cast.cu) against
// the same projections layer by layer (unfused swiglu kernels and casts), bit for bit.
#include <gtest/gtest.h>

#include "tests/cuda/cuda_test_util.h"
#include "tests/ops/fp8_mlp_check.h"

namespace accel {
namespace {

TEST(CudaFp8Mlp, FusedMatchesLayerByLayer) {
  ACCEL_SKIP_WITHOUT_CUDA();
  for (bool residual : {false, true}) {
    test::expect_fused_mlp_matches_layers(cuda_test::gpu(), 256, 128, 256, residual);
    // padded rows and cols
    test::expect_fused_mlp_matches_layers(cuda_test::gpu(), 74, 64, 72, residual);
    test::expect_fused_mlp_matches_layers(cuda_test::gpu(), 300, 64, 520, residual);  // tiles
  }
}

}  // namespace
}  // namespace accel
