// The counter-based RNG: a known-answer test of Philox-4x32-10, stream offsets (elements [k, n)
// of a stream equal the stream started at offset k), and distribution sanity.
#include "runtime/random.h"

#include <gtest/gtest.h>

#include <cmath>

#include "op_test_util.h"

namespace accel {
namespace {

TEST(Philox, KnownAnswer) {
  // Random123's kat_vectors: philox4x32-10 with counter 0 and key 0.
  philox::U4 r = philox::philox4x32(philox::U4{0, 0, 0, 0}, 0, 0);
  EXPECT_EQ(r.x, 0x6627e8d5u);
  EXPECT_EQ(r.y, 0xe169c58du);
  EXPECT_EQ(r.z, 0xbc57ac4cu);
  EXPECT_EQ(r.w, 0x9b00dbd8u);
}

TEST(Random, TailOfStreamEqualsOffsetStream) {
  const uint64_t seed = 0x1234abcd5678ull;
  const int64_t n = 1000;
  for (DType dt : {DType::F32, DType::F64}) {
    std::vector<double> full = rand_uniform({n}, seed, 10, dt).to_vector();
    std::vector<double> full_normal = rand_normal({n}, seed, 10, dt).to_vector();
    for (int64_t k : {1, 3, 4, 7, 500}) {
      std::vector<double> tail = rand_uniform({n - k}, seed, 10 + k, dt).to_vector();
      ASSERT_EQ(tail, std::vector<double>(full.begin() + k, full.end())) << "k=" << k;
    }
    // Normal element i uses uniforms 2i and 2i+1: offset 2k shifts it by k elements.
    std::vector<double> tail_normal = rand_normal({n - 5}, seed, 20, dt).to_vector();
    ASSERT_EQ(tail_normal, std::vector<double>(full_normal.begin() + 5, full_normal.end()));
  }
  // The shape does not matter, only the row-major element index.
  EXPECT_EQ(rand_uniform({4, 25}, seed, 3).to_vector(), rand_uniform({100}, seed, 3).to_vector());
  EXPECT_NE(rand_uniform({8}, seed, 0).to_vector(), rand_uniform({8}, seed + 1, 0).to_vector());
}

TEST(Random, MatchesThePhiloxFunctions) {
  std::vector<double> u = rand_uniform({9}, 77, 5).to_vector();
  std::vector<double> z = rand_normal({9}, 77, 5).to_vector();
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(u[i], philox::uniform(77, 5, i));
    EXPECT_EQ(z[i], philox::normal(77, 5, i));
  }
}

TEST(Random, DistributionSanity) {
  const int64_t n = 200000;
  std::vector<double> u = rand_uniform({n}, 42, 0).to_vector();
  double mean = 0, var = 0, lo = 1, hi = 0;
  for (double x : u) {
    mean += x;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  mean /= n;
  for (double x : u) var += (x - mean) * (x - mean);
  var /= n;
  EXPECT_NEAR(mean, 0.5, 0.005);
  EXPECT_NEAR(std::sqrt(var), 1.0 / std::sqrt(12.0), 0.005);
  EXPECT_GT(lo, 0.0);  // (0, 1]: log() of it is safe
  EXPECT_LE(hi, 1.0);

  std::vector<double> z = rand_normal({n}, 43, 0, DType::F32, Device::cpu(), 2.0, 3.0).to_vector();
  mean = var = 0;
  for (double x : z) mean += x;
  mean /= n;
  for (double x : z) var += (x - mean) * (x - mean);
  var /= n;
  EXPECT_NEAR(mean, 2.0, 0.03);
  EXPECT_NEAR(std::sqrt(var), 3.0, 0.03);

  std::vector<double> r =
      rand_uniform({1000}, 44, 0, DType::BF16, Device::cpu(), -2.0, 6.0).to_vector();
  for (double x : r) {
    EXPECT_GE(x, -2.0);
    EXPECT_LE(x, 6.0);
  }
}

}  // namespace
}  // namespace accel
