// Shared helpers for the fuzz targets: the input as a temporary file (the readers open paths), and
// run expansion, which lets a short input stand for a long one.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

namespace accel_fuzz {

// Structure-aware inputs: the bytes FE FF n0 n1 c stand for the byte c repeated 16 * (n0 + 256 n1)
// times, so an input within libFuzzer's -max_len can nest JSON or YAML 100,000
// levels deep or spell a number with thousands of digits. The result is capped at 256 KiB (larger
// inputs only slow the parsers down: the limits under test are all below that). Other
// bytes pass through unchanged.
inline std::string expand_runs(const uint8_t* data, size_t size) {
  constexpr size_t kMaxBytes = size_t{256} << 10;
  std::string out;
  for (size_t i = 0; i < size && out.size() < kMaxBytes; ++i) {
    if (data[i] == 0xFE && i + 4 < size && data[i + 1] == 0xFF) {
      const size_t n = 16 * (data[i + 2] + 256 * size_t{data[i + 3]});
      out.append(std::min(n, kMaxBytes - out.size()), static_cast<char>(data[i + 4]));
      i += 4;
    } else {
      out.push_back(static_cast<char>(data[i]));
    }
  }
  return out;
}

// A file in /tmp holding the bytes, removed when this goes out of scope.
class TempFile {
 public:
  TempFile(const std::string& bytes, const char* suffix) {
    path_ = "/tmp/accel_fuzz_" + std::to_string(getpid()) + suffix;
    FILE* f = std::fopen(path_.c_str(), "wb");
    if (f) {
      if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), f);
      std::fclose(f);
    }
  }
  // The input with its runs expanded (expand_runs).
  TempFile(const uint8_t* data, size_t size, const char* suffix)
      : TempFile(expand_runs(data, size), suffix) {}
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace accel_fuzz
