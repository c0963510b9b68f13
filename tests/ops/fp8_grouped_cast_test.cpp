// fp8_cast_grouped (the casts of a mixture of experts' operands, all groups at once) on the CPU:
// every group's bytes (row-major and transposed, padding included), scale, scale_inv and amax
// equal the single-tensor cast of that group alone (fp8_cast under delayed scaling, with its
// amax accumulation; fp8_cast_dynamic under dynamic scaling), bit for bit, over random ragged
// group sizes with empty groups, both fp8 formats, f32 and bf16 inputs, row blocks of one tensor
// and separate tensors. The CUDA kernels are held to this in tests/cuda/moe_fp8_test.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/fp8.h"
#include "tests/ops/op_test_util.h"

namespace accel {
namespace {

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = contiguous(t);
  std::vector<uint8_t> out(static_cast<size_t>(c.nbytes()));
  if (!out.empty()) std::memcpy(out.data(), c.data_ptr(), out.size());
  return out;
}

// Row counts in [0, 150] with about one in four groups empty, from `seed`.
std::vector<int64_t> ragged_sizes(size_t groups, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> sizes;
  for (size_t g = 0; g < groups; ++g)
    sizes.push_back(rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 150) + 1);
  return sizes;
}

// Row blocks of one tensor whose groups have different magnitudes (so that their amaxes and
// dynamic scales differ), with a NaN and an infinity in two of them.
std::vector<Tensor> groups_of_rows(const std::vector<int64_t>& sizes, int64_t cols, DType dtype,
                                   uint64_t seed, Tensor& whole) {
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  std::vector<double> v = test::randn({total, cols}, seed).to_vector();
  int64_t begin = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t i = begin * cols; i < (begin + sizes[g]) * cols; ++i) v[i] *= 0.01 * (1 + 7 * g);
    begin += sizes[g];
  }
  if (total > 3) v[static_cast<size_t>(cols + 1)] = NAN;  // in the first group with 2+ rows
  if (total > 40) v[static_cast<size_t>((total - 2) * cols)] = INFINITY;
  whole = Tensor::from_vector(v, {total, cols}, dtype);
  std::vector<Tensor> rows;
  begin = 0;
  for (int64_t n : sizes) {
    rows.push_back(narrow(whole, 0, begin, n));
    begin += n;
  }
  return rows;
}

struct Case {
  bool delayed;
  DType fmt, in;
  int64_t cols;
  Fp8CastOptions opts;
};

std::string name_of(const Case& c) {
  return std::string(c.delayed ? "delayed" : "dynamic") + " " + dtype_name(c.in) + " -> " +
         dtype_name(c.fmt) + " cols " + std::to_string(c.cols) + " row " +
         std::to_string(c.opts.rowwise) + " col " + std::to_string(c.opts.columnwise);
}

// The grouped cast of xs against each group's own cast; `amax_seeds` start the amax slots (some
// above a group's max |x|, some below) to show that they max-accumulate as fp8_cast's do.
void expect_groups_cast_alone(const std::vector<Tensor>& xs, const Case& c) {
  SCOPED_TRACE(name_of(c));
  const size_t G = xs.size();
  Fp8GroupScales grouped, alone;
  grouped.margin = alone.margin = c.delayed ? 0 : 1;
  if (c.delayed) {
    for (size_t g = 0; g < G; ++g) {
      // Scales apart by factors other than powers of two, so that a group cast with another's
      // scale shows.
      const float s = (c.fmt == DType::E4M3 ? 3.0f : 900.0f) * (1.0f + 0.37f * float(g));
      grouped.scales.push_back(Tensor::full({1}, s));
      const double seed = g % 3 == 0 ? 1e6 : 0.125 * double(g);
      grouped.amaxes.push_back(Tensor::full({1}, seed));
      alone.amaxes.push_back(Tensor::full({1}, seed));
    }
    grouped.amaxes[1] = Tensor();  // a group whose amax is not recorded
    alone.amaxes[1] = Tensor();
  }
  const Fp8GroupedTensor q = fp8_cast_grouped(xs, c.fmt, grouped, c.opts);
  ASSERT_EQ(q.groups(), static_cast<int64_t>(G));
  EXPECT_EQ(q.cols, c.cols);
  for (size_t g = 0; g < G; ++g) {
    SCOPED_TRACE("group " + std::to_string(g) + " of " + std::to_string(xs[g].size(0)) + " rows");
    const auto gi = static_cast<int64_t>(g);
    const Fp8Tensor got = q.group(gi);
    EXPECT_EQ(got.rows, xs[g].size(0));
    EXPECT_EQ(got.cols, c.cols);
    if (xs[g].size(0) == 0) {
      if (c.delayed && grouped.amaxes[g].defined()) {
        EXPECT_EQ(grouped.amaxes[g].item(), alone.amaxes[g].item());  // nothing recorded
      }
      continue;
    }
    const Fp8Tensor want = c.delayed
                               ? fp8_cast(xs[g], c.fmt, grouped.scales[g], alone.amaxes[g], c.opts)
                               : fp8_cast_dynamic(xs[g], c.fmt, c.opts, alone.margin);
    ASSERT_EQ(got.data.defined(), c.opts.rowwise);
    ASSERT_EQ(got.data_t.defined(), c.opts.columnwise);
    if (c.opts.rowwise) {
      EXPECT_EQ(got.data.shape(), want.data.shape());
      EXPECT_EQ(bytes_of(got.data), bytes_of(want.data)) << "data";
    }
    if (c.opts.columnwise) {
      EXPECT_EQ(got.data_t.shape(), want.data_t.shape());
      EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t)) << "data_t";
    }
    EXPECT_EQ(got.scale.item(), want.scale.item());
    EXPECT_EQ(got.scale_inv.item(), want.scale_inv.item());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got.scale_inv.data_ptr()) % 16, 0u);
    if (c.delayed && grouped.amaxes[g].defined()) {
      EXPECT_EQ(grouped.amaxes[g].item(), alone.amaxes[g].item()) << "amax";
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool delayed : {true, false})
    for (DType fmt : {DType::E4M3, DType::E5M2})
      for (DType in : {DType::F32, DType::BF16})
        for (int64_t cols : {int64_t{40}, int64_t{64}})  // 40 pads to 48
          for (int mode = 0; mode < 3; ++mode)
            out.push_back(Case{delayed, fmt, in, cols, Fp8CastOptions{mode != 2, mode != 0, 16}});
  return out;
}

TEST(Fp8CastGrouped, RowBlocksEqualEachGroupCastAlone) {
  uint64_t seed = 100;
  for (const Case& c : cases()) {
    const std::vector<int64_t> sizes = ragged_sizes(9, seed);
    SCOPED_TRACE("seed " + std::to_string(seed));
    Tensor whole;
    expect_groups_cast_alone(groups_of_rows(sizes, c.cols, c.in, seed++, whole), c);
  }
}

// Separate tensors (the experts' weights), and fixed edge sizes: 1 row, exactly 16, 17, 128 and
// 129 rows (a padded group, an aligned one, a tile of rows and one row past it), empty ends.
TEST(Fp8CastGrouped, SeparateTensorsAndEdgeSizesEqualEachGroupCastAlone) {
  const std::vector<int64_t> sizes = {0, 1, 16, 17, 0, 128, 129, 0};
  uint64_t seed = 7;
  for (const Case& c : cases()) {
    std::vector<Tensor> xs;
    for (size_t g = 0; g < sizes.size(); ++g)
      xs.push_back(test::randn({sizes[g], c.cols}, seed++, c.in, 0.5 + double(g)));
    expect_groups_cast_alone(xs, c);
  }
}

// Without any rows nothing is cast (and nothing recorded); a single group is fp8_cast.
TEST(Fp8CastGrouped, EmptyAndSingleGroups) {
  Tensor s = Tensor::full({1}, 2.0), a = Tensor::full({1}, 0.5);
  Fp8GroupScales sc;
  sc.scales = {s, s};
  sc.amaxes = {a, a};
  const Fp8GroupedTensor q =
      fp8_cast_grouped({Tensor::empty({0, 32}, DType::BF16), Tensor::empty({0, 32}, DType::BF16)},
                       DType::E4M3, sc, {true, true, 16});
  EXPECT_EQ(q.data.size(0), 0);
  EXPECT_EQ(q.data_t.numel(), 0);
  EXPECT_EQ(a.item(), 0.5);
  expect_groups_cast_alone({test::randn({33, 64}, 3, DType::BF16)},
                           Case{false, DType::E4M3, DType::BF16, 64, {true, true, 16}});
}

TEST(Fp8CastGrouped, RefusesMismatchedGroups) {
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  Tensor a = Tensor::zeros({4, 32}, DType::BF16), b = Tensor::zeros({4, 48}, DType::BF16);
  Tensor c = Tensor::zeros({4, 32}, DType::F32);
  EXPECT_NE(message([&] {
              fp8_cast_grouped({a, b}, DType::E4M3, {});
            }).find("one dtype and column count for all"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fp8_cast_grouped({a, c}, DType::E4M3, {});
            }).find("one dtype and column count for all"),
            std::string::npos);
  Fp8GroupScales one;
  one.scales = {Tensor::full({1}, 1.0)};
  EXPECT_NE(message([&] {
              fp8_cast_grouped({a, a}, DType::E4M3, one);
            }).find("1 scales for 2 groups"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fp8_cast_grouped({a}, DType::BF16, one);
            }).find("target dtype must be e4m3 or e5m2"),
            std::string::npos);
  EXPECT_NE(message([&] { fp8_cast_grouped({}, DType::E4M3, one); }).find("no groups"),
            std::string::npos);
}

}  // namespace
}  // namespace accel
