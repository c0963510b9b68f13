// libFuzzer: the YAML config loader. Any input must load or throw a std::exception (ConfigError,
// or a YAML parse error wrapped in one); never crash, hang or trip a sanitizer.
#include <cstdint>
#include <exception>

#include "runtime/config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  accel_fuzz::TempFile f(data, size, ".yaml");
  try {
    accel::Config c = accel::load_config(f.path(), {}, {});
    // What loads must also print and load again.
    (void)accel::config_to_yaml(c);
  } catch (const std::exception&) {
  }
  return 0;
}
