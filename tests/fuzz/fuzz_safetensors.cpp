// libFuzzer: the safetensors reader. Open, list, and load every tensor; errors must be exceptions.
#include <cstdint>
#include <exception>

#include "runtime/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  accel_fuzz::TempFile f(data, size, ".safetensors");
  try {
    accel::SafetensorsReader r(f.path());
    for (const std::string& n : r.names()) {
      const accel::SafetensorsTensorInfo& info = r.info(n);
      if (info.nbytes() > (64u << 20)) continue;  // the fuzzer's memory limit, not a bug
      accel::Tensor t = r.load(n);
      (void)r.raw_data(n);
      (void)t.numel();
    }
  } catch (const std::exception&) {
  }
  return 0;
}
