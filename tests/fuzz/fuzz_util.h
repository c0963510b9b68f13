// Shared helpers for the fuzz targets: the input as a temporary file (the readers open paths).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace accel_fuzz {

// A file in /tmp holding the bytes, removed when this goes out of scope.
class TempFile {
 public:
  TempFile(const uint8_t* data, size_t size, const char* suffix) {
    path_ = "/tmp/accel_fuzz_" + std::to_string(getpid()) + suffix;
    FILE* f = std::fopen(path_.c_str(), "wb");
    if (f) {
      if (size) std::fwrite(data, 1, size, f);
      std::fclose(f);
    }
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace accel_fuzz
