// The data pipeline's random numbers (xoshiro256** seeded through SplitMix64, spelled out so that
// shuffles and synthetic tokens are the same on every platform and standard library) and a
// content hash for cache keys.
#pragma once

#include <cstdint>
#include <string_view>

namespace accel {

inline uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Mixes several values into one seed.
inline uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c = 0) {
  uint64_t s = a;
  uint64_t h = splitmix64(&s);
  s = h ^ b;
  h = splitmix64(&s);
  s = h ^ c;
  return splitmix64(&s);
}

// FNV-1a: a stable 64-bit hash for cache keys and fingerprints (not for security).
inline uint64_t fnv1a64(std::string_view s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class DataRng {
 public:
  explicit DataRng(uint64_t seed) {
    for (uint64_t& w : s_) w = splitmix64(&seed);
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, n), n > 0, without bias (Lemire's multiply-and-reject).
  uint64_t below(uint64_t n) {
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * n;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < n) {
      const uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace accel
