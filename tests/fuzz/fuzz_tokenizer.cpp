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
    // ASCII, NFD marks, CJK, an emoji ZWJ sequence, SentencePiece markers, special tokens and a
    // byte that is not UTF-8: every normalizer, pre-tokenizer and fallback path gets text.
    tok->encode(
        "Hello, world! 123 \xc3\xa9te\xcc\x81  \n\tx \xe6\x97\xa5\xe6\x9c\xac "
        "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb \xe2\x96\x81<s>I'M</s>\xff",
        &ids);
    (void)tok->decode(ids);
  } catch (const std::exception&) {
  }
  return 0;
}
