// libFuzzer: a Hugging Face config.json for read_hf_model_config (input runs expanded,
// fuzz_util.h). What validates must also pass check_batch, and a model small enough to build
// is built and run on one short batch: sizes that slip through validation would fault there.
#include <cstdint>
#include <exception>

#include "models/decoder.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  accel_fuzz::TempFile f(data, size, ".json");
  try {
    accel::DecoderConfig c = accel::read_hf_model_config(f.path());
    c.check_batch(2, 4);
    const int64_t n = c.num_parameters();
    if (n < 0 || n > 200000 || c.max_position_embeddings < 4) return 0;  // time, not bugs
    accel::CausalLM model(c, accel::DType::F32, accel::Device::cpu(), 1);
    accel::Tensor ids = accel::Tensor::zeros({2, 4}, accel::DType::I64);
    accel::Tensor logits = model.forward(ids);
    (void)model.loss(logits, ids);
  } catch (const std::exception&) {
  }
  return 0;
}
