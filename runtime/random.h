// Philox-4x32-10 counter-based generator: element i of a stream (seed, offset) depends only on
// (seed, offset + i), so a CUDA kernel and the CPU produce the same numbers in any order.
#pragma once

#include <cmath>
#include <cstdint>

#include "runtime/dtype.h"

namespace accel::philox {

struct U4 {
  uint32_t x, y, z, w;
};

ACCEL_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

ACCEL_HD U4 philox4x32(U4 ctr, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo(0xD2511F53u, ctr.x, &hi0);
    uint32_t lo1 = mulhilo(0xCD9E8D57u, ctr.z, &hi1);
    ctr = U4{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return ctr;
}

// The 32 random bits for element `index` of stream (seed, offset).
ACCEL_HD uint32_t bits(uint64_t seed, uint64_t offset, uint64_t index) {
  uint64_t n = offset + index;
  uint64_t block = n >> 2;
  U4 r = philox4x32(U4{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u},
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  switch (n & 3) {
    case 0:
      return r.x;
    case 1:
      return r.y;
    case 2:
      return r.z;
    default:
      return r.w;
  }
}

// Uniform in (0, 1]: never 0, so log() is safe.
ACCEL_HD float uniform(uint64_t seed, uint64_t offset, uint64_t index) {
  return (static_cast<float>(bits(seed, offset, index) >> 8) + 1.0f) * (1.0f / 16777216.0f);
}

// Standard normal by Box-Muller over elements 2i and 2i+1 of the uniform stream.
ACCEL_HD float normal(uint64_t seed, uint64_t offset, uint64_t index) {
  float u1 = uniform(seed, offset, 2 * index);
  float u2 = uniform(seed, offset, 2 * index + 1);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

}  // namespace accel::philox
