// Sizes whose element count overflows int64 (issue 26 #1): every count and stride is checked at
// the root, so a hostile shape is an error instead of a short allocation written past its end.
#include <gtest/gtest.h>

#include <stdexcept>

#include "runtime/tensor.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ACCEL_TEST_UNDER_ASAN 1
#endif
#endif

namespace accel {
namespace {

constexpr int64_t k2to62 = int64_t{1} << 62;

TEST(TensorSize, ElementCountsThatOverflowAreErrors) {
  // 2^62 * 256 wraps to 0 in int64: it used to allocate nothing and hand out the pointer.
  EXPECT_THROW(shape_numel({k2to62, 256}), std::length_error);
  EXPECT_THROW(Tensor::empty({k2to62, 256}), std::length_error);
  EXPECT_THROW(Tensor::empty({256, k2to62, 4}, DType::BF16), std::length_error);
  // Counts that fit in int64 but not in int64 bytes of the widest dtype.
  EXPECT_THROW(Tensor::empty({int64_t{1} << 61}, DType::F64), std::length_error);
  EXPECT_EQ(checked_numel({k2to62, 256}), -1);
  EXPECT_EQ(checked_numel({-1, 3}), -1);
  EXPECT_EQ(checked_numel({kMaxNumel}), kMaxNumel);
  EXPECT_EQ(checked_numel({0, k2to62, k2to62}), 0);
  EXPECT_EQ(shape_numel({3, 5}), 15);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({7, 0, k2to62, k2to62}), 0);
}

TEST(TensorSize, StridesOfHugeZeroSizeShapesAreErrors) {
  // No elements, but the leading stride 2^80 does not fit.
  EXPECT_THROW(contiguous_strides({0, int64_t{1} << 40, int64_t{1} << 40}), std::length_error);
  EXPECT_THROW(Tensor::empty({0, int64_t{1} << 40, int64_t{1} << 40}), std::length_error);
  EXPECT_EQ(contiguous_strides({2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(Tensor::empty({0, 1024, 1024}).numel(), 0);
}

TEST(TensorSize, AnAllocationTheMachineCannotHoldIsAClearError) {
#ifdef ACCEL_TEST_UNDER_ASAN
  GTEST_SKIP() << "AddressSanitizer aborts on allocations it cannot serve instead of failing them";
#endif
  // 2^58 floats (1 EiB): a count that fits, memory that no machine has.
  try {
    Tensor::empty({int64_t{1} << 58});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory on the CPU"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace accel
