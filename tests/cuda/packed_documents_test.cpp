// Packed documents on the GPU: the logits of a packed batch (segment ids, restarted positions)
// equal those of each document run alone, through the model on CUDA.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "models/decoder.h"
#include "runtime/data/loader.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/data/packed_check.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

TEST(CudaPackedDocuments, PackedForwardEqualsEachDocumentAlone) {
  ACCEL_SKIP_WITHOUT_CUDA();
  testing::TempDir dir;
  std::string text;
  for (int i = 0; i < 24; ++i)
    text += nlohmann::json{{"prompt", std::string(1 + i % 5, 'p')},
                           {"completion", std::string(3 + i % 11, static_cast<char>('a' + i))}}
                .dump() +
            "\n";
  testing::write_bytes(dir.file("sft.jsonl"), text);
  DecoderConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 256;
  c.max_position_embeddings = 64;
  c.initializer_range = 0.1;
  for (bool reset : {false, true}) {
    DataOptions o;
    o.source = DataSource::Jsonl;
    o.jsonl_files = {dir.file("sft.jsonl")};
    o.cache_dir = dir.file("cache");
    o.seq_len = 64;
    o.micro_batch_size = 3;
    o.eval_fraction = 0;
    o.reset_position_ids = reset;
    DataSources src = make_data_sources(o);
    const Batch b = src.train->next();
    CausalLM model(c, DType::F32, cuda_test::gpu(), 3);
    EXPECT_LT(testing::packed_vs_alone_max_diff(model, b, cuda_test::gpu()), 2e-3)
        << "reset_position_ids " << reset;
  }
}

}  // namespace
}  // namespace accel
