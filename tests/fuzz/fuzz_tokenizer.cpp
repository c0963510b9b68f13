// libFuzzer: the tokenizer.json loader; what loads must also encode and decode a fixed text.
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "runtime/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    auto tok = accel::load_bpe_tokenizer_from_json(text, "fuzz");
    std::vector<uint32_t> ids;
    tok->encode("Hello, world! 123 \xc3\xa9t\xc3\xa9  \n\tx", &ids);
    (void)tok->decode(ids);
  } catch (const std::exception&) {
  }
  return 0;
}
