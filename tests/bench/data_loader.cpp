// How fast the data pipeline delivers batches on one core, for llama-1b training batches
// (seq_len 2048, micro-batch 4, vocab 128256 -> uint32 shards). A GPU step for llama-1b consumes
// roughly 8192 tokens in tens of milliseconds (~100-300K tokens/s per H200), so the target is
// > 1M tokens/s: the loader is never what the GPU waits on.
//
//   bench_data_loader [--benchmark_filter=...]
// Also: the synthetic source and the tokenizers' encode speed (bytes of text per second).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <filesystem>

#include "runtime/data/data.h"
#include "runtime/data/random.h"

namespace accel {
namespace {

constexpr int64_t kSeqLen = 2048, kBatch = 4, kVocab = 128256;

// 16M random uint32 tokens in 4 shards (256 MB), made once per process.
const std::vector<std::string>& shard_files() {
  static std::vector<std::string> files = [] {
    const auto dir =
        std::filesystem::temp_directory_path() / ("accel_bench_data_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    std::vector<std::string> out;
    DataRng rng(1);
    std::vector<uint32_t> tokens(1 << 22);
    for (int s = 0; s < 4; ++s) {
      for (auto& t : tokens) t = static_cast<uint32_t>(rng.below(kVocab));
      out.push_back((dir / ("train-" + std::to_string(s) + ".tok")).string());
      write_token_shard(out.back(), tokens, kVocab);
    }
    std::atexit([] {
      std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                  ("accel_bench_data_" + std::to_string(getpid())));
    });
    return out;
  }();
  return files;
}

DataOptions llama1b_options() {
  DataOptions o;
  o.seq_len = kSeqLen;
  o.micro_batch_size = kBatch;
  o.vocab_size = kVocab;
  o.seed = 7;
  return o;
}

void report(benchmark::State& state, int64_t tokens_per_iter) {
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * tokens_per_iter), benchmark::Counter::kIsRate);
}

// Shuffled samples from memory-mapped uint32 shards (the page cache is warm after the first pass).
void BM_ShardLoader(benchmark::State& state) {
  DataOptions o = llama1b_options();
  o.source = DataSource::Shards;
  o.files = shard_files();
  o.world_size = static_cast<int>(state.range(0));
  auto src = make_data_sources(o).train;
  for (auto _ : state) {
    Batch b = src->next();
    benchmark::DoNotOptimize(b.input_ids.data_ptr());
  }
  report(state, kBatch * kSeqLen);
}
BENCHMARK(BM_ShardLoader)->Arg(1)->Arg(8)->ArgName("world")->Unit(benchmark::kMicrosecond);

// Opening (and validating every token of) the 16M-token corpus.
void BM_ShardOpenAndValidate(benchmark::State& state) {
  DataOptions o = llama1b_options();
  o.files = shard_files();
  for (auto _ : state) benchmark::DoNotOptimize(make_data_sources(o).train.get());
  report(state, 4 << 22);
}
BENCHMARK(BM_ShardOpenAndValidate)->Unit(benchmark::kMillisecond);

void BM_SyntheticSource(benchmark::State& state) {
  DataOptions o = llama1b_options();
  o.source = DataSource::Synthetic;
  auto src = make_data_sources(o).train;
  for (auto _ : state) {
    Batch b = src->next();
    benchmark::DoNotOptimize(b.input_ids.data_ptr());
  }
  report(state, kBatch * kSeqLen);
}
BENCHMARK(BM_SyntheticSource)->Unit(benchmark::kMicrosecond);

std::string sample_text() {
  std::string s;
  for (int i = 0; s.size() < (1 << 20); ++i) {
    s += "In the year " + std::to_string(1900 + i % 120) +
         ", the quick brown fox didn't jump over the lazy dog; instead it read "
         "\"Café Society\" (vol. " +
         std::to_string(i) + ") and slept.\n";
  }
  return s;
}

void BM_ByteTokenizerEncode(benchmark::State& state) {
  auto tok = make_byte_tokenizer();
  const std::string text = sample_text();
  std::vector<uint32_t> ids;
  for (auto _ : state) {
    ids.clear();
    tok->encode(text, &ids);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(text.size()));
}
BENCHMARK(BM_ByteTokenizerEncode)->Unit(benchmark::kMillisecond);

// BPE over a tokenizer.json given in ACCEL_BENCH_TOKENIZER (skipped without one).
void BM_BpeEncode(benchmark::State& state) {
  const char* path = std::getenv("ACCEL_BENCH_TOKENIZER");
  if (!path) {
    state.SkipWithError("set ACCEL_BENCH_TOKENIZER=path/to/tokenizer.json");
    return;
  }
  auto tok = make_tokenizer(path);
  const std::string text = sample_text();
  std::vector<uint32_t> ids;
  for (auto _ : state) {
    ids.clear();
    tok->encode(text, &ids);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(text.size()));
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * ids.size()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_BpeEncode)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace accel

BENCHMARK_MAIN();
