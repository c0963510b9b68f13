// The backend's reduction (ReduceKind, ops/backend.h) and the collectives' ReduceOp
// (parallel/process_group.h) were once two different enums both named accel::ReduceOp: a file
// that included both headers did not compile. This file includes both.
#include <gtest/gtest.h>

#include <type_traits>

#include "ops/backend.h"
#include "parallel/process_group.h"

namespace accel {
namespace {

TEST(ReduceEnums, BackendReductionAndCollectiveOpAreDistinctTypes) {
  static_assert(!std::is_same_v<ReduceKind, ReduceOp>);
  // Each keeps its own set: AbsMax only in kernels, Avg only across ranks.
  EXPECT_NE(static_cast<int>(ReduceKind::AbsMax), static_cast<int>(ReduceKind::Max));
  EXPECT_NE(static_cast<int>(ReduceOp::Avg), static_cast<int>(ReduceOp::Max));
}

}  // namespace
}  // namespace accel
