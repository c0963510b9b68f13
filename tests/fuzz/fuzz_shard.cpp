// libFuzzer: the token shard reader (open with validation, then read every token back).
#include <cstdint>
#include <exception>
#include <vector>

#include "runtime/data/shard.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  accel_fuzz::TempFile f(data, size, ".bin");
  for (bool validate : {true, false}) {
    try {
      auto s = accel::TokenShard::open(f.path(), validate);
      int64_t n = s->size();
      std::vector<int64_t> out(static_cast<size_t>(n));
      if (n) {
        s->read(0, n, out.data());
        (void)s->max_token(0, n);
        (void)s->at(n - 1);
      }
    } catch (const std::exception&) {
    }
  }
  return 0;
}
