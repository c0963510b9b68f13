// libFuzzer: the tokenizer.json loader (input runs expanded, fuzz_util.h); what loads must also
// encode and decode a fixed text.
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "runtime/data/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = accel_fuzz::expand_runs(data, size);
  try {
    auto tok = accel::load_bpe_tokenizer_from_json(text, "fuzz");
    std::vector<uint32_t> ids;
    tok->encode("Hello, world! 123 \xc3\xa9t\xc3\xa9  \n\tx", &ids);
    (void)tok->decode(ids);
  } catch (const std::exception&) {
  }
  return 0;
}
